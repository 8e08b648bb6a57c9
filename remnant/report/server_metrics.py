"""The server's side of a run set beside the client's: server_metrics.png.

Three panels over one time axis, seconds since each run's measured phase started (its
warm-up before 0; a run stopped before its measured phase from its client's start): the
KV pool in use (sglang:token_usage), the requests waiting in the server's queue
(sglang:num_queue_reqs, solid) and running (sglang:num_running_reqs, dashed), both from
the server's /metrics as the client scraped them (server_metrics.jsonl), and the TTFT of
each request the client completed, at the time it was sent (requests.jsonl). One colour
per mode (and retention), one line per run.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

KV_USAGE = "sglang:token_usage"
QUEUE = "sglang:num_queue_reqs"
RUNNING = "sglang:num_running_reqs"


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def series(runs: pd.DataFrame) -> list[dict]:
    """Per run with a server series: label (mode and retention), seed, the scrapes and the
    completed requests' (start, TTFT), times shifted to its measured phase's start."""
    out = []
    for _, run in runs.iterrows():
        doc = json.loads(Path(run["path"]).read_text())
        sm = doc.get("server_metrics") or {}
        if not sm.get("path") or not (Path(run["run_dir"]) / sm["path"]).is_file():
            continue
        scrapes = _read_jsonl(Path(run["run_dir"]) / sm["path"])
        if not scrapes:
            continue
        t0 = next((p["started_at_s"] for p in doc.get("phases") or [] if p["name"] == "measured"), 0.0)
        requests = Path(run["run_dir"]) / "requests.jsonl"
        ttft = [(r["start_s"] - t0, 1000 * r["ttft_s"]) for r in (_read_jsonl(requests) if requests.is_file() else [])
                if r.get("success") and r.get("ttft_s") is not None]
        out.append({"label": f"{run['mode']} {run['retention']}".replace(" -", "").strip(), "seed": run["seed"],
                    "status": run["status"], "scrapes": [{**s, "t": s["t"] - t0} for s in scrapes], "ttft": ttft})
    return out


def server_metrics_plot(runs: pd.DataFrame, out: Path) -> Path | None:
    """server_metrics.png for the runs that scraped their server (None where none did)."""
    from remnant.report.plots import _plt, save_figure

    data = series(runs)
    if not data:
        return None
    plt = _plt()
    labels = sorted({d["label"] for d in data})
    colours = {label: f"C{i % 10}" for i, label in enumerate(labels)}
    fig, (kv, queue, ttft) = plt.subplots(3, 1, figsize=(8, 8.5), sharex=True)
    for d in data:
        c = colours[d["label"]]
        t = [s["t"] for s in d["scrapes"]]
        if any(KV_USAGE in s for s in d["scrapes"]):
            kv.plot(t, [s.get(KV_USAGE) for s in d["scrapes"]], color=c, lw=1.2, alpha=0.8)
        if any(QUEUE in s for s in d["scrapes"]):
            queue.plot(t, [s.get(QUEUE) for s in d["scrapes"]], color=c, lw=1.2, alpha=0.8)
        if any(RUNNING in s for s in d["scrapes"]):
            queue.plot(t, [s.get(RUNNING) for s in d["scrapes"]], color=c, lw=1.0, ls="--", alpha=0.6)
        if d["ttft"]:
            ttft.scatter([x for x, _ in d["ttft"]], [y for _, y in d["ttft"]], color=c, s=8, alpha=0.6)
    for label in labels:
        kv.plot([], [], color=colours[label], label=label)
    kv.legend(fontsize=8, title="mode", title_fontsize=8, loc="upper left")
    kv.set_ylabel("KV usage\n(sglang:token_usage)")
    peak = max((s.get(KV_USAGE) or 0.0 for d in data for s in d["scrapes"]), default=0.0)
    kv.set_ylim(0, min(1.05, max(1.2 * peak, 0.01)))  # a share of the pool: 0 at the bottom, 1 at most
    queue.set_ylabel("requests\nqueued (solid), running (dashed)")
    ttft.set_ylabel("client TTFT (ms)\nby send time")
    ttft.set_xlabel("s since the measured phase started")
    for ax in (kv, queue, ttft):
        ax.grid(alpha=0.3)
        ax.axvline(0, color="0.6", lw=0.8)
    kv.set_title(f"the server's /metrics beside the client's latency ({len(data)} runs)", fontsize=10)
    fig.tight_layout()
    save_figure(fig, out)
    return out
