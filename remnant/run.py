"""One run: serve, drive, measure, record (DESIGN section 1).

`execute_run` takes a validated RunConfig and a run directory, and always leaves a
schema-valid run.json there, whatever happens: completed, failed (with the stage and
reason), or interrupted (Ctrl-C / SIGTERM). requests.jsonl and server.log sit beside it.
"""

from __future__ import annotations

import json
import logging
import signal
import time
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from remnant.config import RunConfig, recorded_config

log = logging.getLogger(__name__)

RUN_JSON = "run.json"
REQUESTS_JSONL = "requests.jsonl"
SERVER_LOG = "server.log"


@dataclass
class RunOutcome:
    path: Path
    status: str
    error: dict | None
    metrics: dict | None = None


class _Stage:
    """Names the stage a failure happened in, for run.json's error.stage."""

    def __init__(self) -> None:
        self.name = "setup"


def _now() -> str:
    return datetime.now(timezone.utc).isoformat()


def _base_limits(cfg: RunConfig) -> list[str]:
    limits = ["a single run: its variance is not measured (sweep seed=0,1,2 and remnant-report for a confidence interval)"]
    if cfg.host.kind == "embedded":
        limits.append(
            "embedded reference engine with random weights: text output is meaningless; "
            "timing is the CPU/GPU reference engine's, not SGLang's"
        )
    if cfg.workload.kind in ("random", "shared_prefix", "long_context", "longswe"):
        limits.append("synthetic random-token prompts, not real text")
    if cfg.workload.kind == "longswe":
        limits.append("replayed turns carry recorded-length synthetic answers, not the server's own output, "
                      "so pages cached during decode are not reused as real multi-turn serving would")
    return limits + list(cfg.limits)


def _native_decode_limits(server_info: dict | None) -> list[str]:
    """The embedded engine on a GPU says which kernel decoded native records: a run whose
    native attention was not FlashMLA's (SGLang's stock decode) must say so."""
    info = server_info or {}
    native = info.get("remnant_native_decode") or {}
    if info.get("device") != "cuda" or native.get("kernel") != "triton":
        return []
    return [f"decode over native records (native and triton modes, window-only and HCA layers) ran on Remnant's "
            f"Triton native kernel, not FlashMLA's V4 decode that SGLang runs: {native.get('reason')}"]


def _check_served_mode(mode: str, server_info: dict | None, base_url: str, started_here: bool) -> list[str]:
    """Limits to record about the server's mode; raises HostError where the server reports
    another mode than the run's: an external server started in one mode and driven as
    another would file its numbers under the wrong mode. A server this run started got
    the run's mode; an external one that does not say (SGLang's /server_info has no
    remnant_mode) is taken at the config's word, and run.json says so."""
    from remnant.hosts import HostError

    served = (server_info or {}).get("remnant_mode")
    if served is None:
        return [] if started_here else [
            f"the external server did not report its mode (no remnant_mode in /server_info): mode={mode} is as "
            "configured, not checked"]
    if served != mode:
        raise HostError(f"mode={mode}, but the server at {base_url} reports remnant_mode={served!r}: "
                        f"give mode={served} or drive a server started in {mode} mode")
    return []


def _sigterm_as_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def execute_run(cfg: RunConfig, run_dir: Path, run_id: str | None = None, progress: bool | None = None) -> RunOutcome:
    """Run `cfg` with its files in `run_dir`; returns where run.json is and how it ended."""
    from remnant.client.metrics import per_turn, summarize
    from remnant.client.runner import LoadClient
    from remnant.hosts import HostError, ServerSpec, make_host
    from remnant.records.provenance import artifact, sources
    from remnant.records.schema import RecordError, write_validated
    from remnant.workloads import needs_server_info, plan_workload

    run_dir = Path(run_dir)
    if (run_dir / RUN_JSON).exists():
        raise FileExistsError(f"{run_dir / RUN_JSON} exists: a run directory holds one run")
    run_dir.mkdir(parents=True, exist_ok=True)
    run_id = run_id or f"{datetime.now(timezone.utc):%Y%m%dT%H%M%SZ}-{uuid.uuid4().hex[:6]}"
    requests_path = run_dir / REQUESTS_JSONL
    requests_path.unlink(missing_ok=True)
    started_at, t_start = _now(), time.monotonic()
    stage = _Stage()
    status, error = "completed", None
    host = None
    server_info = environment = metrics = None
    phases: list = []
    limits = _base_limits(cfg)
    workload_rec = {"name": cfg.workload.name, "seed": cfg.workload.seed, "fingerprint": "0" * 64,
                    "dataset": None, "counts": {"warmup": 0, "measured": 0}, "params": {}}
    previous = signal.signal(signal.SIGTERM, _sigterm_as_interrupt)
    try:
        stage.name = "workload"
        plan = plan_workload(cfg.workload, cfg.model)
        workload_rec = {"name": plan.name, "seed": plan.seed, "fingerprint": plan.fingerprint(),
                        "dataset": plan.dataset, "counts": plan.counts(), "params": plan.params}
        reuse = plan.params.get("reuse_factor")
        if reuse and reuse > 1:
            limits.append(f"the dataset's usable conversations were reused {reuse:.2f}x: repeated prompts hit "
                          "the prefix cache")
        stage.name = "serve"
        host = make_host(cfg.host)
        native = cfg.mode.name == "native"
        spec = ServerSpec(cfg.mode.name, None if native else cfg.retention, cfg.model, run_dir, run_dir / SERVER_LOG,
                          run_id=run_id)
        with host.serve(spec) as endpoint:
            environment = endpoint.environment
            server_info = endpoint.server_info
            limits += _check_served_mode(cfg.mode.name, server_info, endpoint.base_url,
                                         started_here=cfg.host.kind != "external")
            limits += _native_decode_limits(server_info)
            if needs_server_info(cfg.workload):
                stage.name = "workload"
                plan = plan_workload(cfg.workload, cfg.model, server_info)
                workload_rec = {"name": plan.name, "seed": plan.seed, "fingerprint": plan.fingerprint(),
                                "dataset": plan.dataset, "counts": plan.counts(), "params": plan.params}
            stage.name = "client"
            client = LoadClient(
                endpoint.base_url, requests_path,
                request_timeout_s=cfg.workload.request_timeout_s,
                flush_timeout_s=cfg.workload.flush_timeout_s,
                server_failure=endpoint.failure, progress=progress,
            )
            results = client.run(plan.phases, on_phase_end=lambda r: phases.append(r))
        stage.name = "metrics"
        measured = next(r for r in results if r.name == "measured")
        metrics = summarize(measured.records, duration_s=measured.duration_s)
        if any(r.turn is not None for r in measured.records):
            metrics["per_turn"] = per_turn(measured.records)
        for r in results:
            if r.flush is not None and not r.flush.ok:
                limits.append(f"prefix cache flush before {r.name} failed: {r.flush.message}")
        if metrics["failed"]:
            limits.append(f"{metrics['failed']} measured requests failed; metrics cover the {metrics['completed']} that completed")
        if metrics["completed"] == 0:
            status, error = "failed", {"stage": "client", "type": "NoCompletedRequests",
                                       "message": "no measured request completed; see requests.jsonl"}
    except KeyboardInterrupt as exc:
        status = "interrupted"
        error = {"stage": stage.name, "type": "KeyboardInterrupt", "message": str(exc) or "interrupted by Ctrl-C"}
    except (HostError, ValueError, OSError, RuntimeError) as exc:
        status = "failed"
        error = {"stage": stage.name, "type": type(exc).__name__, "message": str(exc)}
    except Exception as exc:  # noqa: BLE001 - a bug still leaves a run.json behind
        log.exception("run failed unexpectedly at %s", stage.name)
        status = "failed"
        error = {"stage": stage.name, "type": type(exc).__name__, "message": f"unexpected error: {exc!r}"}
    finally:
        signal.signal(signal.SIGTERM, previous)

    artifacts = [artifact(p, run_dir) for p in (requests_path, run_dir / SERVER_LOG) if p.is_file()]
    host_info = host.describe() if host is not None else {"kind": cfg.host.kind}
    # A container host knows the image that ran and the SGLang inside it; sources() cannot.
    run_sources = {**sources(), "image_digest": host_info.get("image_id")}
    if "sglang_version" in host_info:
        run_sources["sglang_version"] = host_info["sglang_version"]
    doc = {
        "schema": "remnant/run",
        "schema_version": 1,
        "run_id": run_id,
        "status": status,
        "error": error,
        "started_at": started_at,
        "ended_at": _now(),
        "duration_s": time.monotonic() - t_start,
        "config": recorded_config(cfg),
        "sources": run_sources,
        "host": host_info,
        "environment": environment,
        "server_info": server_info,
        "workload": workload_rec,
        "phases": [p.to_dict() for p in phases],
        "metrics": metrics if status == "completed" else None,
        "artifacts": artifacts,
        "limits": limits,
    }
    try:
        path = write_validated(run_dir / RUN_JSON, doc)
    except RecordError as exc:
        # A record that breaks its own schema is a bug; still leave a valid run.json that
        # says so, and keep the full document beside it for the post-mortem.
        log.error("run.json failed validation: %s", exc)
        (run_dir / "run.invalid.json").write_text(json.dumps(doc, indent=2, default=str) + "\n")
        doc.update(status="failed", metrics=None, config={"unrecorded": str(exc)},
                   error={"stage": "record", "type": "RecordError", "message": str(exc)},
                   server_info=None, workload={**workload_rec, "params": {}})
        path = write_validated(run_dir / RUN_JSON, doc)
    return RunOutcome(path, doc["status"], doc["error"], doc["metrics"])


def previous_outcome(run_dir: Path) -> str | None:
    """Status of the run already recorded in run_dir (None if none)."""
    path = Path(run_dir) / RUN_JSON
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text()).get("status", "unknown")
    except (OSError, ValueError):
        return "unreadable"


def set_aside(run_dir: Path, status: str) -> None:
    """Keep an earlier attempt's records under new names before the cell runs again."""
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S")
    for name in (RUN_JSON, REQUESTS_JSONL, SERVER_LOG):
        path = Path(run_dir) / name
        if path.exists():
            path.rename(path.with_name(f"{path.stem}.{status}-{stamp}{path.suffix}"))


def record_config_error(run_dir: Path, config: dict, message: str, run_id: str | None = None) -> Path:
    """run.json for a sweep cell whose config breaks a rule: nothing ran, the reason is kept."""
    from remnant.records.provenance import sources
    from remnant.records.schema import write_validated

    now = _now()
    workload = config.get("workload") or {}
    doc = {
        "schema": "remnant/run",
        "schema_version": 1,
        "run_id": run_id or f"{datetime.now(timezone.utc):%Y%m%dT%H%M%SZ}-{uuid.uuid4().hex[:6]}",
        "status": "failed",
        "error": {"stage": "config", "type": "ConfigError", "message": message},
        "started_at": now,
        "ended_at": now,
        "duration_s": 0.0,
        "config": config,
        "sources": sources(),
        "host": {"kind": str((config.get("host") or {}).get("kind", "unknown"))},
        "environment": None,
        "server_info": None,
        "workload": {"name": str(workload.get("name", "unknown")),
                     "seed": workload["seed"] if isinstance(workload.get("seed"), int) else 0,
                     "fingerprint": "0" * 64, "dataset": None, "counts": {"warmup": 0, "measured": 0},
                     "params": {}},
        "phases": [],
        "metrics": None,
        "artifacts": [],
        "limits": ["nothing ran: the configuration broke a rule"],
    }
    return write_validated(Path(run_dir) / RUN_JSON, doc)
