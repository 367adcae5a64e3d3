"""Paged KV cache: the page allocator, and the per-layer cache tensors.

Page SCRATCH_PAGE is reserved: it is never handed to a request. Pad rows (and anything else that
must write somewhere harmless) write there, so a zero-initialised slot buffer is harmless too.
"""

from __future__ import annotations

import torch

from dspark.models.model_config import ModelConfig
from dspark.step_plan import SCRATCH_PAGE  # (the runner keeps them too)


class PageAllocator:
    def __init__(self, num_pages: int) -> None:
        assert num_pages >= 2, "need the scratch page and at least one usable page"
        self.num_pages = num_pages
        # pop() from the end hands out low page ids first
        self._free = list(range(num_pages - 1, SCRATCH_PAGE, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_usable(self) -> int:
        return self.num_pages - 1

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise MemoryError(f"asked for {n} KV pages, {len(self._free)} free")
        return [self._free.pop() for _ in range(n)]

    def free(self, pages: list[int]) -> None:
        assert SCRATCH_PAGE not in pages, "the scratch page is never allocated, so never freed"
        self._free.extend(reversed(pages))


def kv_bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * elem


def allocate_kv_caches(
    config: ModelConfig,
    num_pages: int,
    page_size: int,
    dtype: torch.dtype,
    device: torch.device,
    num_layers: int | None = None,  # default: the model's; the drafter has fewer
) -> list[torch.Tensor]:
    """One [2, num_pages, page_size, nkv, hd] tensor (K then V) per layer."""
    shape = (2, num_pages, page_size, config.num_kv_heads, config.head_dim)
    n = config.num_layers if num_layers is None else num_layers
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n)]
