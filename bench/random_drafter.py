"""Write a random-initialised DSpark drafter for a target checkpoint (the cost of speculation).

    python bench/random_drafter.py --target smollm2-random --out drafter-random

The drafter has the default recipe's shape (2 layers, K = 7, taps (1, 10, 19, 28), Markov rank
64, confidence head) and passes the identity check against `--target`. Its drafts are almost
never accepted: it measures what drafting and verifying cost per step, never acceptance.
"""

from __future__ import annotations

import argparse

import torch

from dspark.models.drafter_config import DrafterConfig
from dspark.models.dspark_drafter import DSparkDrafter, target_identity
from dspark.models.llama import build_model
from dspark.models.loader import checkpoint_hash, load_checkpoint, resolve_model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", default="default")
    parser.add_argument("--out", required=True)
    parser.add_argument("--draft-len", type=int, default=7)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--markov-rank", type=int, default=64)
    args = parser.parse_args()
    write_random_drafter(args.target, args.out, args.draft_len, args.num_layers, args.markov_rank)
    print(f"wrote {args.out}")


def write_random_drafter(
    target_path: str, out: str, draft_len: int = 7, num_layers: int = 2, markov_rank: int = 64
) -> None:
    source = resolve_model(target_path)
    config, weights = load_checkpoint(source)
    target = build_model(config, weights, torch.float32, torch.device("cpu"))
    taps = tuple(sorted({min(t, config.num_layers - 1) for t in (1, 10, 19, 28)}))
    h = checkpoint_hash(source)
    cfg = DrafterConfig(target_identity(target, h), draft_len=draft_len, target_layers=taps,
                        num_layers=num_layers, markov_rank=markov_rank)  # fmt: skip
    torch.manual_seed(0)
    drafter = DSparkDrafter(cfg, target, h)
    with torch.no_grad():
        for p in drafter.parameters():
            if p.dim() >= 2:
                torch.nn.init.normal_(p, std=0.02)
        drafter.mask_embedding.normal_(std=0.02)
    drafter.save(out)


if __name__ == "__main__":
    main()
