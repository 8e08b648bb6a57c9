"""`remnant-report PATH...`: tables, paired comparisons and plots of run or sweep directories.

    remnant-report multirun/2026-11-29/18-00-00 --out report/ [--html] [--slo-ttft-ms 2000 --slo-tpot-ms 200]

Per workload, mode and retention: the mean and 95 % confidence interval of each metric over
repeated runs; per non-native run, per-request TTFT, TPOT and E2E deltas and the output
throughput's delta against the native run of the same request stream (equal workload
fingerprints; otherwise refused with the reason), and where a cell has two or more seeds
paired, their mean with an interval over seeds; capacity
and cache-hit columns; a Markdown report with the limits the runs carry, and PNG plots
(a Pareto view across a sweep's cells among them); with --html, the same as one
self-contained page, report.html (remnant.report.build). With an SLO bound or two, each
run's goodput (measured requests per second meeting every bound, as
sglang.bench_serving's --goodput counts them) joins the summary.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from remnant.frontier import SloConfig
from remnant.report.build import build


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="remnant-report", description=__doc__.split("\n\n")[0])
    p.add_argument("paths", nargs="+", type=Path, help="run directories, sweep directories or run.json files")
    p.add_argument("--out", type=Path, default=Path("report"), help="directory for report.md and the plots")
    p.add_argument("--html", action="store_true",
                   help="also write report.html: the report as one self-contained page, plots inline")
    p.add_argument("--slo-ttft-ms", type=float, default=None, metavar="MS",
                   help="goodput's TTFT bound per request (conf/slo/interactive.yaml: 2000)")
    p.add_argument("--slo-tpot-ms", type=float, default=None, metavar="MS",
                   help="goodput's TPOT bound per request (conf/slo/interactive.yaml: 200)")
    a = p.parse_args(argv)
    for flag, value in (("--slo-ttft-ms", a.slo_ttft_ms), ("--slo-tpot-ms", a.slo_tpot_ms)):
        if value is not None and not value > 0:  # NaN included
            p.error(f"{flag}={value:g} is not allowed; it must be milliseconds > 0")
    slo = None
    if a.slo_ttft_ms is not None or a.slo_tpot_ms is not None:
        slo = SloConfig(ttft_p99_ms=a.slo_ttft_ms, tpot_p99_ms=a.slo_tpot_ms)
    try:
        written, table = build(a.paths, a.out, html=a.html, slo=slo)
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
