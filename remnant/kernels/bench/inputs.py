"""The inputs remnant-kernels times its decodes on: pools of random records larger than
L2 shared by every case, and each case's calls over them."""

from __future__ import annotations

import torch

from remnant.kernels.bench.cases import (HEADS, STAGE_PER_PAGE, DecodeCase, FlashMLACase, decode_bytes_flops,
                                         flashmla_bytes_flops)
from remnant.kernels.bench.harness import rotations


def random_keep(retention: int, gen: torch.Generator) -> torch.Tensor | None:
    if retention == 512:
        return None
    return torch.randperm(448, generator=gen)[: retention - 64].sort().values


class DecodeInputs:
    """Pools shared by all decode cases (native and packed C4, the window pools), random locs.

    Random codes and scales are valid native window records of either order (natural, or
    kept-first: remnant.kv.paged.quantize_kept_first), so every case with native window
    records reads the one window pool, and the reference reads it in the case's form
    (window_columns). A packed window (window_columns="packed") is records of the C4
    pool's R in a pool of its own (window_pool), as many as the native window's.

    device: where the pools are ("cuda"; tests run the checks in Triton's interpreter on
    the CPU at small pools)."""

    def __init__(self, gen: torch.Generator, c4_records: int = 4 * 2**20, window_records: int = 2**20,
                 device: str | torch.device = "cuda"):
        from remnant.kv.layout import PageLayout

        self.gen = gen
        self.device = torch.device(device)
        self.window_layout = PageLayout.sglang(64)
        self.window = self._random_records(self.window_layout, window_records)
        self.window_records = self.window_layout.capacity(self.window)
        self.c4_records = c4_records
        self.pools: dict[int, tuple] = {}
        self.packed_windows: dict[int, tuple] = {}

    def _random_records(self, layout, records: int) -> torch.Tensor:
        # Random codes with realistic scales: byte 120..134 exponents, codes any finite FP8.
        per_page, data_bytes = layout.per_page, layout.data_bytes
        pool = torch.randint(0, 255, (records // per_page, layout.page_stride), dtype=torch.uint8, device=self.device)
        data = per_page * data_bytes
        tail = pool[:, data : data + per_page * 8].unflatten(1, (per_page, 8))
        tail[:, :, :7] = torch.randint(120, 135, tail[:, :, :7].shape, dtype=torch.uint8, device=self.device)
        tail[:, :, 7] = 0
        body = pool[:, :data].unflatten(1, (per_page, data_bytes))
        n_codes = data_bytes - 128
        body[:, :, :n_codes] &= 0xBF  # FP8 e4m3 with the top exponent bit clear: no NaN, |x| < 2
        rope = body[:, :, n_codes:].view(torch.bfloat16)
        rope.copy_(torch.randn(rope.shape, device=self.device).to(torch.bfloat16))
        return pool

    def pool(self, retention: int):
        from remnant.kv.layout import KeptColumns, PageLayout

        if retention not in self.pools:
            layout = PageLayout.sglang(64, retention)
            # Native pools get the all-columns table too, built here: nothing may be copied
            # from the host while a CUDA graph is being captured.
            keep = KeptColumns.of(random_keep(retention, self.gen), self.device)
            self.pools[retention] = (layout, self._random_records(layout, self.c4_records), keep)
        return self.pools[retention]

    def window_pool(self, case: DecodeCase) -> tuple:
        """(pages, layout) of the window records `case` reads: the shared native window, or
        for a packed window a pool of packed records of the case's R, read with its C4
        pool's keep list (random codes and scales are valid packed records of any keep
        list), in pages of 64 as the C4 records'."""
        from remnant.kv.layout import PageLayout

        if case.window_columns != "packed":
            return self.window, self.window_layout
        if case.retention not in self.packed_windows:
            layout = PageLayout.sglang(64, case.retention)
            self.packed_windows[case.retention] = (self._random_records(layout, self.window_records), layout)
        return self.packed_windows[case.retention]

    def call_sets(self, case: DecodeCase, l2_bytes: int, plan, compiled: list | None = None) -> list:
        """Timed calls of `case`, each on inputs of its own, running `plan` (case.plan)."""
        from remnant.kernels.decode import decode

        layout, pool, keep = self.pool(512 if case.variant == "native" else case.retention)
        nbytes, _ = decode_bytes_flops(case)
        window, window_layout = self.window_pool(case)
        calls = []
        sink = torch.randn(HEADS, device=self.device)
        for _ in range(rotations(nbytes, l2_bytes)):
            q, c4_locs, win_locs = self._random_call(case.batch, case.topk, case.window)
            out = torch.empty_like(q)
            calls.append(lambda q=q, c=c4_locs, w=win_locs, out=out: decode(
                q, pool, layout, c, window, window_layout, w, sink, keep, columns=case.columns,
                window_columns=case.window_columns, out=out, config=plan, compiled=compiled))
        return calls


    def flashmla_call(self, case: FlashMLACase, q, c4_locs, win_locs, sink, out=None):
        """One call of `case` on these inputs (a closure, for graphs and checks). Timed
        calls give no `out`: FlashMLA returns its own output, as SGLang takes it (a copy
        into `out` would add a pass over the output to FlashMLA's time)."""
        from remnant.kernels.decode import flashmla
        from remnant.kv.layout import PageLayout

        window, window_layout = self.window, self.window_layout
        if case.kernel == "flashmla":
            layout, pool, _ = self.pool(512)
            return lambda: flashmla.decode(q, pool, layout, c4_locs, window, window_layout, win_locs, sink, out=out)
        from remnant.sglang.buffers import stage_selected

        layout, pool, keep = self.pool(case.retention)
        staged_layout = PageLayout.sglang(STAGE_PER_PAGE)
        records = q.shape[0] * c4_locs.shape[1]
        scratch = torch.empty(max(1, -(-records // STAGE_PER_PAGE)), staged_layout.page_stride, dtype=torch.uint8,
                              device=q.device)

        def call():
            staged = stage_selected(pool, layout, keep, c4_locs, scratch, STAGE_PER_PAGE)
            return flashmla.decode(q, scratch, staged_layout, staged, window, window_layout, win_locs, sink, out=out)

        return call

    def flashmla_call_sets(self, case: FlashMLACase, l2_bytes: int) -> list:
        nbytes, _ = flashmla_bytes_flops(case)
        sink = torch.randn(HEADS, device=self.device)
        calls = []
        for _ in range(rotations(nbytes, l2_bytes)):
            q, c4_locs, win_locs = self._random_call(case.batch, case.topk, case.window)
            calls.append(self.flashmla_call(case, q, c4_locs, win_locs, sink))
        return calls

    def _random_call(self, batch: int, topk: int, window: int):
        """q bf16 [batch, 64, 512], C4 locations int32 [batch, topk] over the C4 pools, and
        `window` consecutive window locations int32 per token (over any window pool: each
        holds window_records)."""
        q = torch.randn(batch, HEADS, 512, device=self.device, dtype=torch.bfloat16)
        c4_locs = torch.randint(0, self.c4_records, (batch, topk), device=self.device, dtype=torch.int32)
        base = torch.randint(0, self.window_records - window, (batch, 1), device=self.device)
        win_locs = (base + torch.arange(window, device=self.device)).to(torch.int32)
        return q, c4_locs, win_locs


def poison_next_allocation(like: torch.Tensor) -> None:
    """Fill a freed block of `like`'s size with NaN: PyTorch's caching allocator hands it to
    the next allocation of that size (the output a kernel allocates itself), so an element
    the kernel does not write reads NaN."""
    torch.full_like(like, float("nan"))
