"""Automatic prefix caching: a waiting request starts on the cached pages of its longest known
prefix, and a running request's pages join the cache once their K/V is final (vLLM's design:
hash-identified full pages, reference counts, LRU eviction; the page states are the
allocator's, engine/kv_cache.py).

A full page is named by its tokens and every token before it, as a hash chain whose root is
the engine's extra key:

    page_size 4, tokens [5 6 7 8 | 9 10 11 12 | 13 14]
    h0 = H(root, [5 6 7 8])    h1 = H(h0, [9 10 11 12])    page 2 is partial: never hashed

Two requests share page i exactly when their first (i + 1) * page_size tokens are equal.

The drafter's context. With speculation the drafter's context K/V for a position lives in its
own paged cache at the same page id and slot as the target's K/V (SpecDecoder.append_context
writes it at the target's slot mapping), computed from the target's features at that position.
Every step of a speculative engine appends the context of every token it runs (prefill chunks,
plain and decode rows, captured decode graphs, windows), so a page computed there holds valid
drafter context too. The root is the drafter's identity (its checkpoint hash; "" without
speculation), so a page is only ever found by an engine whose pages carry the same drafter's
context, never by one whose pages lack it.

Why a shared page is never written:
- a page is published only when full, every token of it known on the host (no PENDING_TOKEN)
  and below num_computed_tokens, i.e. its K/V written by a step already launched (steps run in
  order on one stream, so any step that reads it later sees it whole);
- every step writes at positions >= num_computed_tokens of its request (prefill chunks, decode
  rows, windows with their rejected drafts and the drafter's block from the anchor on), and
  num_computed_tokens only grows while a request runs; a window's drafts reach it only once
  accepted, so a page with a draft not yet verified is never full below it;
- a lookup leaves at least one token to compute (hits cover at most (num_tokens - 1) //
  page_size pages), so the step that admits a request samples its next token, and the pages it
  shares all lie below its num_computed_tokens.
Preemption and aborts drop the request's references (Scheduler._preempt, finish); a page
nobody holds stays cached until evicted.

Counters as vLLM's (in tokens): `num_queries` += a request's tokens and `num_hits` += the
tokens its cached pages cover, once per admission (a preempted request's re-admission counts
again, its own pages possibly among the hits).
"""

from __future__ import annotations

import hashlib
from array import array

from dspark.engine.kv_cache import PageAllocator
from dspark.request import PENDING_TOKEN, Request
from dspark.step_plan import pages_for


def page_hash(parent: bytes, tokens: list[int]) -> bytes:
    """H(parent, tokens): a 128-bit BLAKE2b digest of the parent's digest and the page's
    tokens as 64-bit integers (collision-resistant: a collision would hand one request another
    prefix's K/V)."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(array("q", tokens).tobytes())
    return h.digest()


def root_hash(extra_key: str) -> bytes:
    """The chain's root: the engine's extra key (the drafter's identity, or "")."""
    return hashlib.blake2b(extra_key.encode(), digest_size=16).digest()


class PrefixCache:
    def __init__(self, allocator: PageAllocator, page_size: int, extra_key: str = "") -> None:
        self.allocator = allocator
        self.page_size = page_size
        self.root = root_hash(extra_key)
        self.num_queries = 0  # tokens of admitted requests looked up (vLLM's prefix_cache_queries)
        self.num_hits = 0  # of those, tokens found in cached pages (vLLM's prefix_cache_hits)

    def reset_counters(self) -> None:
        """The hit counters from zero (after a start-up profile, whose prompts hit)."""
        self.num_queries = self.num_hits = 0

    def page_hashes(self, req: Request, num_pages: int) -> list[bytes]:
        """req's chain over its first num_pages pages, fewer where a page is partial or holds
        a token still on the device; kept on the request (its known tokens never change while
        it lives)."""
        hashes, tokens, size = req.page_hashes, req.token_ids, self.page_size
        while len(hashes) < num_pages:
            i = len(hashes)
            page = tokens[i * size : (i + 1) * size]
            if len(page) < size or PENDING_TOKEN in page:
                break
            hashes.append(page_hash(hashes[-1] if hashes else self.root, page))
        return hashes[:num_pages]

    def match(self, req: Request) -> list[int]:
        """The cached pages holding req's longest cached prefix, leaving its last token (at
        least) to compute: tokens [0 .. 37] with page_size 16 may hit pages 0 and 1 (32 tokens);
        tokens [0 .. 31] only page 0, so that token 31 is computed and samples token 32.
        None for a request that wants prompt_logprobs (as vLLM): its prompt must be scored,
        which only its own prefill does."""
        if req.prompt_logprobs is not None:
            return []
        limit = (req.num_tokens - 1) // self.page_size
        return self.allocator.lookup(self.page_hashes(req, limit))

    def admit(self, req: Request, hit: list[int], num_tokens: int) -> bool:
        """Give a waiting request the pages for its first num_tokens tokens: `hit` (from
        match()) shared, the rest allocated, its KV computed up to the hit pages' end. False,
        with nothing changed, when too few pages are free."""
        need = pages_for(num_tokens, self.page_size) - len(hit)
        if need > self.allocator.num_free_after_sharing(hit):
            return False
        self.allocator.share(hit)
        req.page_ids = hit + self.allocator.allocate(need)
        req.num_computed_tokens = len(hit) * self.page_size
        req.num_published_pages = len(hit)
        self.num_queries += req.num_tokens
        self.num_hits += req.num_computed_tokens
        return True

    def publish(self, req: Request) -> None:
        """Publish req's pages that are final now: full, below num_computed_tokens, their
        tokens known (module docstring)."""
        num_full = min(req.num_computed_tokens // self.page_size, len(req.page_ids))
        hashes = self.page_hashes(req, num_full)
        for i in range(req.num_published_pages, len(hashes)):
            self.allocator.publish(req.page_ids[i], hashes[i])
        req.num_published_pages = max(req.num_published_pages, len(hashes))
