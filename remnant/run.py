"""One run: serve, drive, measure, record (docs/architecture.md).

`execute_run` takes a validated RunConfig and a run directory, and leaves a schema-valid
run.json there whatever happens: completed, degraded (more measured requests failed than
workload.max_failed_share allows), failed (with the stage and reason: a stalled server,
the deadline, a full disk, ...), or interrupted (Ctrl-C / SIGTERM). requests.jsonl and
server.log sit beside it. Where run.json itself cannot be written (a full or read-only
disk), the outcome says so instead.

The run goes through its stages gathering what each finds out (remnant.run_verdict's
RunFacts); remnant.run_verdict turns the facts into the status, error and limits, and
`run_document` lays facts and verdict out as run.json. The run directory, and what
becomes of an earlier attempt's files there, is remnant.run_dir's.
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
from typing import Any

from remnant.config import RunConfig, recorded_config
from remnant.kv.modes import mode_of
from remnant.records.kinds import RUN
from remnant.run_dir import CAPTURE_FILE, REQUESTS_JSONL, RUN_JSON, SERVER_LOG, SERVER_METRICS_JSONL, claim
from remnant.run_verdict import FORESEEN, RunFacts, Verdict, served_mode_error, verdict
from remnant.signals import raise_interrupted

log = logging.getLogger(__name__)


@dataclass
class RunOutcome:
    """How a run ended. path: its run.json, None where it could not be written (then
    write_error says why). signum: the signal that interrupted it."""

    path: Path | None
    status: str
    error: dict | None
    metrics: dict | None = None
    signum: int | None = None
    write_error: str | None = None


@dataclass
class RunHeader:
    """What ran, when, and where: run.json's fields beside the facts and the verdict.

    started_at, ended_at: ISO 8601 UTC; duration_s: seconds, by the monotonic clock.
    config: the config as recorded (remnant.config.recorded_config); sources: the code
    (remnant.records.provenance.sources, with the image and SGLang a container ran);
    host: the host's own description; workload: `workload_record`.
    """

    run_id: str
    started_at: str
    ended_at: str
    duration_s: float
    config: dict
    sources: dict
    host: dict
    workload: dict


def _now() -> str:
    return datetime.now(timezone.utc).isoformat()


def _new_run_id() -> str:
    return f"{datetime.now(timezone.utc):%Y%m%dT%H%M%SZ}-{uuid.uuid4().hex[:6]}"


def _sigterm_as_interrupt(signum, frame):
    raise_interrupted(signum, frame)


def _write_error(path: Path, exc: OSError) -> str:
    return f"run.json could not be written to {path}: {exc.strerror or exc}"


def workload_record(name: str, seed: int, plan=None) -> dict:
    """run.json's `workload`: what `plan` (a remnant.workloads.WorkloadPlan) sends, or, for a
    run that never planned its requests, the config's name and seed with no requests."""
    if plan is None:
        return {"name": name, "seed": seed, "fingerprint": "0" * 64, "dataset": None,
                "counts": {"warmup": 0, "measured": 0}, "params": {}}
    return {"name": plan.name, "seed": plan.seed, "fingerprint": plan.fingerprint(), "dataset": plan.dataset,
            "counts": plan.counts(), "params": plan.params}


def run_document(header: RunHeader, facts: RunFacts, verdict: Verdict) -> dict:
    """run.json (remnant.records.kinds.RUN): every run writes this document, one that ran
    and one whose config broke a rule alike. The metrics and the client's summary stand
    only where the verdict says the run measured (completed or degraded)."""
    return {
        **RUN.header(),
        "run_id": header.run_id,
        "status": verdict.status,
        "error": verdict.error,
        "started_at": header.started_at,
        "ended_at": header.ended_at,
        "duration_s": header.duration_s,
        "config": header.config,
        "sources": header.sources,
        "host": header.host,
        "environment": facts.environment,
        "server_info": facts.server_info,
        "workload": header.workload,
        "phases": [p.to_dict() for p in facts.phases],
        "metrics": facts.metrics if verdict.measured else None,
        "failures": facts.failures,
        "client_stop": verdict.client_stop,
        "client": facts.client if verdict.measured else None,
        "artifacts": facts.artifacts,
        "capture": facts.capture,
        "retention_map": facts.retention_map,
        "server_metrics": facts.server_metrics,
        "limits": verdict.limits,
    }


def capture_settings(cfg: RunConfig, run_dir: Path):
    """The CaptureSettings a capture run gives its server (None for an ordinary run)."""
    if cfg.capture is None:
        return None
    from remnant.calibration.capture_recorder import CaptureSettings

    return CaptureSettings(path=str((Path(run_dir) / CAPTURE_FILE).resolve()), tokens=cfg.capture.tokens,
                           records=cfg.capture.records, source=cfg.capture.source or cfg.workload.name,
                           model_id=cfg.model.path or cfg.model.name)


def ask_capture_write(base_url: str, settings, api_key: str | None = None) -> None:
    """Ask the server to write its capture now, short of the budget if need be: the marker
    file beside the capture, then /flush_cache
    (remnant.calibration.capture_recorder.write_requested). SGLang stops its schedulers with
    SIGKILL, so nothing could write it after the run."""
    import httpx

    from remnant.api_key import bearer
    from remnant.calibration.capture_recorder import write_request

    marker = write_request(settings.path)
    marker.touch()
    try:
        # The server writes the file before it answers: up to a few GB for a real model.
        httpx.post(f"{base_url}/flush_cache", timeout=600.0, headers=bearer(api_key))
    except httpx.HTTPError as exc:
        log.warning("capture: /flush_cache failed (%s); the capture is written only if the server stops cleanly", exc)
    finally:
        marker.unlink(missing_ok=True)


def capture_record(settings, run_dir: Path) -> tuple[dict, list[str]]:
    """run.json's `capture` for the file the server wrote, and the limits it calls for.
    ValueError (naming the file) where the server wrote none or an unreadable one."""
    from remnant.calibration.captures import load_captures

    path = Path(settings.path)
    if not path.is_file():
        raise ValueError(f"the server wrote no capture file {path.name}: no CSA layer saw a decode query and a "
                         "latent before it stopped (see server.log); give the workload more requests or output tokens")
    caps = load_captures(path)
    queries = min(int(c.q.shape[0]) for c in caps.layers.values())
    latents = min(int(c.k.shape[0]) for c in caps.layers.values())
    record = {"path": path.relative_to(Path(run_dir).resolve()).as_posix(), "fingerprint": caps.fingerprint,
              "model_id": caps.model_id, "source": caps.source, "layers": sorted(caps.layers),
              "heads": int(next(iter(caps.layers.values())).q.shape[1]),
              "queries": queries, "latents": latents, "tokens": settings.tokens, "records": settings.records,
              "complete": bool(caps.params.get("complete", queries >= settings.tokens and latents >= settings.records))}
    limits = ["a capture run: the server copied each CSA layer's decode queries and latents to the CPU while serving, "
              "so its timings are not a benchmark of the mode"]
    if not record["complete"]:
        limits.append(f"the capture stopped short of its budget ({queries} of {settings.tokens} decode queries, "
                      f"{latents} of {settings.records} latents in its smallest CSA layer): written when the run "
                      "ended")
    return record, limits


def retention_map_record(cfg: RunConfig) -> dict | None:
    """run.json's `retention_map`: the map a packed run served with, with the fingerprint of
    the captures it was built from (None in native mode or without a map file)."""
    if not mode_of(cfg.mode.name).keeps_retention or not cfg.retention.map_path:
        return None
    from remnant.calibration.retention import RetentionMap
    from remnant.records.provenance import sha256_file

    rmap = RetentionMap.load(cfg.retention.map_path)
    return {"path": str(Path(cfg.retention.map_path).resolve()), "sha256": sha256_file(cfg.retention.map_path),
            "model_id": rmap.model_id, "policy": {"name": rmap.policy, "params": dict(rmap.policy_params)},
            "calibration": dict(rmap.calibration)}


@dataclass
class _Attempt:
    """One run's handles, as execute_run's stages make them: what run.json is written
    from besides the facts (the host to describe, the key to scrub, the plan)."""

    cfg: RunConfig
    run_dir: Path
    run_id: str
    started_at: str
    t_start: float
    capture: Any = None  # CaptureSettings of a capture run
    plan: Any = None  # remnant.workloads.WorkloadPlan, once planned
    host: Any = None
    api_key: str | None = None  # known from the serve stage on: scrubbed from every record
    scraper: Any = None  # the client's scraper of the server's /metrics


def execute_run(cfg: RunConfig, run_dir: Path, run_id: str | None = None, progress: bool | None = None) -> RunOutcome:
    """Run `cfg` with its files in `run_dir`; returns where run.json is and how it ended.

    Files an earlier attempt left without a run.json (a killed run) are set aside first.
    A signal raised while run.json is being written waits until it is written.
    """
    from remnant.client.metrics import failure_summary
    from remnant.client.runner import ClientStopped
    from remnant.hosts.base import signals_deferred

    run_dir = Path(run_dir)
    reserve = claim(run_dir)
    attempt = _Attempt(cfg, run_dir, run_id or _new_run_id(), _now(), time.monotonic(),
                       capture=capture_settings(cfg, run_dir))
    facts = RunFacts()
    previous = signal.signal(signal.SIGTERM, _sigterm_as_interrupt)
    try:
        _drive(attempt, facts, progress)
    except ClientStopped as exc:
        facts.ended_by = exc
        if exc.phase is not None:
            facts.phases.append(exc.phase)
            if exc.phase.name == "measured":
                facts.failures = failure_summary(exc.phase.records, cfg.workload.max_failed_share)
    except (KeyboardInterrupt, Exception) as exc:  # noqa: BLE001 - a bug still leaves a run.json behind
        facts.ended_by = exc
        if not isinstance(exc, (KeyboardInterrupt, *FORESEEN)):
            log.exception("run failed unexpectedly at %s", facts.stage)
    finally:
        signal.signal(signal.SIGTERM, previous)
    if attempt.scraper is not None:
        facts.server_metrics, facts.scrape_limits = attempt.scraper.record(facts.phases)
    ended = verdict(cfg, facts)
    # A second signal waits for run.json: what the run did is written before it stops.
    with signals_deferred():
        if reserve is not None:
            reserve.unlink(missing_ok=True)  # room for run.json, on a disk that may be full
        return _record(attempt, facts, ended)


def _drive(attempt: _Attempt, facts: RunFacts, progress: bool | None) -> None:
    """The run's stages: plan the workload, serve, drive the client, measure. Each stage is
    named in facts.stage before it starts, and what it finds goes into facts."""
    from remnant.client.metrics import client_summary, failure_summary, per_turn, summarize
    from remnant.client.runner import LoadClient
    from remnant.hosts import HostError, ServerSpec, make_host
    from remnant.workloads import plan_workload
    from remnant.workloads.dataset_file import skipped_records

    cfg, run_dir = attempt.cfg, attempt.run_dir
    facts.stage = "workload"
    attempt.plan = plan_workload(cfg.workload, cfg.model)
    facts.plan_limits = skipped_records(attempt.plan.dataset)  # and says so, once, on the log
    reuse = attempt.plan.params.get("reuse_factor")
    if reuse and reuse > 1:
        facts.plan_limits.append(f"the dataset's usable conversations were reused {reuse:.2f}x: repeated prompts "
                                 "hit the prefix cache")
    facts.retention_map = retention_map_record(cfg)
    facts.stage = "serve"
    attempt.api_key = cfg.host.api_key()
    attempt.host = make_host(cfg.host)
    retention = cfg.retention if mode_of(cfg.mode.name).keeps_retention else None
    spec = ServerSpec(cfg.mode.name, retention, cfg.model, run_dir, run_dir / SERVER_LOG,
                      run_id=attempt.run_id, capture=attempt.capture, api_key=attempt.api_key)
    with attempt.host.serve(spec) as endpoint:
        facts.served = True
        facts.environment, facts.server_info = endpoint.environment, endpoint.server_info
        mismatch = served_mode_error(cfg.mode.name, facts.server_info, endpoint.base_url)
        if mismatch is not None:
            raise HostError(mismatch)
        if cfg.workload.needs_server_info():
            facts.stage = "workload"
            attempt.plan = plan_workload(cfg.workload, cfg.model, facts.server_info)
        facts.stage = "client"
        client = LoadClient(
            endpoint.base_url, run_dir / REQUESTS_JSONL,
            request_timeout_s=cfg.workload.request_timeout_s,
            flush_timeout_s=cfg.workload.flush_timeout_s,
            server_failure=endpoint.failure, progress=progress,
            stall_timeout_s=cfg.workload.stall_timeout_s,
            deadline_s=cfg.workload.deadline_s,
            api_key=attempt.api_key,
            server_metrics_interval_s=cfg.workload.server_metrics_interval_s,
            server_metrics_path=run_dir / SERVER_METRICS_JSONL,
            oversaturation=cfg.workload.oversaturation,
        )
        attempt.scraper = client.scraper  # started and stopped by client.run
        facts.results = client.run(attempt.plan.phases, on_phase_end=facts.phases.append)
        if attempt.capture is not None:
            facts.stage = "capture"
            ask_capture_write(endpoint.base_url, attempt.capture, attempt.api_key)
    facts.stage = "metrics"
    measured = next(r for r in facts.results if r.name == "measured")
    facts.metrics = summarize(measured.records, duration_s=measured.duration_s)
    if any(r.turn is not None for r in measured.records):
        facts.metrics["per_turn"] = per_turn(measured.records)
    w = cfg.workload
    facts.client = client_summary(measured.records, measured.duration_s, measured.loop_cpu_s, measured.process_cpu_s,
                                  w.request_rate, w.arrival, w.saturation_cpu_share, w.saturation_dispatch_p99_ms)
    facts.failures = failure_summary(measured.records, w.max_failed_share)
    if attempt.capture is not None:
        # The server is stopped: a capture short of its budget was written as it stopped.
        facts.stage = "capture"
        facts.capture, facts.capture_limits = capture_record(attempt.capture, run_dir)


def _record(attempt: _Attempt, facts: RunFacts, ended: Verdict) -> RunOutcome:
    """Write run.json for the run `facts` and `ended` describe, its artifacts hashed and the
    API key scrubbed from every record; the outcome says where, or why it could not be."""
    from remnant.api_key import redact, redact_file
    from remnant.records.provenance import artifact, sources
    from remnant.records.schema import RecordError, write_validated

    cfg, run_dir = attempt.cfg, attempt.run_dir
    for text_record in (run_dir / REQUESTS_JSONL, run_dir / SERVER_LOG):
        # Before hashing: SGLang logs its ServerArgs, key included.
        redact_file(text_record, attempt.api_key)
    known = {CAPTURE_FILE: facts.capture["fingerprint"]} if facts.capture else {}  # hashed when it was read
    facts.artifacts = [artifact(p, run_dir, known.get(p.name))
                       for p in (run_dir / REQUESTS_JSONL, run_dir / SERVER_METRICS_JSONL, run_dir / SERVER_LOG,
                                 run_dir / CAPTURE_FILE) if p.is_file()]
    host_info = attempt.host.describe() if attempt.host is not None else {"kind": cfg.host.kind}
    # A container host knows the image that ran and the SGLang inside it; sources() cannot.
    run_sources = {**sources(), "image_digest": host_info.get("image_id")}
    if "sglang_version" in host_info:
        run_sources["sglang_version"] = host_info["sglang_version"]
    workload_rec = workload_record(cfg.workload.name, cfg.workload.seed, attempt.plan)
    header = RunHeader(attempt.run_id, attempt.started_at, _now(), time.monotonic() - attempt.t_start,
                       recorded_config(cfg), run_sources, host_info, workload_rec)
    doc = redact(run_document(header, facts, ended), attempt.api_key)  # /server_info holds SGLang's ServerArgs
    path: Path | None = run_dir / RUN_JSON
    write_error = None
    try:
        try:
            write_validated(path, doc)
        except RecordError as exc:
            # A record that breaks its own schema is a bug; still leave a valid run.json that
            # says so, and keep the full document beside it for the post-mortem.
            log.error("run.json failed validation: %s", exc)
            (run_dir / "run.invalid.json").write_text(json.dumps(doc, indent=2, default=str) + "\n")
            doc.update(status="failed", metrics=None, config={"unrecorded": str(exc)},
                       error={"stage": "record", "type": "RecordError", "message": str(exc)},
                       server_info=None, workload={**workload_rec, "params": {}}, failures=None,
                       client_stop=None, client=None, server_metrics=None)
            write_validated(path, doc)
    except OSError as exc:
        write_error, path = _write_error(run_dir / RUN_JSON, exc), None
    return RunOutcome(path, doc["status"], doc["error"], doc["metrics"], ended.signum, write_error)


def record_config_error(run_dir: Path, config: dict, message: str, run_id: str | None = None) -> Path:
    """run.json for a sweep cell whose config breaks a rule: nothing ran, the reason is kept
    (a config refused for carrying an API key is recorded without it)."""
    from remnant.api_key import redact_inline_keys
    from remnant.records.provenance import sources
    from remnant.records.schema import write_validated

    config = redact_inline_keys(config)
    now = _now()
    workload = config.get("workload") if isinstance(config.get("workload"), dict) else {}
    host = config.get("host") if isinstance(config.get("host"), dict) else {}
    header = RunHeader(
        run_id or _new_run_id(), now, now, 0.0, config, sources(), {"kind": str(host.get("kind") or "unknown")},
        workload_record(str(workload.get("name") or "unknown"),
                        workload["seed"] if isinstance(workload.get("seed"), int) else 0))
    refused = Verdict("failed", {"stage": "config", "type": "ConfigError", "message": message},
                      ["nothing ran: the configuration broke a rule"])
    return write_validated(Path(run_dir) / RUN_JSON, run_document(header, RunFacts(), refused))
