"""The paged KV memory pool: one preallocated arena of fixed-size pages shared by every request.

Sources: vLLM's PagedAttention (Kwon et al., SOSP 2023: block tables, on-demand blocks, automatic prefix
caching keyed by a hash chain of token ids, reference counts, LRU reuse of cached blocks) and the seed
documents' memory pool (seed 000 §3.2: a preallocated layered pool, eviction by LRU over token position x
layer depth; seed 004 §3.2: preallocation and periodic compaction).

Layout
------
One key and one value arena, ``[n_kv_heads, capacity + 1, page_size, head_dim]`` each (:meth:`KVPool.for_engine`,
sized by a budget in MiB or tokens). With ``prealloc="full"`` (the default) the arena holds the whole budget from the
start (``capacity == num_pages``). With ``prealloc="staged"`` (seed 004 §3.2, progressive pre-allocation) it starts
at :data:`STAGED_FIRST_PAGES` pages (or the budget, if smaller) and doubles, up to the budget, when a page is
needed and none is free or cached (cached prefix pages are reused first, so the arena follows the live load, not the
traffic so far): a step allocates the larger arena and copies the pages in use (page numbers do not change, so no
table is rewritten). Admission counts the budget, not the arena, so a staged pool admits exactly the requests
a full one does; memory follows the load. A growth holds both arenas for the copy (at most 1.5x the budget for that
moment). ``prealloc="request"`` keeps no arena at all (only the null page): it is the baseline the pool is measured
against, plain per-request allocation, where the scheduler gives each admitted request its own contiguous
:class:`~laserlm.runtime.kv_cache.KVCache` (prompt + ``max_tokens`` positions) and frees it when the request
finishes; the pool then only keeps the budget's accounting (admission is the same). A *page* holds ``page_size`` consecutive
positions of **one** decoder layer; page 0 is the null page (never handed out; padding of batched gathers).
Every request owns a :class:`PagedCache`: a page table ``[num_layers, max_pages]`` (physical page of each
logical page, per layer; 0 = no page). Pages are taken on demand as the request's positions grow and all go
back when it finishes or is cancelled (:meth:`PagedCache.free`).

Blocks per layer group
----------------------
Seed 004 §3.2 gives each execution group a fixed block of the pool. With ``groups`` (``--kv-groups``: layer groups
such as the adaptive scheduler's) the arena is cut into one contiguous block of page numbers per group, sized by its
share of the layers (``num_pages // num_layers`` pages per layer, so the budget is rounded down to a multiple of the
layer count): a page of layer ``j`` is always taken from the block of ``j``'s group, reused, copied and compacted
inside it. Every request holds the same number of pages at each layer (without eviction), so a block never runs out
before the budget does and admission is unchanged. The default is one block for all layers. Blocks need the whole
arena from the start (``prealloc="full"``).

Because the table is per layer, a policy can drop a page of one layer and keep the same positions in the
others (the seed's depth-aware eviction, :mod:`laserlm.runtime.eviction`).

Skipped layers need no page
---------------------------
Under the ``none`` bridge (D-LLM) a token that exits after layer ``e`` writes no K/V at layers ``e..L-1``: its slots
there are masked holes. When the token that closes a page (its last slot) has been run,
:meth:`PagedCache.release_skipped` returns that page at every layer where **none** of its ``page_size`` positions
holds K/V (every token of the page exited before that layer): the page goes back to the pool and (without
eviction) the scheduler lowers the request's reservation by one page, so the saving admits other requests. A page is taken when its first
position is written and is only known to be empty when it is full, so a request still holds the page being filled
at every layer; the saving is in the pages behind it. The ``propagate`` and ``deferred`` bridges write every
layer and release nothing.

Reading through the table
-------------------------
A forward opens a :class:`PagedWindow` (the object the attention modules receive as ``cache=``, like
:class:`~laserlm.runtime.kv_cache.CacheWindow`). ``update`` writes the new K/V into their pages and returns the
layer's keys and values gathered back into ``[B, n_kv, S, head_dim]``. For one request without evictions the
gather is exactly the contiguous cache's ``[:, :, :end]`` (same values, same length, so attention is the same
computation); with several rows (continuous batching) or evicted pages it also records the absolute position
of every gathered key in the attention context (``AttentionContext.key_positions``, ``-1`` = padding), and the
attention function masks by position. The gather copies the live K/V once per layer and step: that is the price
of paging without a paged-attention kernel.

Prefix reuse
------------
Full pages of a prompt are registered under ``(hash chain of the token ids of pages 0..i, path key, layer)``
(:func:`page_hashes`) once the prompt has been prefilled. A later request with the same first tokens takes
those pages (reference count + 1) instead of recomputing them; pages nobody references stay cached and are
reused least-recently-released first when the free list is empty. A page written through a bridge depends on
the exits taken, not only on the tokens, so only pages computed at full depth may be shared: the scheduler
registers prompt pages only for modes whose prefill runs every layer and can start after a shared prefix
(``mode.prefill_key == "full"``: full depth and adaptive depth), and the key includes that path key. Writing into a page that is shared
or registered copies it first (copy-on-write), so a cached page never changes.
"""

from __future__ import annotations

import bisect
import hashlib
import heapq
import math
import operator
import re
from collections import OrderedDict
from dataclasses import dataclass

import torch

from ..errors import InvalidArgumentError, PoolFullError
from . import attention as attn
from .kv_cache import CachePositions, KVCache, RequestBatch

DEFAULT_PAGE_SIZE = 16
DEFAULT_BUDGET = "512MiB"
PREALLOC = ("full", "staged", "request")


def parse_kv_groups(spec, num_layers: int | None = None) -> tuple[tuple[int, int], ...]:
    """Layer groups of the pool's blocks as half-open ``(start, stop)`` ranges tiling ``0 .. num_layers``.

    ``spec``: ``None`` (one group of every layer), an int or ASCII-digit string ``N`` (groups of ``N`` layers, the
    last takes the remainder; ``N`` at most the layer count), group end boundaries ``"8/16/24/30"`` (increasing,
    the last must be ``num_layers``), or a sequence of ``(start, stop)`` pairs. With ``num_layers=None`` only the
    syntax is checked (no model yet) and ``()`` is returned.

    Raises:
        InvalidArgumentError: anything else, or groups that do not tile the layers; the message says which.
    """
    if spec is None:
        return () if num_layers is None else ((0, num_layers),)
    example = "8/16/30" if num_layers is None else f"8/16/{num_layers}"

    def bad(why: str) -> InvalidArgumentError:
        of = "" if num_layers is None else f" (the model has {num_layers} layers)"
        return InvalidArgumentError(f"KV groups {spec!r}: {why}{of}; expected N (groups of N layers) or group end "
                                    f"boundaries such as {example}")

    size = None
    if isinstance(spec, bool):
        raise bad("not a number")
    if isinstance(spec, str) and re.fullmatch(r"\s*\d+\s*", spec, re.ASCII):
        size = int(spec)
    elif not isinstance(spec, str):
        try:
            size = operator.index(spec)
        except TypeError:
            pass
    if size is not None:
        if size <= 0:
            raise bad("a group needs at least one layer")
        if num_layers is None:
            return ()
        if size > num_layers:
            raise bad(f"groups of {size} layers are more than the model's layers")
        return tuple((a, min(a + size, num_layers)) for a in range(0, num_layers, size))
    if isinstance(spec, str):
        parts = spec.strip().split("/")
        if not all(re.fullmatch(r"\d+", x, re.ASCII) for x in parts):
            raise bad("not N or boundaries of ASCII digits separated by /")
        ends = [int(x) for x in parts]
        bounds = list(zip([0] + ends[:-1], ends))
    else:
        try:
            bounds = [(int(a), int(b)) for a, b in spec]
        except (TypeError, ValueError):
            raise bad("not N, boundaries or (start, stop) pairs") from None
    if not bounds:
        raise bad("no group")
    if bounds[0][0] != 0 or any(bounds[i][1] != bounds[i + 1][0] for i in range(len(bounds) - 1)):
        raise bad("the groups must follow each other from layer 0")
    if any(a >= b for a, b in bounds):
        raise bad("the boundaries must increase (a group needs at least one layer)")
    if num_layers is None:
        return ()
    if bounds[-1][1] != num_layers:
        raise bad(f"the last boundary must be {num_layers}, the model's layer count, not {bounds[-1][1]}")
    return tuple(bounds)


STAGED_FIRST_PAGES = 1024  # the first arena of a staged pool: 16k positions of one layer at the default page size


@dataclass
class Budget:
    """A KV budget: ``pages`` pages of ``page_size`` positions of one layer (``text``: as the user wrote it)."""

    pages: int
    page_size: int
    text: str


def budget_amount(budget) -> tuple[str, float, str]:
    """``(text, value, unit)`` of a budget (unit ``mib``/``gib``/... or ``t...`` for tokens), checking its syntax.

    Raises:
        InvalidArgumentError: unparsable or non-positive.
    """
    text = str(DEFAULT_BUDGET if budget is None else budget).strip()
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(mib|mb|m|gib|gb|g|t|tok|tokens?)?", text.lower())
    if not m or float(m.group(1)) <= 0:
        raise InvalidArgumentError(f"KV budget {text!r}: expected MiB (e.g. 512 or 512MiB, 2GiB) or tokens "
                                   "(e.g. 8192t)")
    return text, float(m.group(1)), m.group(2) or "mib"


def parse_budget(budget, num_layers: int, page_bytes: int, page_size: int) -> Budget:
    """``"512MiB"``, ``"2GiB"``, ``512`` (MiB) or ``"8192t"`` / ``"8192 tokens"`` (positions of every layer)
    -> a :class:`Budget` in pages.

    Raises:
        InvalidArgumentError: unparsable, non-positive, or smaller than one page per layer.
    """
    text, value, unit = budget_amount(budget)
    if unit.startswith("t"):
        pages = math.ceil(value / page_size) * num_layers
    else:
        nbytes = value * 2**20 * (1024 if unit.startswith("g") else 1)
        pages = int(nbytes // page_bytes)
    if pages < num_layers:
        raise InvalidArgumentError(f"KV budget {text!r} holds {pages} pages, fewer than one page per layer "
                                   f"({num_layers} layers x {page_size} positions)")
    return Budget(pages, page_size, text)


def page_hashes(token_ids, page_size: int, path_key: str, num_pages: int | None = None) -> list[bytes]:
    """Hash chain of the full pages of ``token_ids`` (vLLM's prefix-caching key): entry ``i`` identifies
    tokens ``0 .. (i+1) * page_size - 1`` and the computation path ``path_key``. ``num_pages`` limits the
    chain (default: every full page)."""
    ids = [int(t) for t in token_ids]
    n = len(ids) // page_size if num_pages is None else min(num_pages, len(ids) // page_size)
    out, prev = [], path_key.encode()
    for i in range(n):
        block = ids[i * page_size:(i + 1) * page_size]
        prev = hashlib.blake2b(prev + b"|" + ",".join(map(str, block)).encode(), digest_size=16).digest()
        out.append(prev)
    return out


class KVPool:
    """The arena and its page bookkeeping.

    Args:
        num_layers, num_kv_heads, head_dim: attention layout of the model (every layer the same).
        num_pages: pages in the arena (each ``page_size`` positions of one layer).
        page_size: positions per page (default 16).
        dtype: storage dtype (the model's).
        budget_text: how the budget was written (for error messages).
        prealloc: ``full`` (the arena holds ``num_pages`` from the start) or ``staged`` (it starts at
            ``first_pages`` and doubles up to ``num_pages`` as pages are needed; see the module docstring).

    Attributes:
        k, v: ``[n_kv, capacity + 1, page_size, head_dim]`` arenas (page 0: the null page). Head-major, so
            gathering a row's pages is one ``index_select`` whose result is already a ``[n_kv, S, hd]`` view.
        capacity: pages in the arena now (``num_pages``, the budget, at most).
        ref: reference count of each page.
        reserved: pages promised to admitted requests (the scheduler's admission control).
        stats: counters (``prefix_hit_pages``, ``prefix_query_pages``, ``evicted_pages``, ``cow_copies``,
            ``compactions``, ``moved_pages``, ``cached_pages_reused``, ``skipped_pages``: pages returned because
            every position in them skipped their layer, :meth:`PagedCache.release_skipped`; ``arena_growths``).

    Raises:
        InvalidArgumentError: a non-positive size, an unknown ``prealloc``, bad ``groups`` (:func:`parse_kv_groups`),
            blocks per group with a pool that is not fully pre-allocated.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_pages: int,
                 page_size: int = DEFAULT_PAGE_SIZE, dtype: torch.dtype = torch.float32, budget_text: str = "",
                 prealloc: str = "full", first_pages: int = STAGED_FIRST_PAGES, groups=None):
        if page_size <= 0 or num_pages <= 0 or first_pages <= 0:
            raise InvalidArgumentError(f"page size and page counts must be positive, got {page_size}, {num_pages}, "
                                       f"{first_pages}")
        if prealloc not in PREALLOC:
            raise InvalidArgumentError(f"KV pre-allocation must be one of {', '.join(PREALLOC)}, got {prealloc!r}")
        self.groups = parse_kv_groups(groups, num_layers)
        if len(self.groups) > 1:
            if prealloc != "full":
                raise InvalidArgumentError(f"KV blocks per layer group need the whole arena from the start "
                                           f"(kv_prealloc full), not {prealloc}")
            if num_pages < num_layers:
                raise InvalidArgumentError(f"{num_pages} KV pages cannot give each of {num_layers} layers a page")
            num_pages = num_pages // num_layers * num_layers
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.num_pages, self.page_size, self.dtype = num_pages, page_size, dtype
        self.prealloc = prealloc
        self.capacity = {"full": num_pages, "staged": min(num_pages, first_pages), "request": 0}[prealloc]
        shape = (num_kv_heads, self.capacity + 1, page_size, head_dim)
        self.k = torch.zeros(shape, dtype=dtype)
        self.v = torch.zeros(shape, dtype=dtype)
        self.ref = [0] * (num_pages + 1)
        # blocks: page numbers [lo, hi) per layer group (one block of the whole arena without groups; it grows with a
        # staged arena); each keeps its free pages (a heap: the lowest first, which keeps the block dense) and its
        # cached pages (registered, unreferenced, oldest first)
        per_layer = num_pages // num_layers
        self.blocks = ([(1 + per_layer * a, 1 + per_layer * b) for a, b in self.groups] if len(self.groups) > 1
                       else [(1, self.capacity + 1)])
        self._block_of_layer = [g for g, (a, b) in enumerate(self.groups) for _ in range(a, b)] \
            if len(self.groups) > 1 else [0] * num_layers
        self._free = [list(range(lo, hi)) for lo, hi in self.blocks]
        self._key_of: dict[int, tuple] = {}  # registered page -> prefix key
        self._page_of: dict[tuple, int] = {}  # prefix key -> page
        self._cached: list[OrderedDict[int, None]] = [OrderedDict() for _ in self.blocks]
        self.reserved = 0
        self.budget_text = budget_text or f"{num_pages} pages"
        self.caches: set = set()  # live PagedCaches (compaction rewrites their tables)
        self.stats = {"prefix_hit_pages": 0, "prefix_query_pages": 0, "evicted_pages": 0, "cow_copies": 0,
                      "compactions": 0, "moved_pages": 0, "cached_pages_reused": 0, "skipped_pages": 0,
                      "arena_growths": 0}

    @classmethod
    def for_engine(cls, engine, budget=None, page_size: int = DEFAULT_PAGE_SIZE, prealloc: str = "full",
                   groups=None) -> KVPool:
        """A pool for ``engine``'s model holding ``budget`` (see :func:`parse_budget`; default 512 MiB), its arena
        pre-allocated ``full`` or ``staged`` (or none: ``request``, see the module docstring), with one block of
        pages per layer group of ``groups`` (:func:`parse_kv_groups`; default one block)."""
        a = engine.adapter
        if not isinstance(page_size, int) or page_size <= 0:
            raise InvalidArgumentError(f"page size must be a positive integer, got {page_size!r}")
        elem = torch.tensor([], dtype=engine.dtype).element_size()
        page_bytes = 2 * a.num_kv_heads * page_size * a.head_dim * elem
        b = parse_budget(budget, a.num_layers, page_bytes, page_size)
        return cls(a.num_layers, a.num_kv_heads, a.head_dim, b.pages, page_size, engine.dtype, b.text, prealloc,
                   STAGED_FIRST_PAGES, groups)

    # -- accounting ------------------------------------------------------------------------------
    @property
    def page_bytes(self) -> int:
        """Bytes of one page (K and V)."""
        return 2 * self.num_kv_heads * self.page_size * self.head_dim * self.k.element_size()

    @property
    def nbytes(self) -> int:
        """Bytes of the arena now (K and V, null page included)."""
        return 2 * self.k.numel() * self.k.element_size()

    @property
    def free_pages(self) -> int:
        """Pages that can be handed out now: free ones, cached ones nobody references, and those of the budget
        the arena has not grown to yet."""
        return sum(map(len, self._free)) + self.cached_pages + (self.num_pages - self.capacity)

    @property
    def used_pages(self) -> int:
        """Pages referenced by at least one request."""
        return self.num_pages - self.free_pages

    @property
    def cached_pages(self) -> int:
        return sum(map(len, self._cached))

    def block_of(self, page: int) -> int:
        """The block (layer group) that page number ``page`` belongs to."""
        return bisect.bisect_right(self.blocks, (page, math.inf)) - 1

    def pages_for(self, positions: int) -> int:
        """Pages a request of ``positions`` positions owns at most (every layer)."""
        return math.ceil(max(positions, 1) / self.page_size) * self.num_layers

    def describe(self) -> str:
        mib = self.num_pages * self.page_bytes / 2**20
        staged = {"full": "", "staged": f", staged: {self.capacity} allocated",
                  "request": ", allocated per request"}[self.prealloc]
        if len(self.groups) > 1:
            staged += f", one block per layer group {'/'.join(f'{a}-{b - 1}' for a, b in self.groups)}"
        return f"{self.budget_text} = {self.num_pages} pages of {self.page_size} positions ({mib:.1f} MiB{staged})"

    def fragmentation(self) -> dict:
        """``internal``: the share of positions in owned pages that hold no token (part-filled last pages);
        ``external``: the share of the arena below the highest page in use that is free (holes)."""
        owned = sum(c.owned_pages() for c in self.caches)
        filled = sum(c.stored_positions() for c in self.caches)
        used, span = 0, 0  # per block: pages in use, and the block's pages up to its highest page in use
        for b, (lo, hi) in enumerate(self.blocks):
            in_use = [p for p in range(lo, hi) if self.ref[p] > 0 or p in self._cached[b]]
            used += len(in_use)
            span += in_use[-1] - lo + 1 if in_use else 0
        return {"internal": 1 - filled / (owned * self.page_size) if owned else 0.0,
                "external": 1 - used / span if span else 0.0}

    # -- pages -----------------------------------------------------------------------------------
    def allocate(self, layer: int = 0) -> int:
        """A page for ``layer`` with reference count 1, from its group's block: the lowest free one, else the least
        recently released cached one.

        Raises:
            PoolFullError: every page of the block is referenced.
            InvalidArgumentError: a pool with per-request allocation (it holds no pages).
        """
        if self.prealloc == "request":
            raise InvalidArgumentError("a pool with per-request allocation holds no pages (each request owns a "
                                       "contiguous KV cache; kv_prealloc full or staged page the KV)")
        return self._take(self._block_of_layer[layer])

    def _take(self, b: int) -> int:
        free, cached = self._free[b], self._cached[b]
        if not free and not cached and self.capacity < self.num_pages:  # staged (one block): grow only when the
            self._grow()  # arena is full of live pages (cached prefixes are reused first, so memory follows the load)
        if free:
            page = heapq.heappop(free)
        elif cached:
            page, _ = cached.popitem(last=False)
            self._unregister(page)
            self.stats["cached_pages_reused"] += 1
        else:
            if len(self.blocks) == 1:
                what = f"all {self.num_pages} pages of the budget {self.describe()} are in use"
            else:
                lo, hi = self.blocks[b]
                what = (f"all {hi - lo} pages of the block of layers {self.groups[b][0]}-{self.groups[b][1] - 1} are "
                        f"in use (budget {self.describe()})")
            raise PoolFullError(f"KV pool full: {what}; raise --kv-budget or run fewer requests at once")
        self.ref[page] = 1
        return page

    def _grow(self) -> None:
        """Staged pre-allocation's step: double the arena (up to the budget), copying the pages it holds."""
        new = min(self.num_pages, 2 * self.capacity)
        shape = (self.num_kv_heads, new + 1, self.page_size, self.head_dim)
        with torch.inference_mode(False):  # growing inside a forward: the arena must stay a normal tensor (compaction
            k, v = torch.zeros(shape, dtype=self.dtype), torch.zeros(shape, dtype=self.dtype)  # and copy-on-write
            k[:, :self.capacity + 1].copy_(self.k)  # write into it between steps); both allocated before either is
            v[:, :self.capacity + 1].copy_(self.v)  # replaced, so a failed allocation leaves the pool as it was
        self.k, self.v = k, v
        for p in range(self.capacity + 1, new + 1):
            heapq.heappush(self._free[0], p)
        self.blocks[0] = (1, new + 1)
        self.capacity = new
        self.stats["arena_growths"] += 1

    def share(self, page: int) -> None:
        """One more reference to ``page`` (a prefix hit)."""
        if self.ref[page] == 0:
            self._cached[self.block_of(page)].pop(page, None)
        self.ref[page] += 1

    def release(self, page: int) -> None:
        """Drop one reference; an unreferenced page returns to the free list, or stays cached if registered."""
        if page <= 0:
            return
        if self.ref[page] <= 0:
            raise RuntimeError(f"page {page} released more often than taken")
        self.ref[page] -= 1
        if self.ref[page] == 0:
            b = self.block_of(page)
            if page in self._key_of:
                self._cached[b][page] = None
            else:
                heapq.heappush(self._free[b], page)

    def writable(self, page: int) -> bool:
        """True when writing into ``page`` changes nobody else's K/V (not shared, not registered)."""
        return self.ref[page] == 1 and page not in self._key_of

    def copy_page(self, page: int) -> int:
        """A private copy of ``page`` (copy-on-write), in the same block; releases the caller's reference to
        ``page``."""
        new = self._take(self.block_of(page))
        self.k[:, new].copy_(self.k[:, page])
        self.v[:, new].copy_(self.v[:, page])
        self.release(page)
        self.stats["cow_copies"] += 1
        return new

    # -- prefix cache ----------------------------------------------------------------------------
    def register(self, key: tuple, page: int) -> None:
        """Make ``page`` findable under ``key`` (an already registered key keeps its page)."""
        if key in self._page_of or page in self._key_of:
            return
        self._page_of[key] = page
        self._key_of[page] = key

    def lookup(self, key: tuple) -> int | None:
        return self._page_of.get(key)

    def _unregister(self, page: int) -> None:
        key = self._key_of.pop(page, None)
        if key is not None:
            self._page_of.pop(key, None)

    # -- compaction ------------------------------------------------------------------------------
    def compact(self) -> int:
        """Move every page in use (referenced or cached) to the lowest page numbers of its block, rewriting the page
        tables of the live caches and the prefix registry; returns the number of pages moved. Run it between steps
        (no forward may hold a window on the pool)."""
        mapping, free = {}, []
        for b, (lo, hi) in enumerate(self.blocks):
            in_use = [p for p in range(lo, hi) if self.ref[p] > 0 or p in self._cached[b]]
            targets = set(range(lo, lo + len(in_use)))
            movers = [p for p in in_use if p not in targets]
            mapping.update(zip(movers, sorted(targets - set(in_use))))
            free.append(list(range(lo + len(in_use), hi)))  # sorted, so already a heap
        if not mapping:
            return 0
        src = torch.tensor(list(mapping.keys()))
        dst = torch.tensor(list(mapping.values()))
        self.k[:, dst] = self.k[:, src]
        self.v[:, dst] = self.v[:, src]
        remap = torch.arange(self.capacity + 1)
        remap[src] = dst
        for c in self.caches:
            c.table.copy_(remap[c.table])
        for old, new in mapping.items():
            self.ref[new], self.ref[old] = self.ref[old], 0
            if old in self._key_of:
                key = self._key_of.pop(old)
                self._key_of[new] = key
                self._page_of[key] = new
            cached = self._cached[self.block_of(old)]
            if old in cached:
                del cached[old]
                cached[new] = None  # (moved to the end: compaction forgets the reuse order of moved pages)
        self._free = free
        self.stats["compactions"] += 1
        self.stats["moved_pages"] += len(mapping)
        return len(mapping)

    def check(self) -> None:
        """Consistency check (tests): reference counts equal the live tables' references; every page is
        exactly one of referenced, cached or free."""
        refs = [0] * (self.num_pages + 1)
        for c in self.caches:
            for p in c.table.flatten().tolist():
                if p:
                    refs[p] += 1
        assert refs[1:] == self.ref[1:], "reference counts differ from the page tables"
        for c in self.caches:  # every page of a layer lies in the block of the layer's group
            for layer in range(self.num_layers):
                lo, hi = self.blocks[self._block_of_layer[layer]]
                assert all(lo <= p < hi for p in c.table[layer].tolist() if p), f"a page of layer {layer} left its block"
        assert self.blocks[0][0] == 1 and self.blocks[-1][1] <= self.capacity + 1
        free = {p for b, f in enumerate(self._free) for p in f if self.block_of(p) == b}
        cached = {p for b, c in enumerate(self._cached) for p in c if self.block_of(p) == b}
        assert len(free) == sum(map(len, self._free)) and len(cached) == self.cached_pages, "a page in another block's list"
        for p in range(1, self.capacity + 1):
            states = (self.ref[p] > 0) + (p in free) + (p in cached)
            assert states == 1, f"page {p} is referenced/free/cached {states} times"
        assert all(self.ref[p] == 0 for p in range(self.capacity + 1, self.num_pages + 1))
        assert self.k.shape[1] == self.capacity + 1 <= self.num_pages + 1, "the arena exceeds the budget"


class PagedCache(CachePositions):
    """One request's view of the pool: a page table per layer; the :class:`~laserlm.runtime.kv_cache.KVCache`
    interface (``window``, ``commit``, ``crop``, ``reset``, ``write``, ``length``, ``max_len``), so every decoding
    mode runs on it unchanged.

    Args:
        pool: the :class:`KVPool`.
        max_len: positions this request may hold (prompt + tokens to generate).
        eviction: an eviction policy (:mod:`laserlm.runtime.eviction`) or ``None`` (keep everything).

    Attributes:
        table: ``[num_layers, ceil(max_len / page_size)]`` int64 physical page of each logical page (0 = none).
        length: committed positions.
        evicted: pages this cache has evicted.
        skipped: pages this cache returned because no position in them holds K/V at their layer (the ``none``
            bridge, :meth:`release_skipped`).
    """

    batch_size = 1

    def __init__(self, pool: KVPool, max_len: int, eviction=None):
        self.pool, self.max_len, self.eviction = pool, int(max_len), eviction
        self.length = 0
        self.table = torch.zeros(pool.num_layers, max(1, math.ceil(self.max_len / pool.page_size)), dtype=torch.long)
        self.num_logical = 0  # logical pages allocated so far (all layers)
        self.evicted = 0
        self.skipped = 0
        self.shared_positions = 0  # prefix positions taken from the cache
        self.freed = False
        pool.caches.add(self)

    # -- pages -----------------------------------------------------------------------------------
    def _grow(self, end: int) -> None:
        need = math.ceil(end / self.pool.page_size)
        for i in range(self.num_logical, need):
            for layer in range(self.pool.num_layers):
                self.table[layer, i] = self.pool.allocate(layer)
        self.num_logical = max(self.num_logical, need)

    def _make_writable(self, start: int, end: int) -> None:
        ps = self.pool.page_size
        for i in range(start // ps, min(math.ceil(end / ps), self.num_logical)):
            for layer in range(self.pool.num_layers):
                p = int(self.table[layer, i])
                if not p:
                    raise InvalidArgumentError(f"positions {start}..{end - 1} fall in a page evicted at layer {layer}: "
                                               "an evicted position cannot be written again")
                if not self.pool.writable(p):
                    self.table[layer, i] = self.pool.copy_page(p)

    def owned_pages(self) -> int:
        return int((self.table != 0).sum())

    def stored_positions(self) -> int:
        """Positions held in pages (every layer counted), i.e. the filled part of :meth:`owned_pages`."""
        ps = self.pool.page_size
        full = (self.table[:, :self.length // ps] != 0).sum()
        part = self.length % ps
        tail = (self.table[:, self.length // ps] != 0).sum() * part if part and self.length // ps < self.table.shape[1] else 0
        return int(full * ps + tail)

    def free(self) -> None:
        """Return every page to the pool (idempotent)."""
        if self.freed:
            return
        for p in self.table.flatten().tolist():
            if p:
                self.pool.release(p)
        self.table.zero_()
        self.num_logical = 0
        self.length = 0
        self.freed = True
        self.pool.caches.discard(self)

    def drop_page(self, layer: int, logical: int) -> None:
        """Evict logical page ``logical`` of ``layer`` (its positions are no longer attended at that layer)."""
        p = int(self.table[layer, logical])
        if p:
            self.pool.release(p)
            self.table[layer, logical] = 0
            self.evicted += 1
            self.pool.stats["evicted_pages"] += 1

    def release_skipped(self, valid: dict, position: int) -> int:
        """Return the pages that the token at ``position`` closed and that hold no K/V (the ``none`` bridge).

        Args:
            valid: ``layer -> [max_len]`` bool, False where a position has no K/V at that layer (the bridge's
                masks, :class:`~laserlm.depth.bridge.NoneBridge`).
            position: the token just run; only when it is the last slot of its page is that page complete.

        Returns the number of pages released (also counted in ``skipped`` and the pool's ``skipped_pages``).
        """
        ps = self.pool.page_size
        if (position + 1) % ps:
            return 0
        i = position // ps
        n = 0
        for layer, mask in valid.items():
            p = int(self.table[layer, i])
            if p and not bool(mask[i * ps:(i + 1) * ps].any()):
                self.pool.release(p)
                self.table[layer, i] = 0
                n += 1
        self.skipped += n
        self.pool.stats["skipped_pages"] += n
        return n

    def kept_pages(self, layer: int) -> list[int]:
        """Logical pages of ``layer`` that still hold K/V."""
        return [i for i in range(self.num_logical) if int(self.table[layer, i])]

    # -- prefix reuse ----------------------------------------------------------------------------
    def attach_prefix(self, prompt_ids, path_key: str) -> int:
        """Take the cached pages of the longest registered prefix of ``prompt_ids`` (full pages only, and never
        the last prompt token, whose logits the prefill must compute); returns the positions now filled."""
        ps, pool = self.pool.page_size, self.pool
        usable = (len(prompt_ids) - 1) // ps
        hashes = page_hashes(prompt_ids, ps, path_key, usable)
        pool.stats["prefix_query_pages"] += len(hashes) * pool.num_layers
        hit = 0
        for i, h in enumerate(hashes):
            pages = [pool.lookup((h, layer)) for layer in range(pool.num_layers)]
            if any(p is None for p in pages):
                break
            for layer, p in enumerate(pages):
                pool.share(p)
                self.table[layer, i] = p
            hit = i + 1
        self.num_logical = max(self.num_logical, hit)
        self.length = self.shared_positions = hit * ps
        pool.stats["prefix_hit_pages"] += hit * pool.num_layers
        return self.length

    def register_prefix(self, prompt_ids, path_key: str) -> None:
        """Register this cache's full prompt pages (computed at full depth) for later requests."""
        ps, pool = self.pool.page_size, self.pool
        n = min(len(prompt_ids), self.length) // ps
        for i, h in enumerate(page_hashes(prompt_ids, ps, path_key, n)):
            for layer in range(pool.num_layers):
                p = int(self.table[layer, i])
                if p:
                    pool.register((h, layer), p)

    # -- the KVCache interface ---------------------------------------------------------------------
    def prepare(self, start: int | None, num_tokens: int) -> int:
        """Check a write of ``[start, start + num_tokens)`` (``start`` None: append), take the pages it needs
        and copy the shared ones it touches; returns ``start``.

        Raises:
            ContextLengthError: past ``max_len``.  InvalidArgumentError: a bad ``start``.
            PoolFullError: the pool has no page left (the scheduler's reservations prevent this).
        """
        start = self.check_write(None if start is None else int(start), num_tokens)
        end = start + num_tokens
        if self.freed:
            raise InvalidArgumentError("this request's KV pages were freed (finished or cancelled)")
        self._make_writable(start, end)
        self._grow(end)
        return start

    def window(self, start: int | None, num_tokens: int) -> PagedWindow:
        """A write window for ``[start, start + num_tokens)`` (``start`` None: append); see :meth:`prepare`."""
        start = self.prepare(start, num_tokens)
        return PagedWindow(self, [self], torch.arange(start, start + num_tokens))

    def commit(self, window: PagedWindow) -> None:
        self.length = max(self.length, int(window.ends[0]))
        if self.eviction is not None:
            self.eviction.apply(self)

    def write(self, layer_idx: int, start: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Write K/V ``[1, n_kv, T, hd]`` of layer ``layer_idx`` at ``[start, start+T)`` (bridges)."""
        pos = torch.arange(start, start + key_states.shape[2])
        ps = self.pool.page_size
        pid = self.table[layer_idx, pos // ps]
        self.pool.k[:, pid, pos % ps] = key_states[0]
        self.pool.v[:, pid, pos % ps] = value_states[0]

    @property
    def nbytes(self) -> int:
        """Bytes of the pages this request holds."""
        return self.owned_pages() * self.pool.page_bytes


class PagedBatch:
    """Several requests' caches stepped together (continuous batching): ``window(None, T)`` appends ``T``
    positions to every row at its own length."""

    def __init__(self, caches: list[PagedCache]):
        if not caches or len({id(c.pool) for c in caches}) != 1:
            raise InvalidArgumentError("a paged batch needs at least one cache, all on one pool")
        self.rows = caches
        self.pool = caches[0].pool
        self.batch_size = len(caches)

    def window(self, start, num_tokens: int) -> PagedWindow:
        if start is not None:
            raise InvalidArgumentError("a batched forward appends to every row (start must be None)")
        for c in self.rows:
            c.prepare(None, num_tokens)  # checks, copy-on-write, pages
        pos = torch.stack([torch.arange(c.length, c.length + num_tokens) for c in self.rows])
        return PagedWindow(self, self.rows, pos)

    def commit(self, window: PagedWindow) -> None:
        for c, end in zip(self.rows, window.ends.tolist()):
            c.length = max(c.length, end)
            if c.eviction is not None:
                c.eviction.apply(c)


def batch_of(caches: list):
    """The batch object a batched forward opens its window on: a :class:`PagedBatch` for paged caches, a
    :class:`~laserlm.runtime.kv_cache.RequestBatch` for requests' own contiguous caches (per-request allocation).

    Raises:
        InvalidArgumentError: no cache, caches of both kinds, or paged caches of different pools.
    """
    if caches and all(isinstance(c, KVCache) for c in caches):
        return RequestBatch(caches)
    if any(isinstance(c, KVCache) for c in caches):
        raise InvalidArgumentError("a batch mixes paged caches and per-request caches")
    return PagedBatch(caches)


class PagedWindow:
    """The positions one forward writes in one or more :class:`PagedCache` rows (transformers' ``Cache``
    protocol, like :class:`~laserlm.runtime.kv_cache.CacheWindow`).

    Attributes:
        cache: the :class:`PagedCache` or :class:`PagedBatch` written to.
        positions: ``[T]`` (one row) or ``[B, T]`` absolute positions of the new tokens.
        ends: ``[B]`` end of each row's window.
    """

    def __init__(self, cache, rows: list[PagedCache], positions: torch.Tensor):
        self.cache, self.rows, self.pool = cache, rows, rows[0].pool
        self.positions = positions
        pos2 = positions if positions.dim() == 2 else positions.unsqueeze(0)
        self._pos = pos2
        self.ends = pos2[:, -1] + 1
        self.start = int(pos2[0, 0]) if positions.dim() == 1 else None
        self.end = int(self.ends.max())
        ps = self.pool.page_size
        self._slot_page = pos2 // ps  # [B, T] logical page of each new position
        self._slot_off = pos2 % ps
        n_log = math.ceil(self.end / ps)
        if len(rows) == 1:
            self._tables = rows[0].table[None, :, :n_log]  # [1, L, P]
        else:  # rows of different sizes: pad with the null page
            self._tables = torch.zeros(len(rows), rows[0].table.shape[0], n_log, dtype=torch.long)  # [B, L, P]
            for r, c in enumerate(rows):
                w = min(n_log, c.table.shape[1])
                self._tables[r, :, :w] = c.table[:, :w]
        # skipped pages (the none bridge) are no holes here: their layers mask every position of them
        # (AttentionContext.key_valid), so reading the null page there is harmless, and the layers below the exit
        # keep the compiled kernel
        self._holes = any(c.evicted for c in rows)
        self._batched = positions.dim() == 2
        self._kpos_all = None

    # -- read-only views for the compiled kernels (runtime/packed_layers.py), which read and write the pages directly
    @property
    def evicted(self) -> bool:
        """Some row has evicted pages (its K/V are then not simply its pages in order)."""
        return self._holes

    @property
    def batched(self) -> bool:
        """The window holds the rows of a :class:`PagedBatch` (positions ``[B, T]``)."""
        return self._batched

    @property
    def page_tables(self) -> torch.Tensor:
        """``[B, L, P]`` int64: each row's page of each layer, in logical order (0, the null page, past a row's end)."""
        return self._tables

    @property
    def row_positions(self) -> torch.Tensor:
        """``[B, T]`` absolute positions of each row's new tokens."""
        return self._pos

    @property
    def new_slots(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``([B, T] logical page, [B, T] offset in that page)`` of each new position."""
        return self._slot_page, self._slot_off

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Write ``key_states``/``value_states`` ``[B, n_kv, T, hd]`` of layer ``layer_idx`` into their pages;
        return the layer's gathered K and V ``[B, n_kv, S, hd]`` (see the module docstring)."""
        pool, ps = self.pool, self.pool.page_size
        tab = self._tables[:, layer_idx]  # [B, P]
        pid = tab.gather(1, self._slot_page)  # [B, T]
        pool.k[:, pid, self._slot_off] = key_states.transpose(0, 1)  # [n_kv, B, T, hd]
        pool.v[:, pid, self._slot_off] = value_states.transpose(0, 1)
        b, p = tab.shape
        if self._holes:  # gather only the pages the layer kept; record every key's position
            kept = [[i for i in range(p) if int(tab[r, i])] for r in range(b)]
            width = max(len(k) for k in kept)
            idx = torch.zeros(b, width, dtype=torch.long)
            lp = torch.full((b, width), -1, dtype=torch.long)
            for r, k in enumerate(kept):
                idx[r, :len(k)] = tab[r, k]
                lp[r, :len(k)] = torch.tensor(k, dtype=torch.long)
            kpos = (lp[:, :, None] * ps + torch.arange(ps)).reshape(b, width * ps)
            kpos = torch.where(lp.repeat_interleave(ps, dim=1) < 0, -1, kpos)
            ctx = attn.current_context()
            if ctx is not None:
                ctx.key_positions[layer_idx] = kpos
            tab, p = idx, width
        flat = tab.reshape(-1)
        shape = (pool.num_kv_heads, b, p * ps, pool.head_dim)
        k = torch.index_select(pool.k, 1, flat).view(shape).transpose(0, 1)  # [B, n_kv, S, hd]
        v = torch.index_select(pool.v, 1, flat).view(shape).transpose(0, 1)
        if not self._holes:
            if self._batched:
                ctx = attn.current_context()
                if ctx is not None:
                    if self._kpos_all is None:
                        self._kpos_all = torch.arange(p * ps).expand(b, -1)
                    ctx.key_positions[layer_idx] = self._kpos_all
            else:  # one row, nothing evicted: exactly the contiguous cache's [:, :, :end]
                k, v = k[:, :, :self.end], v[:, :, :self.end]
        return k, v

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return int(self._pos[0, 0])
