"""Engine configuration: one frozen dataclass, validated once, then handed down in parts."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dspark import envs

DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
DTYPE_CHOICES = ("auto", *DTYPES)
DEVICE_CHOICES = ("auto", "cpu", "cuda")
# the kernels the model runs: "torch" (the PyTorch reference ops) or "triton" (Triton kernels for
# attention, KV store, norms, rotary and SiLU). auto: triton on CUDA, torch on the CPU.
ATTENTION_BACKENDS = ("auto", "torch", "triton")
CPU_KV_CACHE_GB = 1.0


@dataclass(frozen=True)
class EngineConfig:
    model: str = "default"
    revision: str | None = None  # of a Hub model "org/name": a branch, tag or commit; None: main
    dtype: str = "auto"  # auto: bfloat16 on CUDA, float32 on the CPU
    device: str = "auto"  # auto: cuda when available
    max_model_len: int | None = None  # None: the checkpoint's context length, capped by KV
    max_num_seqs: int = 256  # requests running at once
    # tokens per step (chunked prefill splits longer prompts; every step carries all the decode
    # rows, then one chunk). Offline, 8,192: prefill steps run eagerly and are host-bound on the
    # GPU (~10 ms a step whether it carries 2,048 or 8,192 tokens on the H200, measured by
    # bench/prefill_profile.py before 04a7e3c), so fewer, larger steps finish sooner. `dspark
    # serve` defaults to 2,048 (server/cli.py, vLLM's online value): a step lasts as long as its
    # chunk, and while a long prompt arrives every running stream waits that long for its next
    # token
    max_num_batched_tokens: int = 8192
    page_size: int = 16  # tokens per KV page
    num_kv_pages: int | None = None  # None: sized from kv_cache_memory_gb or GPU memory
    kv_cache_memory_gb: float | None = None  # None: 1 GB on the CPU, the free GPU memory on CUDA
    gpu_memory_utilization: float = 0.9  # fraction of GPU memory the engine may use in all
    attention_backend: str = "auto"
    use_cuda_graphs: bool = True  # decode steps replay captured graphs (CUDA + triton only)
    # schedule and launch step N+1 before reading step N's tokens back (host work overlaps the
    # GPU's), drafting steps of full windows too (their anchors written on the device from step
    # N's verification, engine.py); off, every step waits for its own results
    async_scheduling: bool = True
    # automatic prefix caching (vLLM's name and default): full KV pages keyed by the hash chain
    # of their tokens are kept after their request ends and shared by requests that start with
    # the same tokens, which then skip their prefill (engine/prefix_cache.py)
    enable_prefix_caching: bool = True
    # with CUDA graphs: a decode step that also carries prefill chunks (at most 4 rows of up to
    # this many tokens in all: requests admitted while others decode) replays a captured mixed
    # decode graph instead of running eagerly (runner/mixed_layout.py); 0: such steps run
    # eagerly. In a closed loop whose requests end at different steps, 256 ran plain decoding
    # 1.43x / 2.88x / 3.84x faster than 0 at 16 / 64 / 256 requests (H200). (Drafting steps have
    # their own: speculative_config["mixed_prefill_tokens"].)
    mixed_prefill_tokens: int = 256
    # output tokens a streamed ("delta") request gathers before it is reported (vLLM's and
    # SGLang's stream_interval); its first token and its end are reported at once
    stream_interval: int = 1
    seed: int = 0  # draws the seeds of requests that set none
    log_stats_interval_s: float = 10.0  # the periodic stats log line (engine/stats_log.py); 0: off
    # ranks the target (and drafter) are sharded over, one process and device each (Megatron
    # style: heads, MLP rows and vocabulary split; dspark/distributed/). 1: no other process
    tensor_parallel_size: int = 1
    # the port rank 0 listens on for the others (127.0.0.1); None: a free one
    distributed_port: int | None = None
    # {"method": "dspark", "model": PATH, "num_speculative_tokens": K}; None: no speculation
    speculative_config: dict | None = field(default=None, hash=False)

    def __post_init__(self) -> None:
        _require(
            self.dtype in DTYPE_CHOICES, f"dtype must be one of {DTYPE_CHOICES}, got {self.dtype!r}"
        )
        _require(
            self.device in DEVICE_CHOICES or self.device.startswith("cuda:"),
            f"device must be one of {DEVICE_CHOICES} or 'cuda:N', got {self.device!r}",
        )
        _require(self.page_size >= 1, f"page_size must be >= 1, got {self.page_size}")
        _require(self.max_num_seqs >= 1, f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        _require(
            self.max_num_batched_tokens >= self.max_num_seqs,
            f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
            f"({self.max_num_seqs}) so every running request gets a token each step",
        )
        if self.max_model_len is not None:
            _require(
                self.max_model_len >= 2, f"max_model_len must be >= 2, got {self.max_model_len}"
            )
        if self.num_kv_pages is not None:
            _require(self.num_kv_pages >= 2, f"num_kv_pages must be >= 2, got {self.num_kv_pages}")
        if self.kv_cache_memory_gb is not None:
            _require(
                self.kv_cache_memory_gb > 0,
                f"kv_cache_memory_gb must be > 0, got {self.kv_cache_memory_gb}",
            )
        _require(
            0.0 < self.gpu_memory_utilization <= 1.0,
            f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}",
        )
        _require(
            type(self.mixed_prefill_tokens) is int and 0 <= self.mixed_prefill_tokens <= 8192,
            f"mixed_prefill_tokens must be an integer in [0, 8192], got "
            f"{self.mixed_prefill_tokens!r}",
        )
        _require(
            isinstance(self.stream_interval, int) and self.stream_interval >= 1,
            f"stream_interval must be an integer >= 1, got {self.stream_interval!r}",
        )
        _require(
            type(self.tensor_parallel_size) is int and self.tensor_parallel_size >= 1,
            f"tensor_parallel_size must be an integer >= 1, got {self.tensor_parallel_size!r}",
        )
        if self.distributed_port is not None:
            _require(
                type(self.distributed_port) is int and 1 <= self.distributed_port <= 65535,
                f"distributed_port must be an integer in [1, 65535], got {self.distributed_port!r}",
            )
        self.spec()  # validates the speculative_config
        _require(
            self.attention_backend in ATTENTION_BACKENDS,
            f"attention_backend must be one of {ATTENTION_BACKENDS}, "
            f"got {self.attention_backend!r}",
        )

    def spec(self):
        from dspark.spec.config import SpecConfig

        return SpecConfig.from_dict(self.speculative_config)

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device {self.device!r} was asked for but CUDA is not available")
        return torch.device(self.device)

    def attention_backend_for(self, device: torch.device) -> str:
        if envs.ENVS.reference_ops:  # (debugging: every op on its PyTorch reference)
            return "torch"
        if self.attention_backend == "auto":
            return "triton" if device.type == "cuda" else "torch"
        return self.attention_backend

    def torch_dtype(self, device: torch.device) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        return DTYPES[self.dtype]


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
