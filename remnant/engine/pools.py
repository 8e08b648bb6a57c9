"""Paged KV pools of the embedded engine, laid out and sized as SGLang keeps DeepSeek-V4's.

One "full" page of `page_size` tokens (256) owns, in every CSA layer, a C4 page of
page_size / 4 records (native 584 B or packed R + 72 B, SGLang's split layout) and an
indexer page of as many keys (FP8 or MXFP4, split layout); in every HCA layer a C128 page
of page_size / 128 records (native or packed). The sliding window lives in the SWA pool:
each running request owns a block of `window` record slots in every layer (a ring; one
page of the split layout, of the layer's window record size), and the prefix cache keeps
window checkpoints there too. Compressor state (the open block's tokens) sits
in per-request state rows. Sizes come from remnant.engine.capacity, so the bytes
allocated here are the bytes accounted there, plus the padding of split pages.

Each pool has one more page, window block and state slot than it hands out (pad_page,
pad_block, pad_slot), outside every free list, as SGLang keeps a reserved slot for padded
decode batches: the batched decode step (remnant.engine.decode_step) sends there the
writes that must not land (a block not yet complete, a CUDA graph's padding rows), so its
shapes never depend on the data. They hold no token: capacity is unchanged, and
allocated_bytes counts them apart as "padding".
"""

from __future__ import annotations

import dataclasses

import torch

from remnant.engine.capacity import C4_RING, C128_RING, STATE_DTYPES, PoolGeometry, PoolSizes, pool_bytes
from remnant.kv.formats import (
    CSA_RATIO,
    HCA_RATIO,
    HEAD_DIM,
    NATIVE_RECORD_BYTES,
    SCALE_BYTES,
    index_key_format_of,
    index_key_parts,
    page_bytes,
)
from remnant.kv.layout import PageLayout

#: The compressor state's torch dtype by its byte size (remnant.engine.capacity.STATE_DTYPES).
STATE_TORCH_DTYPES = {4: torch.float32, 2: torch.bfloat16}


class FreeList:
    """Ids 0..n-1 handed out lowest first; freeing an id twice is a bug and raises."""

    def __init__(self, n: int, name: str):
        self.n, self.name = n, name
        self._free = list(range(n - 1, -1, -1))
        self._used: set[int] = set()

    @property
    def free(self) -> int:
        return len(self._free)

    def alloc(self, count: int = 1) -> list[int] | None:
        if count > len(self._free):
            return None
        ids = [self._free.pop() for _ in range(count)]
        self._used.update(ids)
        return ids

    def release(self, ids: list[int]) -> None:
        for i in ids:
            if i not in self._used:
                raise RuntimeError(f"{self.name} id {i} freed twice or never allocated")
            self._used.remove(i)
            self._free.append(i)


class SplitPages:
    """One layer's paged records in SGLang's split layout: uint8 [pages, page_bytes].

    Record j of a sequence lives in page page_table[j // per_page], slot j % per_page, i.e.
    at pool location page * per_page + slot of `layout` (remnant.kv.layout.PageLayout: data
    parts first, then the tails: 8 scale+pad bytes, or 4 scale bytes for indexer keys).
    """

    def __init__(self, pages: int, per_page: int, record_bytes: int, tail_bytes: int = SCALE_BYTES,
                 row_bytes: int | None = None, device: torch.device | str = "cpu"):
        raw = per_page * record_bytes
        row = row_bytes or record_bytes - tail_bytes
        self.layout = PageLayout(per_page, record_bytes, -(-raw // row) * row, tail_bytes)
        self.buf = torch.zeros(pages, self.layout.page_stride, dtype=torch.uint8, device=device)

    @property
    def record_bytes(self) -> int:
        return self.layout.record_bytes

    def locations(self, page_table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """Flat pool locations int64 [k] (page * per_page + slot, as the kernels take them) of
        sequence record indices `index` [k], on the buffer's device."""
        per_page = self.layout.per_page
        index = index.to(self.buf.device)
        return page_table.to(self.buf.device)[index // per_page] * per_page + index % per_page

    def write(self, page_table: torch.Tensor, index: torch.Tensor, records: torch.Tensor) -> None:
        """records uint8 [k, record_bytes] to sequence record indices `index` [k]."""
        self.layout.write(self.buf, self.locations(page_table, index), records)

    def read(self, page_table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """uint8 [k, record_bytes] of sequence record indices `index` [k]."""
        return self.layout.read(self.buf, self.locations(page_table, index))


class SwaPool:
    """Every layer's sliding-window records: per layer, blocks of `window` records, each block
    one page of SGLang's split layout (PageLayout.sglang(window, R): native 584-byte records,
    padded to a multiple of 576 bytes, as SGLang keeps its SWA pool and as FlashMLA and the
    decode kernels read it, or packed R + 72-byte ones where the layer packs its window).
    A request's ring is one block: position p sits at slot block * window + p % window
    (KVPools.swa_slots), a flat location of the layer's layout. Layers whose records differ
    in size have pages of different strides, so each layer has its own buffer."""

    def __init__(self, retentions: list[int], blocks: int, window: int, device: torch.device | str = "cpu"):
        #: Each layer's page layout and pages, uint8 [blocks, page_stride].
        self.layouts = [PageLayout.sglang(window, r) for r in retentions]
        self.bufs = [torch.zeros(blocks, layout.page_stride, dtype=torch.uint8, device=device)
                     for layout in self.layouts]

    def pages(self, li: int) -> torch.Tensor:
        """Layer li's pages, uint8 [blocks, page_stride] (contiguous)."""
        return self.bufs[li]

    def read(self, li: int, slots: torch.Tensor) -> torch.Tensor:
        """uint8 [k, record_bytes] records at `slots` [k] of layer li."""
        return self.layouts[li].read(self.bufs[li], slots)

    def write(self, li: int, slots: torch.Tensor, records: torch.Tensor) -> None:
        """records uint8 [k, record_bytes] to `slots` [k] of layer li."""
        self.layouts[li].write(self.bufs[li], slots, records)

    def block_views(self, block: int) -> list[torch.Tensor]:
        """Block `block`'s page in every layer (views)."""
        return [buf[block] for buf in self.bufs]

    def copy_block(self, dst: int, src: int) -> None:
        """Block `src`'s records (every layer) to block `dst`: a ring checkpoint or its resumption."""
        for buf in self.bufs:
            buf[dst] = buf[src]

    def __getitem__(self, li: int) -> torch.Tensor:
        """Every slot of layer li as uint8 [blocks * window, record_bytes] (a copy: for checks)."""
        slots = torch.arange(self.layouts[li].capacity(self.bufs[li]), device=self.bufs[li].device)
        return self.read(li, slots)

    def numel(self, blocks: int | None = None) -> int:
        """Bytes of every layer's pages (of the first `blocks` blocks only, if given)."""
        return sum(buf[:blocks].numel() for buf in self.bufs)


class KVPools:
    """Every pool of the engine, allocated from PoolSizes (bytes counted exactly) on `device`."""

    def __init__(self, geometry: PoolGeometry, sizes: PoolSizes, device: torch.device | str = "cpu"):
        self.geometry, self.sizes = geometry, sizes
        self.device = torch.device(device)
        g = geometry
        self.page_size = g.page_size
        self.num_pages = sizes.full_tokens // g.page_size
        self.pages = FreeList(self.num_pages, "page")
        self.pad_page = self.num_pages
        per4, per128 = g.page_size // CSA_RATIO, g.page_size // HCA_RATIO
        csa = [i for i, r in enumerate(g.compress_ratios) if r == CSA_RATIO]
        dev = self.device
        pages = self.num_pages + 1
        self.c4 = {li: SplitPages(pages, per4, rb, device=dev) for li, rb in zip(csa, g.c4_record_bytes)}
        # Index keys in either format (FP8 or MXFP4: remnant.kv.index_keys), codes then scales.
        codes, scales = index_key_parts(index_key_format_of(g.indexer_key_bytes(), g.index_head_dim), g.index_head_dim)
        self.indexer = {li: SplitPages(pages, per4, codes + scales, scales, device=dev) for li in csa}
        self.c128 = {i: SplitPages(pages, per128, g.c128_record_bytes, device=dev)
                     for i, r in enumerate(g.compress_ratios) if r == HCA_RATIO}
        # SWA: blocks of `window` slots, a page each; a running request rings through one, a
        # prefix-cache checkpoint holds one.
        self.window = g.window_size
        self.swa_blocks = FreeList(sizes.swa_tokens // g.window_size, "swa block")
        self.pad_block = self.swa_blocks.n
        self.swa = SwaPool([_retention_of_record(b) for b in g.window_record_bytes()], self.swa_blocks.n + 1,
                           g.window_size, device=dev)
        # Compressor state, rows of (content, gate) in float32 or bfloat16 (the geometry's
        # state dtype): C4_RING rows per request slot in every CSA layer (sized from the SWA
        # pool, as SGLang sizes c4_state_pool_size) and C128_RING rows per slot in every HCA
        # layer (the fixed c128_state rows); the indexer keys' open block rides in the C4
        # indexer state rows.
        self.slots = FreeList(min(self.swa_blocks.n, g.max_running_requests), "request slot")
        self.pad_slot = self.slots.n
        # The accounted rows, then the padding slot's past the last slot either may use.
        self.state_dtype = STATE_TORCH_DTYPES[g.state_dtype_bytes]
        self._state_rows = (sizes.c4_state_slots,
                            g.c128_state_fixed_bytes() // (2 * HEAD_DIM * g.state_dtype_bytes * max(g.n_c128, 1)))
        rows4 = max(sizes.c4_state_slots, (self.pad_slot + 1) * C4_RING)
        rows128 = max(self._state_rows[1], (self.pad_slot + 1) * C128_RING)
        # A C4 state row holds (content, gate) for two overlapping blocks (2 x 2 x 512, as
        # SGLang sizes it); the engine's compressor uses the first block's half.
        st = self.state_dtype
        self.c4_state = {li: torch.zeros(rows4, 2, 2 * HEAD_DIM, device=dev, dtype=st) for li in csa}
        self.c4_index_state = {li: torch.zeros(rows4, 2, 2 * g.index_head_dim, device=dev, dtype=st) for li in csa}
        self.c128_state = {i: torch.zeros(rows128, 2, HEAD_DIM, device=dev, dtype=st) for i in self.c128}

    def state_rows(self, ratio: int, slot: int, count: int) -> torch.Tensor:
        """Rows of request slot `slot`'s compressor state for the first `count` open tokens."""
        ring = C4_RING if ratio == CSA_RATIO else C128_RING
        return torch.arange(slot * ring, slot * ring + count, device=self.device)

    def swa_slots(self, block: int | torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """SWA slots of token positions in a request's ring (position p -> p mod window); block
        an int or a tensor broadcasting against positions."""
        return block * self.window + positions % self.window

    def allocated_bytes(self) -> dict[str, int]:
        """Bytes of the buffers actually allocated, per component (page padding included),
        the padding page, block and slot apart ("padding": they hold no token)."""
        rows4, rows128 = self._state_rows
        held = {
            "swa": self.swa.numel(self.pad_block),
            "c4": sum(p.buf[: self.num_pages].numel() for p in self.c4.values()),
            "c128": sum(p.buf[: self.num_pages].numel() for p in self.c128.values()),
            "c4_indexer": sum(p.buf[: self.num_pages].numel() for p in self.indexer.values()),
            "c4_state": sum(t[:rows4].nbytes for t in self.c4_state.values()),
            "c4_indexer_state": sum(t[:rows4].nbytes for t in self.c4_index_state.values()),
            "c128_state": sum(t[:rows128].nbytes for t in self.c128_state.values()),
        }
        every = (self.swa.numel() + sum(p.buf.numel() for d in (self.c4, self.c128, self.indexer) for p in d.values())
                 + sum(t.nbytes for d in (self.c4_state, self.c4_index_state, self.c128_state)
                       for t in d.values()))
        return {**held, "padding": every - sum(held.values())}

    def accounted_bytes(self) -> dict[str, int]:
        return pool_bytes(self.geometry, self.sizes)

    def usage(self) -> dict:
        return {
            "pages_total": self.num_pages,
            "pages_free": self.pages.free,
            "swa_blocks_total": self.swa_blocks.n,
            "swa_blocks_free": self.swa_blocks.free,
            "request_slots_total": self.slots.n,
            "request_slots_free": self.slots.free,
        }


__all__ = ["FreeList", "KVPools", "SplitPages", "SwaPool", "page_bytes"]


def _c128_record_bytes(model) -> int:
    """The HCA layers' C128 record size (one R for them all: the config's rule)."""
    sizes = {model.layer_format(i).record_bytes for i, r in enumerate(model.args.compress_ratios) if r == HCA_RATIO}
    if len(sizes) > 1:
        raise ValueError(f"the HCA layers' C128 records take sizes {sorted(sizes)}; the pools hold one size")
    return sizes.pop() if sizes else NATIVE_RECORD_BYTES


def _retention_of_record(record_bytes: int) -> int:
    """R of a record of `record_bytes` (R + 72 packed; 584 native is R = 512)."""
    return HEAD_DIM if record_bytes == NATIVE_RECORD_BYTES else record_bytes - (NATIVE_RECORD_BYTES - HEAD_DIM)


def geometry_of(model, page_size: int = 256, swa_ratio: float = 0.1, max_running_requests: int = 32,
                state_dtype: str = "float32") -> PoolGeometry:
    """Pool geometry of an engine model (remnant.engine.model.Model) in its current mode and
    index key format, with compressor state rows of `state_dtype` (float32 or bfloat16)."""
    a = model.args
    if state_dtype not in STATE_DTYPES:
        raise ValueError(f"compressor_state_dtype={state_dtype!r} is not allowed; allowed: {', '.join(STATE_DTYPES)}")
    return PoolGeometry(
        compress_ratios=list(a.compress_ratios),
        c4_record_bytes=[model.c4_formats[i].record_bytes for i in model.csa_layers],
        swa_record_bytes=[model.layer_format(i).ring_record_bytes for i in range(len(a.compress_ratios))],
        c128_record_bytes=_c128_record_bytes(model),
        window_size=a.window_size,
        index_head_dim=a.index_head_dim,
        page_size=page_size,
        swa_ratio=swa_ratio,
        max_running_requests=max_running_requests,
        state_dtype_bytes=STATE_DTYPES[state_dtype],
        index_key_bytes=model.index_key_format.bytes_per_key,
    )


def scratch_pools(model, tokens: int, sequences: int = 1, state_dtype: str = "float32",
                  window_blocks: int | None = None) -> KVPools:
    """Pools just big enough for `sequences` sequences of `tokens` tokens (tests, calibration),
    on the model's device, compressor state in `state_dtype`.

    window_blocks: sliding-window blocks to hold, at least (None: a window block for every
    `window` tokens of the pages, swa_ratio 1). Window blocks and their compressor state
    cost about 38.6 KB a token at V4-Flash's shapes against 4 KB for the records, so at 128
    sequences of 32k tokens swa_ratio 1 asks for 169.5 GiB where the sequences use 128
    blocks (the decode bench passes its batch, the prefill bench 1)."""
    from remnant.engine.capacity import size_pools

    geometry = geometry_of(model, swa_ratio=1.0, max_running_requests=sequences, state_dtype=state_dtype)
    page = geometry.page_size
    pages = sequences * -(-tokens // page) + sequences
    if window_blocks is not None:
        # One page more than the blocks' tokens: int(full * swa_ratio) in size_pools may round
        # a float just below a page boundary down a whole page.
        swa_tokens = (-(-window_blocks * geometry.window_size // page) + 1) * page
        geometry = dataclasses.replace(geometry, swa_ratio=min(1.0, swa_tokens / (pages * page)))
    per_token = sum(geometry.bytes_per_full_token().values())
    budget = int(pages * geometry.page_size * per_token) + geometry.c128_state_fixed_bytes() + 1
    return KVPools(geometry, size_pools(geometry, budget), model.device)


def new_sequence(pools: KVPools, tokens: int):
    """A Sequence holding pages for `tokens` tokens, an SWA block and a request slot."""
    from remnant.engine.sequence import Sequence

    pages = pools.pages.alloc(-(-tokens // pools.page_size))
    block, slot = pools.swa_blocks.alloc(), pools.slots.alloc()
    if pages is None or block is None or slot is None:
        for free_list, got in ((pools.pages, pages), (pools.swa_blocks, block), (pools.slots, slot)):
            if got is not None:
                free_list.release(got)
        raise RuntimeError(f"pools cannot hold another sequence of {tokens} tokens: {pools.usage()}")
    return Sequence(pages, block[0], slot[0])
