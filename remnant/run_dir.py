"""A run directory: what it holds, and what happens to an earlier attempt's files.

A run directory holds one run: run.json, requests.jsonl, server_metrics.jsonl,
server.log, a capture run's capture file and .hydra/ (docs/records.md). Before a cell runs
in a directory an earlier attempt used, `make_way` decides what becomes of that attempt:
a completed run.json of this very cell (the same resolved config and request stream) is
kept, so a resumed sweep or frontier search skips it; anything else is set aside under
new names labelled by how it ended, never overwritten. `claim` is the run's own start:
it refuses a directory that holds a run.json and holds space for the one it will write.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from remnant.config import RunConfig, recorded_config

RUN_JSON = "run.json"
#: A capture run's capture file, in its run directory.
CAPTURE_FILE = "capture.safetensors"
REQUESTS_JSONL = "requests.jsonl"
#: The server's /metrics as the client scraped them (remnant.client.server_metrics).
SERVER_METRICS_JSONL = "server_metrics.jsonl"
SERVER_LOG = "server.log"
SERVER_PORT = "server.port"
HYDRA_DIR = ".hydra"
#: What one attempt leaves in its run directory, set aside before the next attempt.
ATTEMPT_FILES = (RUN_JSON, REQUESTS_JSONL, SERVER_METRICS_JSONL, SERVER_LOG, HYDRA_DIR, CAPTURE_FILE)
#: Space held on the run's disk from its start until run.json is written, so a disk that
#: fills during the run still takes run.json (a run.json is some 10-20 KB).
RESERVE = ".run.json.reserve"
RESERVE_BYTES = 64 * 1024
#: The label of files an attempt left without a run.json: it was killed outright.
KILLED = "killed"


@dataclass(frozen=True)
class Earlier:
    """What an earlier attempt had left in a run directory, and what `make_way` did with it.

    outcome: the status its run.json recorded ("unreadable" for one that cannot be read),
        KILLED for files without a run.json, None where the directory held nothing.
    reuse: its run.json is a completed run of this very cell, kept: skip the run.
    why: why the cell runs again where a run.json was set aside (resume_check's words).
    moved: the new paths of what was set aside.
    """

    outcome: str | None = None
    reuse: bool = False
    why: str | None = None
    moved: list[Path] = field(default_factory=list)


def make_way(run_dir: Path, cfg: RunConfig | None) -> Earlier:
    """Ready `run_dir` for a run of `cfg`: keep a completed run.json of this very cell
    (`reuse`), else set aside whatever an earlier attempt left, labelled by its outcome.
    With no config (a cell whose config broke a rule) nothing is kept."""
    previous = previous_outcome(run_dir)
    why = None
    if previous is not None and cfg is not None:
        why = resume_check(cfg, run_dir)
        if why is None:
            return Earlier(previous, reuse=True)
    if previous is None and not leftovers(run_dir):
        return Earlier()
    label = previous or KILLED
    return Earlier(label, why=why, moved=set_aside(run_dir, label))


def claim(run_dir: Path) -> Path | None:
    """Start a run in `run_dir`: FileExistsError where it holds a run.json; files a killed
    attempt left are set aside (not .hydra/, which the CLI writes for this attempt); then
    RESERVE_BYTES are held for run.json. Returns the reserve (remove it just before
    run.json is written), None where even that space is not free."""
    run_dir = Path(run_dir)
    if (run_dir / RUN_JSON).exists():
        raise FileExistsError(f"{run_dir / RUN_JSON} exists: a run directory holds one run")
    run_dir.mkdir(parents=True, exist_ok=True)
    set_aside(run_dir, KILLED, names=(REQUESTS_JSONL, SERVER_METRICS_JSONL, SERVER_LOG, CAPTURE_FILE))
    return _reserve(run_dir)


def _reserve(run_dir: Path) -> Path | None:
    """Hold RESERVE_BYTES on the run's disk for run.json; None where even that is not free."""
    path = run_dir / RESERVE
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.posix_fallocate(fd, 0, RESERVE_BYTES)
        finally:
            os.close(fd)
        return path
    except OSError:
        path.unlink(missing_ok=True)
        return None


def previous_outcome(run_dir: Path) -> str | None:
    """Status of the run already recorded in run_dir (None if none)."""
    path = Path(run_dir) / RUN_JSON
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text()).get("status", "unknown")
    except (OSError, ValueError):
        return "unreadable"


def set_aside(run_dir: Path, label: str, names: tuple[str, ...] = ATTEMPT_FILES) -> list[Path]:
    """Keep an earlier attempt's records under new names before the cell runs again:
    run.json -> run.<label>-<UTC time>.json, .hydra -> .hydra.<label>-<UTC time>, never
    overwriting one set aside before. A stale server.port (the port of a server that is
    gone) and reserve are removed. Returns the new paths."""
    run_dir = Path(run_dir)
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S")
    moved = []
    for name in names:
        path = run_dir / name
        if not (path.exists() or path.is_symlink()):
            continue
        stem, suffix = (name, "") if path.is_dir() else (path.stem, path.suffix)
        n = 0
        while True:
            tag = f"{label}-{stamp}" + (f"-{n}" if n else "")
            target = path.with_name(f"{stem}.{tag}{suffix}")
            if not (target.exists() or target.is_symlink()):
                break
            n += 1
        path.rename(target)
        moved.append(target)
    for name in (SERVER_PORT, RESERVE):
        (run_dir / name).unlink(missing_ok=True)
    return moved


def leftovers(run_dir: Path) -> list[str]:
    """What an earlier attempt left in `run_dir` (of ATTEMPT_FILES and server.port)."""
    run_dir = Path(run_dir)
    return [name for name in (*ATTEMPT_FILES, SERVER_PORT) if (run_dir / name).exists()]


def _comparable(value: object) -> object:
    """A recorded config as JSON gives it back (tuples become lists), without `force`,
    which says whether to run again, not what runs."""
    plain = json.loads(json.dumps(value, default=str))
    if isinstance(plain, dict):
        plain.pop("force", None)
    return plain


def _first_difference(have: object, want: object, key: str = "") -> str | None:
    """The first dotted key where two plain configs differ, as `key: old -> new`."""
    if isinstance(have, dict) and isinstance(want, dict):
        for k in list(have) + [k for k in want if k not in have]:
            sub = f"{key}.{k}" if key else str(k)
            if k not in have:
                return f"{sub}: (absent) -> {json.dumps(want[k])}"
            if k not in want:
                return f"{sub}: {json.dumps(have[k])} -> (absent)"
            found = _first_difference(have[k], want[k], sub)
            if found:
                return found
        return None
    if have != want:
        def show(v: object) -> str:
            text = json.dumps(v)
            return text if len(text) <= 60 else text[:57] + "..."
        return f"{key or 'config'}: {show(have)} -> {show(want)}"
    return None


def resume_check(cfg: RunConfig, run_dir: Path) -> str | None:
    """None when run_dir's run.json is a completed run of exactly this cell: the same
    resolved config and the same request stream (workload fingerprint), so a resumed
    sweep may skip it. Otherwise why the cell runs again."""
    from remnant.workloads import plan_workload

    try:
        doc = json.loads((Path(run_dir) / RUN_JSON).read_text())
    except (OSError, ValueError) as exc:
        return f"its run.json cannot be read ({exc})"
    if not isinstance(doc, dict):
        return "its run.json is not a run record"
    if doc.get("status") != "completed":
        return f"its run.json says {doc.get('status')}"
    if cfg.force:
        return "force=true"
    diff = _first_difference(_comparable(doc.get("config")), _comparable(recorded_config(cfg)))
    if diff:
        return f"its config differs ({diff})"
    try:
        server_info = doc.get("server_info") if cfg.workload.needs_server_info() else None
        fingerprint = plan_workload(cfg.workload, cfg.model, server_info).fingerprint()
    except (ValueError, OSError) as exc:
        return f"its workload cannot be planned again ({exc})"
    recorded = (doc.get("workload") or {}).get("fingerprint")
    if fingerprint != recorded:
        return f"its request stream differs (workload fingerprint {str(recorded)[:12]} -> {fingerprint[:12]})"
    return None
