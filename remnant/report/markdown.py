"""report.md: a computed report (remnant.report.model.Report) as Markdown, plots linked
beside it."""

from __future__ import annotations

from remnant.report import model
from remnant.report.model import Report


def _failed_line(run: model.RunEntry) -> str:
    return (f"- {run.run_dir}: {run.status}" + (f" ({run.error})" if run.error else "")
            + (f"; {run.goodput_note()}" if run.goodput else ""))


def render(report: Report) -> str:
    sections = []
    if report.frontier is not None:
        sections = [f"## {model.FRONTIER}", report.frontier.markdown(), model.FRONTIER_NOTE]
    return "\n\n".join([
        "# Remnant report",
        f"{len(report.runs)} runs ({report.completed} completed) from {', '.join(report.paths)}.",
        f"## {model.SUMMARY}", report.summary.markdown(), *([report.slo_note] if report.slo_note else []),
        *sections,
        f"## {model.DELTAS}", report.deltas.markdown(),
        f"## {model.FAILED}", "\n".join(_failed_line(r) for r in report.failed) or "None.",
        f"## {model.PLOTS}", "\n".join(f"![{p.stem}]({p.name})" for p in report.plots) or "None.",
        f"## {model.LIMITS}", "\n".join(f"- {limit}" for limit in report.limits),
    ]) + "\n"
