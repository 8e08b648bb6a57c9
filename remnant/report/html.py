"""report.html: a computed report (remnant.report.model.Report) as one self-contained page.

Everything the page shows is in the file: plots as base64 PNG data URIs, the style inline,
no script, no font or stylesheet from elsewhere, so it opens offline and travels as one
attachment. Its Content-Security-Policy allows nothing else to load. Every string taken
from a record (paths, limits, errors, labels) is escaped.
"""

from __future__ import annotations

import base64
import html
from pathlib import Path

from remnant.report import model
from remnant.report.model import Report, RunEntry
from remnant.report.table import Table

_CSP = "default-src 'none'; img-src data:; style-src 'unsafe-inline'"

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 80em; padding: 0 1em; color: #222; }
h1 { font-size: 1.6em; } h2 { font-size: 1.25em; margin-top: 2em; border-bottom: 1px solid #ccc; }
table { border-collapse: collapse; font-size: 0.9em; margin: 0.5em 0; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.5em; text-align: left; vertical-align: top; }
th { background: #f2f2f2; } tbody tr:nth-child(even) { background: #fafafa; }
code { font-size: 0.9em; } .failed { color: #a00; }
figure { display: inline-block; margin: 0.5em 1em 1em 0; } img { max-width: 100%; }
figcaption { font-size: 0.85em; color: #555; }
details summary { cursor: pointer; } details ul { margin: 0.25em 0; padding-left: 1.2em; }
"""


def _e(text) -> str:
    return html.escape(str(text), quote=True)


def _table(table: Table, id_: str) -> str:
    if not table.rows:
        return f'<p id="{id_}">{_e(table.empty)}</p>'
    head = "".join(f"<th>{_e(h)}</th>" for h in table.head)
    body = "\n".join("<tr>" + "".join(f"<td>{_e(c)}</td>" for c in row) + "</tr>" for row in table.rows)
    return f'<table id="{id_}"><thead><tr>{head}</tr></thead>\n<tbody>\n{body}\n</tbody></table>'


def _figure(path: Path) -> str:
    data = base64.b64encode(path.read_bytes()).decode("ascii")
    return (f'<figure><img alt="{_e(path.stem)}" src="data:image/png;base64,{data}">'
            f"<figcaption>{_e(path.name)}</figcaption></figure>")


def _status(run: RunEntry) -> str:
    if run.status == "completed":
        return _e(run.status)
    return f'<span class="failed">{_e(run.status)}</span>' + (f"<br>{_e(run.error)}" if run.error else "")


def _run_row(run: RunEntry) -> str:
    limits = "".join(f"<li>{_e(limit)}</li>" for limit in run.limits)
    shown = (f"<details><summary>{len(run.limits)} limit{'s' if len(run.limits) != 1 else ''}</summary>"
             f"<ul>{limits}</ul></details>") if run.limits else "none"
    cells = [f"<code>{_e(run.run_dir)}</code>", _status(run), _e(run.workload), _e(run.mode), _e(run.retention),
             _e(run.seed), _e(run.load), _e(run.output_throughput), _e(run.tpot_p50_ms), shown]
    return '<tr class="run">' + "".join(f"<td>{c}</td>" for c in cells) + "</tr>"


def render(report: Report) -> str:
    """The page, as a string; plots are read from report.plots' files now."""
    runs_head = ["run directory", "status", "workload", "mode", "retention", "seed", "load", "output tok/s",
                 "TPOT p50 ms", "limits"]
    failed = "".join(f"<li><code>{_e(r.run_dir)}</code>: {_status(r)}"
                     + (f"<br>{_e(r.goodput_note())}" if r.goodput else "")
                     + "</li>" for r in report.failed)
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f'<meta http-equiv="Content-Security-Policy" content="{_CSP}">',
        # An empty icon: a browser opening the page asks for none.
        '<link rel="icon" href="data:,">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>Remnant report</title><style>{_STYLE}</style></head><body>",
        "<h1>Remnant report</h1>",
        f"<p>{len(report.runs)} runs ({report.completed} completed) from "
        + ", ".join(f"<code>{_e(p)}</code>" for p in report.paths) + ".</p>",
        f"<h2>{_e(model.SUMMARY)}</h2>", _table(report.summary, "summary"),
    ]
    if report.slo_note:
        parts.append(f'<p id="slo">{_e(report.slo_note)}</p>')
    if report.frontier is not None:
        parts += [f"<h2>{_e(model.FRONTIER)}</h2>", _table(report.frontier, "frontier"),
                  f"<p>{_e(model.FRONTIER_NOTE)}</p>"]
    parts += [
        f"<h2>{_e(model.DELTAS)}</h2>", _table(report.deltas, "deltas"),
        f"<h2>{_e(model.FAILED)}</h2>", f'<ul id="failed">{failed}</ul>' if failed else "<p>None.</p>",
        f"<h2>{_e(model.PLOTS)}</h2>",
        '<div id="plots">' + ("".join(_figure(p) for p in report.plots) or "<p>None.</p>") + "</div>",
        f"<h2>{_e(model.LIMITS)}</h2>",
        '<ul id="limits">' + "".join(f"<li>{_e(limit)}</li>" for limit in report.limits) + "</ul>",
        f"<h2>{_e(model.RUNS)}</h2>",
        '<table id="runs"><thead><tr>' + "".join(f"<th>{_e(h)}</th>" for h in runs_head) + "</tr></thead>\n<tbody>\n"
        + "\n".join(_run_row(r) for r in report.every_run) + "\n</tbody></table>",
        "</body></html>",
    ]
    return "\n".join(parts) + "\n"
