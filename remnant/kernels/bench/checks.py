"""remnant-kernels' checks before it times: store and reconstruct byte for byte against
their references, each decode and FlashMLA row's call against the float64 reference."""

from __future__ import annotations

import torch

from remnant.kernels.bench.cases import HEADS, DecodeCase, FlashMLACase, store_variants
from remnant.kernels.bench.inputs import DecodeInputs, poison_next_allocation, random_keep


def check_copies(gen: torch.Generator) -> list[dict]:
    """store and reconstruct against remnant.kv.paged's references: bytes must be equal."""
    from remnant.kernels.reconstruct import PERMUTES, reconstruct
    from remnant.kernels.store import store
    from remnant.kv import paged
    from remnant.kv.layout import PageLayout

    checks = []
    n = 100_003
    for retention in (512, 128, 192, 256, 320, 384, 448, 64):
        keep = random_keep(retention, gen)
        layout = PageLayout.sglang(64, retention)
        x = (torch.randn(n, 512, device="cuda") * torch.exp(torch.randn(n, 1, device="cuda") * 2)).to(torch.bfloat16)
        locs = torch.randperm(n + 997, device="cuda")[:n]
        want = torch.full((-(-(n + 997) // 64), layout.page_stride), 0xAB, dtype=torch.uint8, device="cuda")
        paged.store_reference(x, want, layout, locs, keep)
        for permute in store_variants(retention):
            got = torch.full_like(want, 0xAB)
            store(x, got, layout, locs, keep, check_range=True, permute=permute)
            checks.append({"kernel": "store", "retention": retention, "records": n, "permute": permute,
                           "bytes_differing": int((got != want).sum())})
        if keep is not None:
            picks = torch.randint(0, n + 997, (n,), device="cuda")
            ref = paged.reconstruct_reference(want, layout, picks, keep)
            for permute in PERMUTES:
                out = reconstruct(want, layout, picks, keep, check_range=True, permute=permute)
                checks.append({"kernel": "reconstruct", "retention": retention, "records": n, "permute": permute,
                               "bytes_differing": int((out != ref).sum())})
    return checks


def check_decode(inputs: "DecodeInputs", case: DecodeCase, plan) -> float:
    """Worst relative error of the kernel against its float64 reference (remnant.kernels.decode.reference).

    Four tokens drawn from the benchmark's own pools (with -1 padding in one), each
    token's error ||out - ref|| / ||ref||; the output is poisoned with NaN first.
    """
    from remnant.kernels.decode import decode
    from remnant.kernels.decode.reference import decode_native_reference, decode_packed_reference

    layout, pool, keep = inputs.pool(512 if case.variant == "native" else case.retention)
    window, window_layout = inputs.window_pool(case)
    batch, device = 4, inputs.device
    q = torch.randn(batch, HEADS, 512, device=device, dtype=torch.bfloat16)
    c4_locs = torch.randint(0, inputs.c4_records, (batch, case.topk), device=device)
    c4_locs[0, -5:] = -1
    base = torch.randint(0, inputs.window_records - case.window, (batch, 1), device=device)
    win_locs = base + torch.arange(case.window, device=device)
    sink = torch.randn(HEADS, device=device)
    out = torch.full_like(q, float("nan"))
    # The timed case's plan (its splits, whatever this check's batch would choose).
    orders = dict(columns=case.columns, window_columns=case.window_columns, config=plan)
    if case.columns == "kept_first":  # q in and out back in kept-first order, compared in the model's
        got = torch.full_like(q, float("nan"))
        decode(q[:, :, keep.order], pool, layout, c4_locs, window, window_layout, win_locs, sink, keep,
               out=got, **orders)
        out[:, :, keep.order] = got
    else:
        decode(q, pool, layout, c4_locs, window, window_layout, win_locs, sink, keep, out=out, **orders)
    if case.variant == "native":
        ref = decode_native_reference(q, pool, layout, c4_locs, window, window_layout, win_locs, sink)
    else:
        keep_idx = keep.kept[: keep.n_kept].long().cpu()
        ref = decode_packed_reference(q, pool, layout, c4_locs, keep_idx, window, window_layout, win_locs,
                                      sink, window_columns=case.window_columns)
    if out.isnan().any():
        return float("inf")
    errors = (out.double() - ref).flatten(1).norm(dim=1) / ref.flatten(1).norm(dim=1)
    return float(errors.max())


def check_flashmla(inputs: DecodeInputs, case: FlashMLACase) -> float:
    """Worst relative error per token of a FlashMLA row's call against remnant.kernels.decode.reference's
    float64 reference (native records; triton mode: the packed records' reference, dropped
    coordinates zero), on four tokens with -1 padding in one. FlashMLA allocates its own
    output: the block it takes is filled with NaN first (poison_next_allocation)."""
    from remnant.kernels.decode.reference import decode_native_reference, decode_packed_reference

    q, c4_locs, win_locs = inputs._random_call(4, case.topk, case.window)
    if case.topk > 5:
        c4_locs[0, -5:] = -1
    sink = torch.randn(HEADS, device="cuda")
    poison_next_allocation(q)
    out = inputs.flashmla_call(case, q, c4_locs, win_locs, sink)()
    layout, pool, keep = inputs.pool(case.retention)
    window = (inputs.window, inputs.window_layout, win_locs, sink)
    if case.kernel == "flashmla":
        ref = decode_native_reference(q, pool, layout, c4_locs, *window)
    else:
        ref = decode_packed_reference(q, pool, layout, c4_locs, keep.kept[: keep.n_kept].long().cpu(), *window)
    if out.isnan().any():
        return float("inf")
    return float(((out.double() - ref).flatten(1).norm(dim=1) / ref.flatten(1).norm(dim=1)).max())
