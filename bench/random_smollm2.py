"""Write a random-weight checkpoint with SmolLM2-135M's exact shapes (HF directory, bf16).

    python bench/random_smollm2.py --out smollm2-random --tokenizer DIR

Decoding speed does not depend on weight values (requests run with ignore_eos to a fixed
length), so this stands in for the real checkpoint in speed measurements on a machine that has
no copy of the GGUF file. It is never used for quality or acceptance figures.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch


def main() -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--tokenizer", required=True, help="a directory with tokenizer.json")
    args = parser.parse_args()
    config = LlamaConfig(  # SmolLM2-135M-Instruct, as its GGUF metadata gives it
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
        rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=1,
        eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    out = Path(args.out)
    model.save_pretrained(out, safe_serialization=True)
    for f in Path(args.tokenizer).iterdir():
        shutil.copy(f, out / f.name)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
