"""Prefix cache of the embedded engine: hashed full pages with LRU eviction.

A full page (page_size tokens) is keyed by a hash chain over the token ids up to its end,
so equal keys mean equal prefixes. Its compressed records and indexer keys stay in the
page. Resuming after a cached prefix also needs the sliding window at the page's end and
no open compressor block (page_size is a multiple of 128, so none is open): the cache
keeps a window checkpoint (one SWA block) per page where one could be taken, and a match
ends at the deepest page that has one. Pages and checkpoints in use by a running request
are pinned (reference counted); the rest are evicted least-recently-used, leaves first,
when the pools run short.
"""

from __future__ import annotations

import hashlib
import itertools
from dataclasses import dataclass

import torch

from remnant.engine.pools import KVPools


@dataclass
class Entry:
    key: bytes
    page: int
    parent: bytes | None
    refs: int = 0
    children: int = 0
    window: int | None = None  # SWA block holding the window at this page's end
    last_used: int = 0


def chain_key(parent: bytes | None, page_tokens: list[int]) -> bytes:
    """Key of a page: a hash of its parent's key and its own token ids."""
    chunk = torch.tensor(page_tokens, dtype=torch.int64).numpy().tobytes()
    return hashlib.blake2b((parent or b"") + chunk, digest_size=16).digest()


def page_keys(token_ids: list[int], page_size: int, pages: int) -> list[bytes]:
    """Hash-chain keys of the first `pages` full pages of token_ids."""
    keys, prev = [], None
    for i in range(pages):
        prev = chain_key(prev, token_ids[i * page_size : (i + 1) * page_size])
        keys.append(prev)
    return keys


class PrefixCache:
    def __init__(self, pools: KVPools, enabled: bool = True):
        self.pools = pools
        self.enabled = enabled
        self.entries: dict[bytes, Entry] = {}
        self._clock = itertools.count(1)
        self.hit_tokens = 0
        self.query_tokens = 0

    # Lookup and pinning ------------------------------------------------------------------

    def resume_keys(self, token_ids: list[int]) -> list[bytes]:
        """Keys of the prompt's pages a match may cover: at least one token is left to
        compute (its logits start the answer). Compute once per request."""
        return page_keys(token_ids, self.pools.page_size, (len(token_ids) - 1) // self.pools.page_size)

    def match(self, keys: list[bytes]) -> tuple[int, list[bytes]]:
        """Longest cached prefix among a prompt's resume_keys: (tokens, keys of its pages)."""
        if not self.enabled:
            return 0, []
        size = self.pools.page_size
        best = 0
        for i, key in enumerate(keys):
            entry = self.entries.get(key)
            if entry is None:
                break
            if entry.window is not None:
                best = i + 1
        return best * size, keys[:best]

    def pin(self, keys: list[bytes]) -> list[int]:
        """Reference the pages of `keys` for a running request; returns their page ids."""
        now = next(self._clock)
        pages = []
        for key in keys:
            entry = self.entries[key]
            entry.refs += 1
            entry.last_used = now
            pages.append(entry.page)
        return pages

    def unpin(self, keys: list[bytes]) -> None:
        now = next(self._clock)
        for key in keys:
            entry = self.entries[key]
            entry.refs -= 1
            entry.last_used = now

    def window_of(self, key: bytes) -> int:
        return self.entries[key].window

    # Insertion -----------------------------------------------------------------------

    def insert(self, key: bytes, parent: bytes | None, page: int, window: int | None) -> bool:
        """Adopt a just-completed page (pinned by its request); False if already cached."""
        if not self.enabled or key in self.entries:
            return False
        self.entries[key] = Entry(key, page, parent, refs=1, window=window, last_used=next(self._clock))
        if parent is not None and parent in self.entries:
            self.entries[parent].children += 1
        return True

    # Eviction ------------------------------------------------------------------------

    def evictable_pages(self) -> int:
        return sum(1 for e in self.entries.values() if e.refs == 0)

    def evict_pages(self, count: int) -> int:
        """Free up to `count` unpinned pages, least recently used leaves first."""
        freed = 0
        while freed < count:
            leaves = [e for e in self.entries.values() if e.refs == 0 and e.children == 0]
            if not leaves:
                break
            victim = min(leaves, key=lambda e: e.last_used)
            self._drop(victim)
            freed += 1
        return freed

    def adopt_window(self, key: bytes, window: int) -> bool:
        """Give `key`'s page the checkpoint `window` if it has none; False if it has one."""
        entry = self.entries[key]
        if entry.window is not None:
            return False
        entry.window = window
        return True

    def evict_windows(self, count: int) -> int:
        """Free up to `count` SWA blocks held as window checkpoints.

        A checkpoint only serves future matches (a request copies it at admission), so
        pinned pages may lose theirs too. Checkpoints inside a chain (one cached child: a
        match can go deeper) go first; chain ends and branch points (no child, or several)
        are kept longer; least recently used first within each class.
        """
        held = sorted((e for e in self.entries.values() if e.window is not None),
                      key=lambda e: (e.children != 1, e.last_used))
        for e in held[:count]:
            self.pools.swa_blocks.release([e.window])
            e.window = None
        return min(count, len(held))

    def flush(self) -> int:
        """Drop every unpinned entry; returns how many pages were freed."""
        freed = 0
        while True:
            n = self.evict_pages(len(self.entries) or 1)
            freed += n
            if n == 0:
                return freed

    def _drop(self, entry: Entry) -> None:
        del self.entries[entry.key]
        if entry.parent is not None and entry.parent in self.entries:
            self.entries[entry.parent].children -= 1
        if entry.window is not None:
            self.pools.swa_blocks.release([entry.window])
        self.pools.pages.release([entry.page])
