"""Compile Triton kernels for the H200 (sm_90) without a GPU, and print their resources.

    PYTHONPATH=. python bench/compile_sm90.py [name ...]

Triton's compiler and ptxas need no device, so a kernel that only ever ran in the interpreter
(CPU CI, a session without the GPU) can at least be checked to compile for sm_90, with the
launch options the code uses, and its registers and spills read from the cubin (cuobjdump).
It does not run the kernel: equality is the kernel tests' job, on the GPU and through the
interpreter. Each case below gives SmolLM2's shapes; names select cases (default: all).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from dspark.kernels.context_kv_triton import _context_kv_kernel
from dspark.kernels.continuations_triton import _continuations_kernel
from dspark.kernels.verify_greedy_triton import _verify_greedy_kernel

CONTEXT_KV_ARGS = {
    "proj_ptr": "*bf16", "bias_ptr": "*bf16", "positions_ptr": "*i64", "inv_freq_ptr": "*fp32",
    "slot_ptr": "*i64", "cache_ptr": "*bf16", "s_proj": "i32", "s_layer": "i64", "s_kv": "i64",
    "eps": "fp32",
}  # fmt: skip

# name -> (kernel, {argument: type}, {constexpr: value}, options)
CASES = {
    "context_kv": (
        _context_kv_kernel,
        CONTEXT_KV_ARGS,
        {"D": 576, "BLOCK_D": 1024, "COL0": 576, "NUM_LAYERS": 2, "NUM_KV_HEADS": 3, "HALF": 32,
         "BLOCK_KV": 4, "BLOCK_HALF": 32, "HAS_BIAS": False, "PDL": True},
        {"num_warps": 1, "enable_fp_fusion": False},
    ),
    "context_kv_bias": (
        _context_kv_kernel,
        CONTEXT_KV_ARGS,
        {"D": 896, "BLOCK_D": 1024, "COL0": 896, "NUM_LAYERS": 2, "NUM_KV_HEADS": 2, "HALF": 32,
         "BLOCK_KV": 2, "BLOCK_HALF": 32, "HAS_BIAS": True, "PDL": True},  # a Qwen2-0.5B shape
        {"num_warps": 1, "enable_fp_fusion": False},
    ),
    "continuations": (
        _continuations_kernel,
        {"rows_ptr": "*i64", "src_ptr": "*i64", "next_pos_ptr": "*i64", "next_tok_ptr": "*i64",
         "block_table_ptr": "*i32", "bt_stride": "i32", "input_ids_ptr": "*i64",
         "positions_ptr": "*i64", "slot_mapping_ptr": "*i64", "seq_lens_ptr": "*i32",
         "anchors_ptr": "*i64", "anchor_pos_ptr": "*i64", "block_positions_ptr": "*i64",
         "block_slots_ptr": "*i64", "block_seq_lens_ptr": "*i32", "limits_ptr": "*i64",
         "verify_len_ptr": "*i64", "verify_cap_ptr": "*i64"},
        {"WIDTH": 8, "K": 7, "PAGE_SIZE": 16, "BLOCK": 8},
        {"num_warps": 4},
    ),
    "verify_greedy": (
        _verify_greedy_kernel,
        {"target_tokens_ptr": "*i64", "draft_ptr": "*i64", "verify_len_ptr": "*i64",
         "cu_ptr": "*i64", "tokens_ptr": "*i64", "num_accepted_ptr": "*i64",
         "num_target_rows": "i32", "s_draft": "i32", "s_draft_k": "i32", "s_tokens": "i32"},
        {"K": 7, "BLOCK": 8, "PDL": True},
        {"num_warps": 1},
    ),
}  # fmt: skip


def compile_case(name: str) -> str:
    kernel, args, constexprs, options = CASES[name]
    signature = args | {k: "constexpr" for k in constexprs}
    order = list(signature)
    src = ASTSource(fn=kernel, signature=signature,
                    constexprs={(order.index(k),): v for k, v in constexprs.items()})  # fmt: skip
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(compiled.asm["cubin"])
    tool = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    usage = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True,
                           text=True, check=True).stdout  # fmt: skip
    os.unlink(f.name)
    line = next(x.strip() for x in usage.splitlines() if x.strip().startswith("REG:"))
    return line


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("names", nargs="*", default=list(CASES), help=f"of {sorted(CASES)}")
    args = ap.parse_args()
    unknown = [n for n in args.names if n not in CASES]
    if unknown:
        print(f"unknown cases {unknown}; expected some of {sorted(CASES)}", file=sys.stderr)
        return 2
    print(f"triton {triton.__version__}, sm_90")
    for name in args.names:
        print(f"{name:>18}  {compile_case(name)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
