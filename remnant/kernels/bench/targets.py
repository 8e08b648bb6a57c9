"""remnant-kernels' targets, each with the value this run measured: kernel mode's decode
over FlashMLA's V4 decode, the copies' and decodes' fraction of the copy bandwidth (or the
bound that holds them, from their compiled kernels), and every decode over FlashMLA's time.
The record carries them, so that its table and plot read them from it."""

from __future__ import annotations

from remnant.kernels.bench.cases import KERNEL_R, TOPK, WINDOW, other_split_plan
from remnant.kernels.decode.reference import WINDOW_COLUMNS


# Kernel mode's decode against FlashMLA's (issue "Direct packed decode that beats stock
# FlashMLA"): at most this fraction of its time at batch 64 and above, where the C4
# records' bytes dominate (their byte ratio is 328 / 584 = 0.56), and no slower at any batch.
KERNEL_VS_FLASHMLA_FROM_64 = 0.65


KERNEL_VS_FLASHMLA = 1.0


# The engine's folded call over a window packed as its C4 records (retention.window_records
# = packed_csa, the combination that reaches 1.6x KV capacity) against FlashMLA's (issue 44,
# "Decode that reads every new format"): at most this fraction of its time at batch 64 and
# above, and no slower (KERNEL_VS_FLASHMLA) at any batch.
PACKED_WINDOW_VS_FLASHMLA_FROM_64 = 0.8


def against_flashmla(decode_rows: list[dict], flashmla_rows: list[dict]) -> list[dict]:
    """Every decode row (at auto_splits) and triton mode's rows over FlashMLA's row of the
    same batch, top-k and window: time / FlashMLA's time."""
    stock = {(r["batch"], r["topk"], r["window"]): r for r in flashmla_rows if r["kernel"] == "flashmla"}
    out = []
    for r in [*(d for d in decode_rows if d["auto_splits"]), *(f for f in flashmla_rows if f["kernel"] != "flashmla")]:
        flash = stock.get((r["batch"], r["topk"], r["window"]))
        if flash is None:
            continue
        if "variant" not in r:
            what = f"triton mode (reconstruct R={r['retention']} + FlashMLA)"
        elif r["variant"] == "native":
            what = "Remnant's Triton native kernel (cross-check)"
        else:
            what = (f"kernel mode, packed R={r['retention']} ({_orders_label(r['columns'], r['window_columns'])}"
                    f"{_kernel_label(r)})")
        out.append({"name": f"{what}, batch {r['batch']}, top-k {r['topk']}, window {r['window']}",
                    "batch": r["batch"], "topk": r["topk"], "window": r["window"],
                    "value": r["time_us"] / flash["time_us"]})
    return out


def targets(decode_rows: list[dict], store_rows: list[dict], reconstruct_rows: list[dict],
            flashmla_rows: list[dict], capability: str | None = None) -> list[dict]:
    """The targets, each with its measured value (ratios from this run only). Decode
    targets are kernel mode's time over FlashMLA V4's at the same batch, top-k and window
    (flashmla_rows); none without them. capability: the GPU's compute capability; on 9.0
    (whose multiprocessor limits _residency knows) the decode rows' bound is named from
    their compiled kernels."""
    out = []
    def orders(r: dict) -> tuple[str, str]:
        return r["columns"], r.get("window_columns", "natural")

    # The split sweep's rows are evidence, not targets; a native row at a target's split
    # count with the other split plan, and both rows with the other join, are named in
    # that target's note.
    fixed = {(r["variant"], orders(r), r["batch"], r["topk"], r["window"], r["splits"], r.get("split_plan"),
              r.get("join")): r for r in decode_rows if not r["auto_splits"]}
    decode_rows = [r for r in decode_rows if r["auto_splits"]]
    by = {(r["variant"], r["retention"], r["batch"], r["topk"], r["window"], orders(r), r.get("kernel", "triton")): r
          for r in decode_rows}
    stock = {(r["batch"], r["topk"], r["window"]): r for r in flashmla_rows if r["kernel"] == "flashmla"}
    forms = {(*orders(r), r.get("kernel", "triton")) for r in decode_rows if r["variant"] == "packed"}
    for columns, window_columns, kernel in sorted(forms, key=lambda f: (_order_rank(f[:2]), f[2] == "sm90")):
        for window in (WINDOW, 0):
            for batch in sorted({r["batch"] for r in decode_rows}):
                flash = stock.get((batch, TOPK, window))
                native = by.get(("native", 512, batch, TOPK, window, ("natural", "natural"), "triton"))
                packed = by.get(("packed", KERNEL_R, batch, TOPK, window, (columns, window_columns), kernel))
                if not (flash and packed):
                    continue
                ratio = packed["time_us"] / flash["time_us"]
                limit = KERNEL_VS_FLASHMLA
                if batch >= 64:
                    packed_window = window_columns == "packed"
                    limit = PACKED_WINDOW_VS_FLASHMLA_FROM_64 if packed_window else KERNEL_VS_FLASHMLA_FROM_64
                if kernel == "sm90":
                    how = ("the SM90 Gluon kernel (remnant.kernels.decode.sm90): q, out and the window in kept-first "
                           "order" if window_columns != "packed" else
                           "the SM90 Gluon kernel (remnant.kernels.decode.sm90): q and out in kept-first order")
                elif packed.get("window_apart"):
                    how = ("the window read by a program of its own in natural order, the C4 records by the "
                           "others through the kept columns, joined in natural order")
                elif columns == "natural":
                    how = "q and out permuted to and from kept-first order in the call"
                else:
                    how = "q and out in kept-first order: the permutation folded into the projections"
                if window_columns == "kept_first" and kernel != "sm90":
                    how += "; window records written in kept-first order"
                elif window_columns == "packed":
                    how += (f"; window records packed with the keep list ({KERNEL_R + 72} bytes), read by the C4 "
                            "loop")
                note = (f"FlashMLA V4 {flash['time_us']:.1f} us, packed {packed['time_us']:.1f} us ({how}); "
                        f"byte ratio against FlashMLA's call {packed['bytes'] / flash['bytes']:.3f} (C4 records "
                        f"alone: {(KERNEL_R + 72) / 584:.3f})")
                if native:
                    note += (f"; cross-check against Remnant's Triton native kernel ({native['time_us']:.1f} us, "
                             f"{native['time_us'] / flash['time_us']:.2f}x FlashMLA): packed/native "
                             f"{packed['time_us'] / native['time_us']:.3f}")
                    note += _triton_native_notes(by, fixed, batch, window, (columns, window_columns), native, packed)
                label = _orders_label(columns, window_columns) + (", SM90 Gluon kernel" if kernel == "sm90" else "")
                # The plot reads these limits back from the record by this name and target.
                out.append({"name": f"decode packed ({label})/FlashMLA V4 time, "
                                    f"batch {batch}, top-k {TOPK}, window {window}",
                            "value": ratio, "target": f"<= {limit}", "met": ratio <= limit, "note": note})
    for kernel, rows in (("store", store_rows), ("reconstruct", reconstruct_rows)):
        largest = max((r["records"] for r in rows), default=None)
        for r in rows:
            if r["records"] == largest:
                f = r["fraction_of_copy_bandwidth"]
                out.append({"name": f"{kernel} R={r['retention']} ({r['permute']}), {largest} records: "
                                    "fraction of copy bandwidth",
                            "value": f, "target": ">= 0.80", "met": f >= 0.80, "note": ""})
    for r in decode_rows:
        if (r["batch"] >= 64 and r["topk"] == TOPK and r["window"] == WINDOW
                and orders(r) in (("natural", "natural"), ("kept_first", "kept_first"), ("kept_first", "packed"))):
            f = r["fraction_of_copy_bandwidth"]
            bound = (f"floor is {r['floor_bound']}: {r['floor_us']:.2f} us; "
                     f"tensor-core fraction {r['fraction_of_matmul_rate']:.2f}")
            if capability == "9.0" and "n_regs" in r and "shared_bytes" in r:
                bound += "; " + _residency(r)
            label = "" if r["variant"] == "native" else f" ({_orders_label(*orders(r))}{_kernel_label(r)})"
            out.append({"name": f"decode {r['variant']} R={r['retention']}{label} batch {r['batch']}: "
                                "fraction of copy bandwidth",
                        "value": f, "target": ">= 0.75 or a named bound", "met": f >= 0.75, "note": bound})
    return out


def _kernel_label(row: dict) -> str:
    return ", SM90 Gluon kernel" if row.get("kernel") == "sm90" else ""


def _orders_label(columns: str, window_columns: str) -> str:
    label = f"{columns} columns"
    return label + {"natural": "", "kept_first": ", kept-first window", "packed": ", packed window"}[window_columns]


def _order_rank(orders: tuple[str, str]) -> tuple[bool, int]:
    """As served today first (natural, natural), the kernel alone last; the window's forms
    in WINDOW_COLUMNS' order."""
    return orders[0] == "kept_first", WINDOW_COLUMNS.index(orders[1])


def _shared_cost(by: dict, batch: int, window: int, orders: tuple[str, str], native: dict, packed: dict) -> str:
    """The ratio target's note on the calls without C4 records (top-k 0 rows at the same
    splits, where the run has them): what the two calls share, and the ratio of the rest
    (left out where the native call's rest is not positive: timing noise on a small call)."""
    native0 = by.get(("native", 512, batch, 0, window, ("natural", "natural"), "triton"))
    packed0 = by.get(("packed", KERNEL_R, batch, 0, window, orders, packed.get("kernel", "triton")))
    if not (native0 and packed0) or (native0["splits"], packed0["splits"]) != (native["splits"], packed["splits"]):
        return ""
    note = (f"; without C4 records (q, out, the window and, where split, the join; at the same splits) native "
            f"{native0['time_us']:.1f} us and packed {packed0['time_us']:.1f} us (the full calls: "
            f"{native['time_us']:.1f} and {packed['time_us']:.1f})")
    if native["time_us"] > native0["time_us"]:
        rest = (packed["time_us"] - packed0["time_us"]) / (native["time_us"] - native0["time_us"])
        note += f"; the C4 records' time packed/native {rest:.3f}"
    return note


def _triton_native_notes(by: dict, fixed: dict, batch: int, window: int, orders: tuple[str, str], native: dict,
                         packed: dict) -> str:
    """The cross-check's evidence from earlier rounds (benchmarks/kernels/NOTES.md): what the
    packed and Triton native calls share (_shared_cost), and the native call with the split
    plan and the join decode did not choose, where the run timed them."""
    how = _shared_cost(by, batch, window, orders, native, packed)
    plan, join = native.get("split_plan"), native.get("join")
    other_plan = other_split_plan(plan)
    natural = ("natural", "natural")
    other = fixed.get(("native", natural, batch, TOPK, window, native["splits"], other_plan, join)) if other_plan else None
    if other:  # (one split has no plan, and no other)
        how += (f"; native with split_plan={other_plan!r} (timed beside the split sweep; decode chose {plan!r}) "
                f"{other['time_us']:.1f} us against {native['time_us']:.1f}: the ratio against it "
                f"{packed['time_us'] / other['time_us']:.3f}")
    native_k = fixed.get(("native", natural, batch, TOPK, window, native["splits"], plan, "kernel"))
    packed_k = fixed.get(("packed", orders, batch, TOPK, window, packed["splits"], packed.get("split_plan"), "kernel"))
    if join == "exchange" and packed.get("join") == "exchange" and native_k and packed_k:
        how += (f"; with join='kernel' (the splits' partials joined by a kernel of its own; decode chose "
                f"'exchange') native {native_k['time_us']:.1f} us and packed {packed_k['time_us']:.1f}: ratio "
                f"{packed_k['time_us'] / native_k['time_us']:.3f}")
    return how


# Per multiprocessor of an H100/H200 (compute capability 9.0; targets() names residency on
# that capability only): the limits that decide how many decode programs run on one at a time.
SM_REGISTERS = 65536


SM_SHARED_BYTES = 233472  # the largest carve-out; 1 KB of it is reserved per program


SM_WARPS = 64


def _residency(row: dict) -> str:
    """The bound of a decode row named by its compiled kernel: how many of its programs fit
    on a multiprocessor and what limits them (registers are allocated per warp in units of
    256). One program per SM (named as the bound) leaves each scheduler two warps, so a step's dependent chain
    of loads, conversions, products and the softmax is not hidden by other work: the
    kernel is latency-bound (benchmarks/kernels/NOTES.md has ncu's stall reasons)."""
    warps = row["config"]["num_warps"]
    by = {"registers": SM_REGISTERS // (-(-row["n_regs"] * 32 // 256) * 256 * warps),
          "shared memory": SM_SHARED_BYTES // (row["shared_bytes"] + 1024),
          "warps": SM_WARPS // warps}
    programs = min(by.values())
    limits = " and ".join(name for name, fits in by.items() if fits == programs)  # each would have to give
    lead = "bound: latency, one program" if programs == 1 else f"{programs} programs"
    return (f"{lead} of {warps} warps per SM ({100 * programs * warps / SM_WARPS:.1f}% "
            f"occupancy, limited by {limits}: {row['n_regs']} registers per thread, {row['shared_bytes']} bytes of "
            f"shared memory, {row.get('n_spills', 0)} spilled registers)")
