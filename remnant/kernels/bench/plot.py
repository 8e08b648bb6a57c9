"""One PNG of a remnant-kernels record: decode time by batch beside FlashMLA's, each
decode's time over FlashMLA's, copy kernels against the copy bandwidth (matplotlib,
headless; no GPU needed). Everything drawn is read from the record, its targets too: an
older record is drawn against the targets it was measured against."""

from __future__ import annotations

import re
from pathlib import Path

# Decode rows drawn, as (variant, columns, window_columns, decode kernel) -> label; as
# served first. FlashMLA's rows have no decode kernel of ours ("").
DECODE_LINES = {
    ("flashmla", "natural", "natural", ""): "FlashMLA V4 (stock)",
    ("reconstruct+flashmla", "natural", "natural", ""): "triton mode: reconstruct + FlashMLA",
    ("native", "natural", "natural", "triton"): "Remnant Triton native (cross-check)",
    ("packed", "natural", "natural", "triton"): "packed, natural q/out and window (SGLang plugin)",
    ("packed", "natural", "kept_first", "triton"): "packed, natural q/out, kept-first window (engine)",
    ("packed", "kept_first", "natural", "triton"): "packed, kept-first q/out",
    ("packed", "kept_first", "kept_first", "triton"): "packed, kept-first q/out and window (folded, Triton)",
    ("packed", "kept_first", "kept_first", "sm90"): "packed, folded, SM90 Gluon kernel",
    ("packed", "kept_first", "packed", "triton"): "packed, kept-first q/out, packed window (engine's packed_csa)",
    ("packed", "kept_first", "packed", "sm90"): "packed, folded, packed window, SM90 Gluon kernel",
}


def _line_key(row: dict) -> tuple[str, str, str, str]:
    if "variant" not in row:  # a FlashMLA row: its "kernel" names FlashMLA's call
        return row["kernel"], "natural", "natural", ""
    # (records before kernel-bench v12 have no decode kernel: all were Triton's)
    return row["variant"], row.get("columns", "natural"), row.get("window_columns", "natural"), row.get("kernel", "triton")


def decode_series(doc: dict, window: int, topk: int, retention: int) -> dict[str, list[tuple[int, float]]]:
    """{label: [(batch, time_us)]} of the decode and FlashMLA rows at this window, top-k and packed R."""
    series: dict[str, list[tuple[int, float]]] = {}
    for row in doc["decode"] + doc.get("flashmla_decode", []):
        key = _line_key(row)
        if (key in DECODE_LINES and row.get("auto_splits", True) and row["window"] == window and row["topk"] == topk
                and row["retention"] in (512, retention)):
            series.setdefault(DECODE_LINES[key], []).append((row["batch"], row["time_us"]))
    order = list(DECODE_LINES.values())
    return {label: sorted(series[label]) for label in sorted(series, key=order.index)}


def ratio_series(doc: dict, window: int, topk: int, retention: int) -> dict[str, list[tuple[int, float]]]:
    """{label: [(batch, time / FlashMLA's time)]} of decode_series' lines but FlashMLA's."""
    series = decode_series(doc, window, topk, retention)
    stock = dict(series.pop(DECODE_LINES[("flashmla", "natural", "natural", "")], []))
    return {label: [(b, t / stock[b]) for b, t in points if b in stock] for label, points in series.items()
            if any(b in stock for b, _ in points)}


def flashmla_targets(doc: dict) -> dict[float, tuple[int, list[str]]]:
    """{limit: (the smallest batch it holds at, the calls it is for)} of the record's
    kernel-mode targets over FlashMLA's time below parity (remnant.kernels.bench.targets
    writes them as "decode packed (call)/FlashMLA V4 time, batch N, ..." with target "<=
    limit"; the packed window's limit is not the other calls'); none in a record from
    before FlashMLA was timed."""
    limits: dict[float, tuple[int, list[str]]] = {}
    for target in doc.get("targets", []):
        name = re.fullmatch(r"decode packed \((.+)\)/FlashMLA V4 time, batch (\d+),.*", target["name"])
        limit = re.fullmatch(r"<= ([0-9.]+)", target["target"])
        if name and limit and float(limit[1]) < 1.0:
            batch, calls = limits.get(float(limit[1]), (int(name[2]), []))
            limits[float(limit[1])] = (min(batch, int(name[2])), sorted({*calls, name[1]}))
    return limits


def split_series(doc: dict) -> dict[str, list[tuple[int, float]]]:
    """{label: [(splits, time_us)]} of the split sweep's rows (fixed splits), per kernel and
    batch, and apart those whose splits were cut by cost (split_plan) and two splits joined
    by the join kernel (where decode's own choice is the exchange: join_for)."""
    series: dict[str, list[tuple[int, float]]] = {}
    for row in doc["decode"]:
        key = _line_key(row)
        if not row.get("auto_splits", True) and key in DECODE_LINES:
            name = "native" if key[0] == "native" else "packed, folded" if key[1] == "kept_first" else DECODE_LINES[key]
            plan = ", cut by cost" if row.get("split_plan") == "by_cost" else ""
            plan += ", join kernel" if row.get("join") == "kernel" and row["splits"] == 2 else ""
            series.setdefault(f"{name}, batch {row['batch']}{plan}", []).append((row["splits"], row["time_us"]))
    return {label: sorted(points) for label, points in sorted(series.items())}


def _finish(ax, xlabel: str, ylabel: str, title: str, legend: bool = True) -> None:
    """A panel over a power-of-two axis (batches, splits): labels, title, legend, grid."""
    ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if legend:
        ax.legend(fontsize=7)
    ax.grid(alpha=0.3)


def plot(doc: dict, out: Path, topk: int = 512, retention: int = 256) -> Path:
    """Three panels: decode time by batch with the window and without it (one line per
    column order that has rows), and each copy kernel's fraction of the copy bandwidth by R
    at its largest size, its best permutation; a fourth, decode time by split count, when
    the record has the split sweep."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    splits = split_series(doc)
    ratios = ratio_series(doc, 128, topk, retention)
    panels = 3 + bool(ratios) + bool(splits)
    fig, axes = plt.subplots(1, panels, figsize=(5.6 * panels, 4.8))
    labels = list(DECODE_LINES.values())
    for ax, window in zip(axes[:2], (128, 0)):
        for label, points in decode_series(doc, window, topk, retention).items():
            color = f"C{labels.index(label)}"  # the same line, the same color, in every panel
            stock = label == DECODE_LINES[("flashmla", "natural", "natural", "")]
            ax.plot([b for b, _ in points], [t for _, t in points], marker="o", color=color, label=label,
                    linewidth=2.5 if stock else 1.5, linestyle="-" if stock else "--" if "Triton native" in label else "-")
        _finish(ax, "batch (decode tokens)", "time per call (us)", f"decode, top-k {topk}, window {window}, R = {retention}",
                legend=window == 128)
    next_panel = 2
    if ratios:
        ax = axes[next_panel]
        next_panel += 1
        for label, points in ratios.items():
            ax.plot([b for b, _ in points], [r for _, r in points], marker="o", color=f"C{labels.index(label)}",
                    label=label)
        ax.axhline(1.0, color="black", linewidth=1)
        for limit, (batch, calls) in sorted(flashmla_targets(doc).items()):
            only = f" ({calls[0]})" if len(calls) == 1 else ""  # a limit of one call names it
            ax.axhline(limit, color="gray", linestyle="--", linewidth=1,
                       label=f"kernel-mode target at batch >= {batch}: {limit}{only}")
        _finish(ax, "batch (decode tokens)", "time / FlashMLA V4's time", f"against FlashMLA, top-k {topk}, window 128")
    ax = axes[next_panel]
    for kernel in ("store", "reconstruct"):
        rows = doc[kernel]
        largest = max((r["records"] for r in rows), default=None)
        best: dict[int, float] = {}
        for r in rows:
            if r["records"] == largest:
                best[r["retention"]] = max(best.get(r["retention"], 0.0), r["fraction_of_copy_bandwidth"])
        packed = sorted(r for r in best if r < 512)
        color = "C0" if kernel == "store" else "C1"
        ax.plot(packed, [100 * best[r] for r in packed], marker="s", color=color, label=f"{kernel} ({largest} records)")
        if 512 in best:
            ax.plot([512], [100 * best[512]], marker="*", markersize=12, color=color, linestyle="none",
                    label=f"{kernel}, native records")
    ax.axhline(80, color="gray", linestyle="--", linewidth=1, label="target 80%")
    ax.set_xlabel("retention R (512: native)")
    ax.set_ylabel("% of the measured copy bandwidth")
    ax.set_title("store and reconstruct, best permutation")
    ax.set_ylim(0, 110)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    if splits:
        ax = axes[next_panel + 1]
        for label, points in splits.items():
            ax.plot([n for n, _ in points], [t for _, t in points], marker="o",
                    linestyle="-" if label.startswith("native") else "--", label=label)
        _finish(ax, "programs per token and head block (splits)", "time per call (us)",
                f"decode by splits, top-k {topk}, window 128")
    gpu = doc["provenance"]["gpu"]["name"]
    fig.suptitle(f"remnant-kernels on {gpu} (copy {doc['ceilings']['copy_gbps']:.0f} GB/s), "
                 f"commit {doc['provenance']['git_commit']}", fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
