"""`remnant-report PATH...`: tables, paired comparisons and plots of run or sweep directories.

    remnant-report multirun/2026-11-29/18-00-00 --out report/ [--html]

Per workload, mode and retention: the mean and 95 % confidence interval of each metric over
repeated runs; per non-native run, per-request deltas against the native run of the same
request stream (equal workload fingerprints; otherwise refused with the reason); capacity
and cache-hit columns; a Markdown report with the limits the runs carry, and PNG plots
(a Pareto view across a sweep's cells among them); with --html, the same as one
self-contained page, report.html.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from remnant.records.files import write_text
from remnant.report import frontier, markdown, model, pareto, plots, server_metrics
from remnant.report import html as html_page


def build(paths: list[Path], out: Path, html: bool = False) -> tuple[list[Path], str]:
    """Compute the report once (remnant.report.model), draw its plots into `out`, write
    report.md (and report.html with `html`). Returns the files written and the summary
    table in Markdown."""
    report = model.collect(paths)
    runs, searches, steps = report.runs, report.searches, report.steps
    out.mkdir(parents=True, exist_ok=True)
    report.plots = [p for p in (
        plots.latency_distributions(runs, out / "latency.png"),
        plots.throughput(runs, out),
        plots.cache_hits(runs, out),
        plots.capacity_by_mode(runs, out / "capacity_by_mode.png"),
        pareto.pareto_plot(runs, out / "pareto.png"),
        server_metrics.server_metrics_plot(runs, out / "server_metrics.png"),
        frontier.goodput_plot(steps, searches, out / "goodput_vs_load.png") if not searches.empty else None,
    ) if p is not None]
    # records.files.write_text: a full disk names the file, not only --out.
    written = [write_text(out / "report.md", markdown.render(report))]
    if html:
        written.append(write_text(out / "report.html", html_page.render(report)))
    return written, report.summary.markdown()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="remnant-report", description=__doc__.split("\n\n")[0])
    p.add_argument("paths", nargs="+", type=Path, help="run directories, sweep directories or run.json files")
    p.add_argument("--out", type=Path, default=Path("report"), help="directory for report.md and the plots")
    p.add_argument("--html", action="store_true",
                   help="also write report.html: the report as one self-contained page, plots inline")
    a = p.parse_args(argv)
    try:
        written, table = build(a.paths, a.out, html=a.html)
    except ValueError as exc:
        print(f"remnant-report: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a full disk or an unwritable --out: the path, not a traceback
        print(f"remnant-report: error: cannot write {exc.filename or a.out}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    print(table)
    print("\n".join(map(str, written)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
