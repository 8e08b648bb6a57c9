"""A table of display strings: what a report shows, computed once (remnant.report.model) and
rendered as Markdown (report.md) or HTML (report.html)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pandas as pd


def fmt(value, ci=None, digits: int = 1) -> str:
    """`value ± ci` with thousands separators; "-" where the value is missing, no "±" where
    the interval is (a single run)."""
    if value is None or (isinstance(value, float) and pd.isna(value)):
        return "-"
    text = f"{value:,.{digits}f}"
    if ci is not None and not (isinstance(ci, float) and pd.isna(ci)):
        text += f" ± {ci:,.{digits}f}"
    return text


@dataclass(frozen=True)
class Table:
    """Column heads and rows of cell strings; `empty` is said instead where there are no rows."""

    head: list[str]
    rows: list[list[str]] = field(default_factory=list)
    empty: str = "None."

    def markdown(self) -> str:
        if not self.rows:
            return self.empty
        # A "|" or a line break taken from a record would end the cell or the row.
        def cell(text: str) -> str:
            return str(text).replace("|", "\\|").replace("\n", " ")

        lines = ["| " + " | ".join(self.head) + " |", "|" + "---|" * len(self.head)]
        lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in self.rows]
        return "\n".join(lines)
