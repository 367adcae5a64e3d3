"""KV cache sizing: how many pages fit, and the longest request that fits them.

On CUDA the KV cache gets what is left of `gpu_memory_utilization` x total memory after the
weights, the activations of the largest step (measured by running one) and the sampler's
temporaries, and, when speculative steps are captured, the graphs' memory pool
(sampler_bytes). On the CPU it gets `kv_cache_memory_gb` (1 GB by default). An explicit
`num_kv_pages` or `kv_cache_memory_gb` always wins.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from dspark.attention_metadata import single_prefill_metadata
from dspark.config import CPU_KV_CACHE_GB, EngineConfig
from dspark.distributed.parallel_state import TensorParallel
from dspark.engine.kv_cache import allocate_kv_caches, kv_bytes_per_token
from dspark.models.llama import LlamaForCausalLM
from dspark.models.model_config import ModelConfig
from dspark.step_plan import pages_for

logger = logging.getLogger(__name__)

# sampler temporaries per sampled row: logits, probs, sorted logits, uniforms (float32 x vocab)
SAMPLER_BUFFERS = 6
# what the captured speculative steps keep per verified position, in float32 rows of the
# vocabulary: the graphs' pool and their shared logits (sampler_bytes)
GRAPH_POOL_BUFFERS = 13
# ... and for each captured tail size past the first (speculative_config["mixed_prefill_tokens"]
# as a list): the mixed step's three sampling modes, ~2 rows each
EXTRA_TAIL_BUFFERS = 6


@dataclass(frozen=True)
class KVPlan:
    """Derived sizes: returned and passed down, never written back into the config."""

    num_pages: int
    max_model_len: int
    page_size: int

    @property
    def capacity_tokens(self) -> int:
        return (self.num_pages - 1) * self.page_size  # the scratch page holds no request


def plan_kv(
    config: EngineConfig,
    model: LlamaForCausalLM,
    dtype: torch.dtype,
    device: torch.device,
    extra_layers: int = 0,  # the DSpark drafter's layers: its context cache shares the pages
    positions_per_row: int = 1,  # positions a row samples or verifies in a step (K + 1)
    spec_graphs: bool = False,  # speculative steps will be captured (CUDA graphs)
    num_tails: int = 1,  # tail sizes of the captured mixed speculative steps
    tp: TensorParallel | None = None,  # every rank gets the pages the fullest one can hold
) -> KVPlan:
    mc = model.config  # (with tensor parallelism the rank's shard's: its KV heads)
    per_layer = kv_bytes_per_token(mc, dtype) // mc.num_layers
    page_bytes = per_layer * (mc.num_layers + extra_layers) * config.page_size
    if config.num_kv_pages is not None:
        num_pages = config.num_kv_pages
    else:
        budget = _kv_budget_bytes(
            config, model, dtype, device, positions_per_row, spec_graphs, num_tails
        )
        num_pages = max(2, int(budget // page_bytes))
        if tp is not None:  # (the ranks share one page table: every one must hold it)
            num_pages = tp.min_over_ranks(num_pages)
    plan = KVPlan(num_pages, _max_model_len(config, mc, num_pages), config.page_size)
    logger.info(
        "KV cache: %d pages x %d tokens = %d tokens (%.2f GB); max_model_len %d allows %d "
        "requests of full length at once",
        num_pages - 1,
        config.page_size,
        plan.capacity_tokens,
        num_pages * page_bytes / 2**30,
        plan.max_model_len,
        plan.capacity_tokens // plan.max_model_len,
    )
    return plan


def _max_model_len(config: EngineConfig, mc: ModelConfig, num_pages: int) -> int:
    capacity = (num_pages - 1) * config.page_size
    ctx = mc.max_position_embeddings
    if config.max_model_len is None:
        return min(ctx, capacity)
    if config.max_model_len > ctx:
        raise ValueError(
            f"max_model_len {config.max_model_len} exceeds the model's context length {ctx}"
        )
    if config.max_model_len > capacity:
        raise ValueError(
            f"max_model_len {config.max_model_len} does not fit the KV cache ({capacity} tokens "
            f"in {num_pages - 1} pages of {config.page_size}); raise kv_cache_memory_gb or "
            "num_kv_pages, or lower max_model_len"
        )
    return config.max_model_len


def sampler_bytes(
    config: EngineConfig,
    vocab_size: int,
    positions_per_row: int = 1,
    spec_graphs: bool = False,
    num_tails: int = 1,
) -> int:
    """The sampler's temporaries at the largest batch: SAMPLER_BUFFERS float32 rows of the
    vocabulary per sampled position. A speculative step verifies K + 1 positions a row, each
    with its distribution at temperature > 0:

      max_num_seqs 512, K 7, vocab 49,152: 6 x 512 x 8 x 49,152 x 4 B = 4.5 GiB
      (one softmax over those 4,096 rows is 768 MiB; without this reserve a sampled verify at
      G = 512 ran out of memory on the H200)

    With speculative graphs (spec_graphs), GRAPH_POOL_BUFFERS rows more per position, sized
    when every graph kept its own logits live in the graphs' one pool, [8 G, V] float32 for a
    step of G windows (K = 7). The ladder's sizes halve, so each graph a size held about
    2 x 4 B per verified position of the largest G and vocabulary entry; each later cell's
    eager run before its capture needs the sampler's temporaries again beside the pool. On an
    H100 (80 GB), max_num_seqs 256 and K = 7, five graphs a size (the full block in three
    sampling modes, the mixed step in two) held 3.96 GiB (~42 B per position and entry) when
    the next cell's eager run failed to find 1.13 GiB, with only the first reserve made. With
    the mixed step captured in three modes too, six graphs a size: ~48 B or 12 rows, and one
    row of slack. The graphs write one shared logits buffer (runner/cuda_graph.py,
    graph_logits), so the pool holds one capture's temporaries and this reserve, sized before
    that buffer, is larger than they need; it stays until what the capture logs ("captured
    ... (X GiB reserved by the capture)") is measured on a GPU with a large vocabulary:

      max_num_seqs 256, K 7, vocab 49,152, graphs: (6 + 13) x 256 x 8 x 49,152 x 4 B = 7.1 GiB

    Each tail size past the first adds three mixed graphs a size, EXTRA_TAIL_BUFFERS rows:
    [256, 512] at 256 seats reserves (6 + 13 + 6) x 256 x 8 x 49,152 x 4 B = 9.4 GiB.
    """
    buffers = SAMPLER_BUFFERS
    if spec_graphs:
        buffers += GRAPH_POOL_BUFFERS + EXTRA_TAIL_BUFFERS * max(0, num_tails - 1)
    return buffers * config.max_num_seqs * positions_per_row * vocab_size * 4


def _kv_budget_bytes(
    config: EngineConfig,
    model: LlamaForCausalLM,
    dtype: torch.dtype,
    device: torch.device,
    positions_per_row: int = 1,
    spec_graphs: bool = False,
    num_tails: int = 1,
) -> float:
    if config.kv_cache_memory_gb is not None:
        return config.kv_cache_memory_gb * 2**30
    if device.type != "cuda":
        return CPU_KV_CACHE_GB * 2**30
    _, total = torch.cuda.mem_get_info(device)
    weights = torch.cuda.memory_allocated(device)
    activations = _profile_step_bytes(config, model, dtype, device)
    sampler = sampler_bytes(
        config, model.config.vocab_size, positions_per_row, spec_graphs, num_tails
    )
    budget = total * config.gpu_memory_utilization - weights - activations - sampler
    logger.info(
        "GPU memory: %.1f GB total, weights %.2f GB, step activations %.2f GB, sampler %.2f GB",
        total / 2**30,
        weights / 2**30,
        activations / 2**30,
        sampler / 2**30,
    )
    if budget <= 0:
        raise ValueError(
            f"no GPU memory left for the KV cache at gpu_memory_utilization "
            f"{config.gpu_memory_utilization}; raise it or lower max_num_batched_tokens"
        )
    return budget


@torch.inference_mode()
def _profile_step_bytes(
    config: EngineConfig, model: LlamaForCausalLM, dtype: torch.dtype, device: torch.device
) -> int:
    """Peak extra memory of one forward over max_num_batched_tokens tokens (one prefill)."""
    n = config.max_num_batched_tokens
    kv = allocate_kv_caches(model.config, pages_for(n, config.page_size) + 1, config.page_size,
                            dtype, device)  # fmt: skip
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    ids = torch.zeros(n, dtype=torch.int64, device=device)
    attn = single_prefill_metadata(n, config.page_size, device)
    rows = torch.arange(min(n, config.max_num_seqs), device=device)
    model(ids, torch.arange(n, device=device), attn, kv, rows)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del kv
    torch.cuda.empty_cache()
    return peak
