"""The report of run or sweep directories, as `remnant-report` (remnant.cli.report) writes
it into a directory: computed once (remnant.report.model), its plots drawn, report.md
written and, with `html`, report.html, the same as one self-contained page."""

from __future__ import annotations

from pathlib import Path

from remnant.frontier import SloConfig
from remnant.records.files import write_text
from remnant.report import frontier, markdown, model, pareto, plots, server_metrics
from remnant.report import html as html_page


def build(paths: list[Path], out: Path, html: bool = False, slo: SloConfig | None = None) -> tuple[list[Path], str]:
    """Compute the report once (remnant.report.model; with `slo`, each run's goodput), draw
    its plots into `out`, write report.md (and report.html with `html`). Returns the files
    written and the summary table in Markdown."""
    report = model.collect(paths, slo)
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
