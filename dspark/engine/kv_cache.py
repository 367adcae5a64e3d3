"""Paged KV cache: the page allocator (with the prefix cache's page states), and the per-layer
cache tensors.

Page SCRATCH_PAGE is reserved: it is never handed to a request. Pad rows (and anything else that
must write somewhere harmless) write there, so a zero-initialised slot buffer is harmless too.

With prefix caching (engine/prefix_cache.py decides which pages are published and looked up),
a page is in one of three states:
  in use     ref count > 0: owned by one request, or shared by several that hit it
  cached     ref count 0 and a hash: its K/V still valid, evictable, kept in LRU order
  free       ref count 0, no hash
`allocate` takes free pages first and evicts the least recently freed cached pages after them,
so a cached page is overwritten only when nothing else is left; `num_free` counts both, as
vLLM's KV usage does (a cached page costs nothing to reclaim).
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from dspark.models.model_config import ModelConfig
from dspark.step_plan import SCRATCH_PAGE  # (the runner keeps them too)


class PageAllocator:
    def __init__(self, num_pages: int) -> None:
        assert num_pages >= 2, "need the scratch page and at least one usable page"
        self.num_pages = num_pages
        # pop() from the end hands out low page ids first
        self._free = list(range(num_pages - 1, SCRATCH_PAGE, -1))
        self._refs = [0] * num_pages
        # cached pages: hash -> page and back; those with no reference in LRU order (the first
        # is evicted first)
        self._page_of: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self.num_evictions = 0

    @property
    def num_free(self) -> int:
        """Pages `allocate` can hand out: free ones and cached ones without a reference."""
        return len(self._free) + len(self._evictable)

    @property
    def num_usable(self) -> int:
        return self.num_pages - 1

    @property
    def num_cached(self) -> int:
        """Pages holding published K/V (in use or evictable)."""
        return len(self._page_of)

    def ref_count(self, page: int) -> int:
        return self._refs[page]

    def allocate(self, n: int) -> list[int]:
        """n pages for one request's exclusive use (ref count 1): free pages first, then the
        least recently used cached ones, whose hashes are dropped (evicted)."""
        if n > self.num_free:
            raise MemoryError(f"asked for {n} KV pages, {self.num_free} free")
        pages = []
        for _ in range(n):
            if self._free:
                page = self._free.pop()
            else:
                page, _ = self._evictable.popitem(last=False)
                del self._page_of[self._hash_of.pop(page)]
                self.num_evictions += 1
            self._refs[page] = 1
            pages.append(page)
        return pages

    def free(self, pages: list[int]) -> None:
        """Drop one reference to each page (a request's, in its order). A page nobody holds
        becomes free, or evictable if cached: a request's last pages first, so its longest
        prefixes (the least likely to be shared) are evicted before its first ones."""
        assert SCRATCH_PAGE not in pages, "the scratch page is never allocated, so never freed"
        refs = self._refs
        for page in reversed(pages):
            assert refs[page] > 0, f"page {page} freed with no reference"
            refs[page] -= 1
            if refs[page]:
                continue
            if page in self._hash_of:
                self._evictable[page] = None
            else:
                self._free.append(page)

    # ---- the prefix cache's pages ---------------------------------------------------------

    def lookup(self, hashes: list[bytes]) -> list[int]:
        """The cached pages of the longest run of `hashes` from the first (no change made)."""
        pages = []
        for h in hashes:
            page = self._page_of.get(h)
            if page is None:
                break
            pages.append(page)
        return pages

    def num_free_after_sharing(self, pages: list[int]) -> int:
        """num_free once `pages` (cached) are shared: the evictable ones among them leave it."""
        return self.num_free - sum(1 for p in pages if p in self._evictable)

    def share(self, pages: list[int]) -> None:
        """One more reference to each cached page (a request that hit them)."""
        for page in pages:
            assert page in self._hash_of, f"page {page} is not cached"
            if not self._refs[page]:
                del self._evictable[page]
            self._refs[page] += 1

    def publish(self, page: int, page_hash: bytes) -> bool:
        """Cache a page in use whose K/V is final under `page_hash`. False where another page
        holds that hash already (two requests computed the same prefix at once): this one stays
        private, and is freed as any other page."""
        assert self._refs[page] > 0 and page not in self._hash_of, page
        if page_hash in self._page_of:
            return False
        self._page_of[page_hash] = page
        self._hash_of[page] = page_hash
        return True

    def cached_pages(self) -> dict[bytes, int]:
        """hash -> page of every cached page (a copy, for checks)."""
        return dict(self._page_of)


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
