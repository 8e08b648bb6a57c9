"""Check and time the Gluon SM90 packed decode (remnant.kernels.decode.sm90) and its
warp-specialized lab variant (packed_sm90_ws, beside this file) against the float64 reference, Remnant's Triton folded decode and
FlashMLA's V4 decode, on one H200 (the lab script of benchmarks/kernels/NOTES.md's
nineteenth and twentieth rounds; its table and JSON go to $OUT). Its --profile rows time
the lab kernel with parts left out (decode's profile_skip; --profile-old: packed_sm90 too),
which remnant-kernels does not; the curated figures come from remnant-kernels.

    python -m runners.device.packed_sm90_h200 [--quick] [--out DIR] [--profile 512]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from remnant.kernels.bench.cases import HEADS
from remnant.kernels.bench.harness import time_graph
from remnant.kernels.bench.inputs import DecodeInputs
from remnant.kernels.decode import decode as triton_decode
from remnant.kernels.decode import sm90
from remnant.kernels.decode.reference import decode_packed_reference
from runners.device import packed_sm90_ws as ws

L2_BYTES = 60 * 2**20


def call_bytes(batch: int, topk: int, window: int, native: bool) -> int:
    return batch * (topk * (584 if native else 328) + window * 584)


def make_inputs(inputs: DecodeInputs, batch: int, topk: int, window: int, pad: int = 0):
    q = torch.randn(batch, HEADS, 512, device="cuda", dtype=torch.bfloat16)
    c4_locs = torch.randint(0, inputs.c4_records, (batch, topk), device="cuda", dtype=torch.int32)
    if pad:
        c4_locs[0, -pad:] = -1
    base = torch.randint(0, inputs.window_layout.capacity(inputs.window) - max(window, 1), (batch, 1), device="cuda")
    win_locs = (base + torch.arange(window, device="cuda")).to(torch.int32)
    return q, c4_locs, win_locs


def plan_splits(batch: int, splits: int | None) -> int:
    return splits or sm90.splits_per_token(batch, torch.cuda.get_device_properties(0).multi_processor_count)


def check(inputs, keep, batch, topk, window, splits, pad, sink_scale=1.0, module=sm90):
    splits = plan_splits(batch, splits)
    layout, pool, _ = inputs.pool(256)
    q, c4_locs, win_locs = make_inputs(inputs, batch, topk, window, pad)
    if window and pad:
        win_locs[-1, :3] = -1
    sink = torch.randn(HEADS, device="cuda") * sink_scale
    got = torch.full_like(q, float("nan"))
    module.decode(q[:, :, keep.order], pool, layout, c4_locs, inputs.window, inputs.window_layout, win_locs, sink,
                  keep, out=got, splits=splits)
    out = torch.empty_like(q)
    out[:, :, keep.order] = got
    tri = torch.empty_like(q)
    triton_decode(q[:, :, keep.order], pool, layout, c4_locs, inputs.window, inputs.window_layout, win_locs, sink,
                  keep, out=tri, columns="kept_first", window_columns="kept_first")
    tri_nat = torch.empty_like(q)
    tri_nat[:, :, keep.order] = tri
    ref = decode_packed_reference(q, pool, layout, c4_locs, keep.kept[: keep.n_kept].long().cpu(), inputs.window, inputs.window_layout, win_locs, sink,
                                  window_columns="kept_first")
    nan = bool(got.isnan().any())
    err = float(((out.double() - ref).flatten(1).norm(dim=1) / ref.flatten(1).norm(dim=1)).max())
    err_triton = float(((tri_nat.double() - ref).flatten(1).norm(dim=1) / ref.flatten(1).norm(dim=1)).max())
    return dict(kernel=module.__name__.rsplit(".", 1)[1], batch=batch, topk=topk, window=window, splits=splits,
                pad=pad, nan=nan, rel_err=err, triton_rel_err=err_triton,
                ok=(not nan) and err <= max(2 * err_triton, 1e-2))


def timed(calls, reps: int = 15) -> float:
    """Microseconds of one call, as remnant-kernels times it (a CUDA graph of the rotation)."""
    return time_graph(calls, reps) * 1e6


def time_case(inputs, keep, batch, topk, window, with_flashmla, splits=None, skip=None, module=ws, old=True, **kw):
    splits = plan_splits(batch, splits)
    from remnant.kernels.decode import flashmla

    layout, pool, _ = inputs.pool(256)
    nlayout, npool, _ = inputs.pool(512)
    rotations = max(2, -(-3 * L2_BYTES // call_bytes(batch, topk, window, False)))
    rotations = min(rotations, 64)
    sink = torch.randn(HEADS, device="cuda")
    sets = [make_inputs(inputs, batch, topk, window) for _ in range(rotations)]
    outs = [torch.empty(batch, HEADS, 512, device="cuda", dtype=torch.bfloat16) for _ in range(rotations)]
    row = dict(batch=batch, topk=topk, window=window)
    if skip is not None:  # the kernel with parts left out, alone: where its time goes
        for bits in skip:
            row[f"skip{bits}_us"] = timed([lambda s=s, o=o: module.decode(
                s[0], pool, layout, s[1], inputs.window, inputs.window_layout, s[2], sink, keep, out=o,
                splits=splits, profile_skip=bits, **kw) for s, o in zip(sets, outs)])
        return row
    row["ws_us"] = timed([lambda s=s, o=o: ws.decode(s[0], pool, layout, s[1], inputs.window, inputs.window_layout,
                                                     s[2], sink, keep, out=o, splits=splits, **kw)
                          for s, o in zip(sets, outs)])
    if not old:
        row["splits"] = splits
        return row
    row["gluon_us"] = timed([lambda s=s, o=o: sm90.decode(s[0], pool, layout, s[1], inputs.window, inputs.window_layout,
                                                          s[2], sink, keep, out=o, splits=splits)
                             for s, o in zip(sets, outs)])
    row["triton_folded_us"] = timed([lambda s=s, o=o: triton_decode(
        s[0], pool, layout, s[1], inputs.window, inputs.window_layout, s[2], sink, keep, out=o, columns="kept_first",
        window_columns="kept_first") for s, o in zip(sets, outs)])
    if with_flashmla:
        row["flashmla_us"] = timed([lambda s=s: flashmla.decode(s[0], npool, nlayout, s[1], inputs.window,
                                                                inputs.window_layout, s[2], sink) for s in sets])
        row["gluon_over_flashmla"] = row["gluon_us"] / row["flashmla_us"]
        row["ws_over_flashmla"] = row["ws_us"] / row["flashmla_us"]
        row["triton_over_flashmla"] = row["triton_folded_us"] / row["flashmla_us"]
    row["splits"] = splits
    row["gluon_gbps"] = call_bytes(batch, topk, window, False) / row["gluon_us"] / 1e3
    return row


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--batches", default="1,16,32,64,128,256,512")
    parser.add_argument("--splits-sweep", default="")
    parser.add_argument("--profile", default="", help="batches to time with parts of the kernel left out")
    parser.add_argument("--tune", default="", help="ws settings to time: 'batch:regs:slots;...'")
    parser.add_argument("--skip-checks", action="store_true")
    parser.add_argument("--profile-old", action="store_true")
    parser.add_argument("--check-ws-only", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    inputs = DecodeInputs(gen)
    layout, pool, keep = inputs.pool(256)
    inputs.pool(512)
    reason = sm90.unavailable_reason(torch.device("cuda"), keep.n_kept, HEADS)
    print("unavailable:", reason, flush=True)
    try:
        from remnant.kernels.decode import flashmla
        with_flashmla = flashmla.unavailable_reason(torch.device("cuda"), HEADS) is None
    except Exception as exc:  # noqa: BLE001 - a lab script reports and goes on
        print("flashmla:", exc)
        with_flashmla = False
    report = {"device": torch.cuda.get_device_name(), "checks": [], "times": []}
    t0 = time.time()
    cases = [(1, 512, 128, None, 5), (3, 512, 128, 1, 0), (3, 512, 128, 2, 7), (4, 512, 0, None, 3),
             (64, 512, 128, None, 0), (130, 512, 128, None, 11), (2, 100, 128, 5, 0), (2, 512, 100, 3, 0),
             (5, 64, 0, 1, 0)]
    for module in (() if args.skip_checks else (ws,) if args.check_ws_only else (ws, sm90)):
        for batch, topk, window, splits, pad in cases:
            try:
                r = check(inputs, keep, batch, topk, window, splits, pad, module=module)
            except Exception as exc:  # noqa: BLE001
                r = dict(kernel=module.__name__, batch=batch, topk=topk, window=window, splits=splits,
                         error=repr(exc)[:400], ok=False)
            report["checks"].append(r)
            print("check", r, flush=True)
    print(f"checks took {time.time() - t0:.0f} s", flush=True)
    compiled = list(sm90._packed_sm90_kernel.device_caches.values()) + list(
        ws._packed_sm90_ws_kernel.device_caches.values())
    for cache in compiled:
        for kernel in cache[0].values():
            print("gluon kernel regs", kernel.n_regs, "spills", kernel.n_spills, "shared", kernel.metadata.shared)
    if not all(r["ok"] for r in report["checks"]):
        print("CHECKS FAILED")
    batches = [int(b) for b in args.batches.split(",") if b]
    for window in (128, 0):
        for batch in batches:
            row = time_case(inputs, keep, batch, 512, window, with_flashmla)
            report["times"].append(row)
            print("time", {k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
        if args.quick:
            break
    for spec in filter(None, args.splits_sweep.split(";")):
        batch, options = spec.split(":")
        for splits in options.split(","):
            row = time_case(inputs, keep, int(batch), 512, 128, False, int(splits), old=False)
            report.setdefault("splits", []).append(row)
            print("splits", row, flush=True)
    for spec in filter(None, args.tune.split(";")):
        batch, regs, slots = (int(v) for v in spec.split(":"))
        for window in (128, 0):
            row = time_case(inputs, keep, batch, 512, window, False, old=False, producer_regs=regs, slots=slots)
            row.update(regs=regs, slots=slots)
            report.setdefault("tune", []).append(row)
            print("tune", row, flush=True)
    for batch in filter(None, args.profile.split(",")):
        for window in (128, 0):
            row = time_case(inputs, keep, int(batch), 512, window, False, skip=(0, 1, 2, 4, 3, 5, 6, 7))
            report.setdefault("profile", []).append(row)
            print("profile ws", {k: round(v, 2) for k, v in row.items()}, flush=True)
            if args.profile_old:
                row = time_case(inputs, keep, int(batch), 512, window, False, skip=(0, 1, 2, 4, 7), module=sm90)
                row["kernel"] = "packed_sm90"
                report.setdefault("profile", []).append(row)
                print("profile old", row, flush=True)
    with open(os.path.join(args.out, "packed_sm90.json"), "w") as f:
        json.dump(report, f, indent=1)
    print("| W | batch | FlashMLA us | WS us | x FlashMLA | old SM90 us | x FlashMLA | Triton folded us | x FlashMLA |")
    for r in report["times"]:
        nan = float("nan")
        print(f"| {r['window']} | {r['batch']} | {r.get('flashmla_us', nan):.1f} | {r['ws_us']:.1f} | "
              f"{r.get('ws_over_flashmla', nan):.2f} | {r['gluon_us']:.1f} | {r.get('gluon_over_flashmla', nan):.2f} | "
              f"{r['triton_folded_us']:.1f} | {r.get('triton_over_flashmla', nan):.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
