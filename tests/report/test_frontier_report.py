"""remnant-report's frontier section from frontier.json records: each mode's frontier with
its interval over seeds, and goodput against load (the end-to-end report of a real search
is in tests/cli/test_frontier.py)."""

from __future__ import annotations

import copy
import json
from importlib import resources
from pathlib import Path

import pytest

from remnant.records.schema import write_validated
from remnant.report.frontier import find_searches, frontier_markdown, frontier_table, goodput_plot, load_searches

EXAMPLE = Path(str(resources.files("remnant.schemas"))) / "frontier" / "examples" / "valid" / "resolved.json"


def _search(root: Path, name: str, mode: str, seed: int, frontier: int | None, stopped: str = "resolved",
            status: str = "completed") -> Path:
    """A frontier.json like the schema's example, with its mode, seed and frontier changed;
    steps at loads 1, 2, 4 whose goodput grows with the load."""
    doc = copy.deepcopy(json.loads(EXAMPLE.read_text()))
    doc.update(mode=mode, seed=seed, retention=None if mode == "native" else "r256", status=status)
    doc["steps"] = doc["steps"][:3]
    for step in doc["steps"]:
        step["metrics"]["goodput"] = float(step["load"] + seed)
    doc["frontier"] = {"load": frontier, "bracket": [frontier, None], "stopped": stopped,
                       "at_least": stopped == "max_passed"}
    if status != "completed":
        doc["error"] = {"stage": "step", "message": "interrupted"}
    return write_validated(root / name / "frontier.json", doc)


def test_frontier_per_mode_with_interval_over_seeds(tmp_path):
    for seed, value in enumerate((4, 5, 6)):
        _search(tmp_path, f"k{seed}", "kernel", seed, value)
    _search(tmp_path, "n0", "native", 0, 4, stopped="max_passed")
    _search(tmp_path, "n1", "native", 1, None, stopped="start_missed")
    _search(tmp_path, "n2", "native", 2, 2, stopped="interrupted", status="interrupted")
    assert len(find_searches([tmp_path])) == 6
    searches, steps = load_searches([tmp_path])
    assert len(steps) == 18 and set(steps["load"]) == {1, 2, 4}
    table = frontier_table(searches).set_index("mode")
    kernel, native = table.loc["kernel"], table.loc["native"]
    assert kernel["mean"] == 5.0 and kernel["ci"] == pytest.approx(4.303 / 3 ** 0.5)
    assert kernel["per_seed"] == "s0: 4, s1: 5, s2: 6"
    # Only the completed searches that found a frontier count; one capped at max makes the
    # mean a lower bound.
    assert (native["searches"], native["with_frontier"], native["mean"], native["lower_bound"]) == (3, 1, 4.0, True)
    assert native["per_seed"] == "s0: >=4, s1: none (<1), s2: 2 (interrupted)"
    text = frontier_markdown(frontier_table(searches))
    assert "| kernel | r256 | 3 | 5.0 ± 2.5 concurrency |" in text
    assert "| native | - | 3 | >=4.0 concurrency |" in text
    assert "TTFT p99 <= 400 ms" in text
    png = goodput_plot(steps, searches, tmp_path / "goodput.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


def test_no_searches_no_section(tmp_path):
    searches, steps = load_searches([tmp_path])
    assert searches.empty and frontier_markdown(frontier_table(searches)) == "No frontier searches."
    assert goodput_plot(steps, searches, tmp_path / "g.png") is None
