"""One run: serve, drive, measure, record (docs/architecture.md).

`execute_run` takes a validated RunConfig and a run directory, and leaves a schema-valid
run.json there whatever happens: completed, degraded (more measured requests failed than
workload.max_failed_share allows), failed (with the stage and reason: a stalled server,
the deadline, a full disk, ...), or interrupted (Ctrl-C / SIGTERM). requests.jsonl and
server.log sit beside it. Where run.json itself cannot be written (a full or read-only
disk), the outcome says so instead.

The run directory, and what becomes of an earlier attempt's files there, is
remnant.run_dir's.
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
from remnant.kv.modes import mode_of
from remnant.records.kinds import RUN
from remnant.run_dir import CAPTURE_FILE, REQUESTS_JSONL, RUN_JSON, SERVER_LOG, SERVER_METRICS_JSONL, claim
from remnant.signals import describe as describe_signal
from remnant.signals import raise_interrupted, signum_of

log = logging.getLogger(__name__)

#: A gap this long between two tokens of one request (a server that paused, short of a
#: stall) is named in run.json's limits.
PAUSE_NOTE_S = 10.0


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


class _Stage:
    """Names the stage a failure happened in, for run.json's error.stage."""

    def __init__(self) -> None:
        self.name = "setup"


def _now() -> str:
    return datetime.now(timezone.utc).isoformat()


def _new_run_id() -> str:
    return f"{datetime.now(timezone.utc):%Y%m%dT%H%M%SZ}-{uuid.uuid4().hex[:6]}"


def _base_limits(cfg: RunConfig) -> list[str]:
    limits = ["a single run: its variance is not measured (sweep seed=0,1,2 and remnant-report for a confidence interval)"]
    return limits + cfg.host.limits() + cfg.workload.limits() + list(cfg.model.limits) + list(cfg.limits)


def _native_decode_limits(server_info: dict | None) -> list[str]:
    """The embedded engine on a GPU says which kernel decoded native records: a run whose
    native attention was not FlashMLA's (SGLang's stock decode) must say so, in the words of
    remnant.kernels.decode.served_limits."""
    info = server_info or {}
    if info.get("device") != "cuda" or not info.get("remnant_native_decode"):
        return []
    from remnant.kernels.decode import served_limits  # imports torch: only for a GPU server's record

    return served_limits(False, info["remnant_native_decode"])


def _packed_decode_limits(server_info: dict | None) -> list[str]:
    """The embedded engine on a GPU says which kernel kernel mode's packed decode ran on: the
    SM90 Gluon kernel, or the Triton kernel and why not the SM90 one (benchmarks measure
    them apart: benchmarks/kernels/NOTES.md)."""
    info = server_info or {}
    if info.get("device") != "cuda" or not info.get("remnant_packed_decode"):
        return []
    from remnant.kernels.decode import served_limits  # imports torch: only for a GPU server's record

    return served_limits(True, info["remnant_packed_decode"])


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


def _pause_limits(metrics: dict) -> list[str]:
    """A pause of the server shorter than a stall still shapes the latencies: say so."""
    longest = (metrics.get("itl_ms") or {}).get("max")
    if longest is None or longest < PAUSE_NOTE_S * 1000:
        return []
    return [f"a request waited {longest / 1000:.1f}s between two tokens (itl_ms.max): the server paused "
            "(short of workload.stall_timeout_s); TPOT, ITL and E2E include the pause"]


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


def run_document(*, run_id: str, status: str, error: dict | None, started_at: str, ended_at: str,
                 duration_s: float, config: dict, sources: dict, host: dict, workload: dict, limits: list[str],
                 environment: dict | None = None, server_info: dict | None = None, phases: list | None = None,
                 metrics: dict | None = None, failures: dict | None = None, client_stop: dict | None = None,
                 client: dict | None = None, artifacts: list | None = None, capture: dict | None = None,
                 retention_map: dict | None = None, server_metrics: dict | None = None) -> dict:
    """run.json (remnant.records.kinds.RUN): every run writes this document,
    one that ran and one whose config broke a rule alike. phases: dicts, as recorded;
    client: remnant.client.metrics.client_summary of the measured phase, None where none ran;
    capture: capture_record of a capture run; retention_map: retention_map_record of the
    map a packed run served with; server_metrics: the summary of the server's /metrics
    scraped while the client drove it (remnant.client.server_metrics), None where none was."""
    return {
        **RUN.header(),
        "run_id": run_id,
        "status": status,
        "error": error,
        "started_at": started_at,
        "ended_at": ended_at,
        "duration_s": duration_s,
        "config": config,
        "sources": sources,
        "host": host,
        "environment": environment,
        "server_info": server_info,
        "workload": workload,
        "phases": phases or [],
        "metrics": metrics,
        "failures": failures,
        "client_stop": client_stop,
        "client": client,
        "artifacts": artifacts or [],
        "capture": capture,
        "retention_map": retention_map,
        "server_metrics": server_metrics,
        "limits": limits,
    }


def capture_settings(cfg: RunConfig, run_dir: Path):
    """The CaptureSettings a capture run gives its server (None for an ordinary run)."""
    if cfg.capture is None:
        return None
    from remnant.kv.capture_recorder import CaptureSettings

    return CaptureSettings(path=str((Path(run_dir) / CAPTURE_FILE).resolve()), tokens=cfg.capture.tokens,
                           records=cfg.capture.records, source=cfg.capture.source or cfg.workload.name,
                           model_id=cfg.model.path or cfg.model.name)


def ask_capture_write(base_url: str, settings, api_key: str | None = None) -> None:
    """Ask the server to write its capture now, short of the budget if need be: the marker
    file beside the capture, then /flush_cache (remnant.kv.capture_recorder.write_requested).
    SGLang stops its schedulers with SIGKILL, so nothing could write it after the run."""
    import httpx

    from remnant.api_key import bearer
    from remnant.kv.capture_recorder import write_request

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
    from remnant.kv.captures import load_captures

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
    from remnant.kv.retention import RetentionMap
    from remnant.records.provenance import sha256_file

    rmap = RetentionMap.load(cfg.retention.map_path)
    return {"path": str(Path(cfg.retention.map_path).resolve()), "sha256": sha256_file(cfg.retention.map_path),
            "model_id": rmap.model_id, "policy": {"name": rmap.policy, "params": dict(rmap.policy_params)},
            "calibration": dict(rmap.calibration)}


def execute_run(cfg: RunConfig, run_dir: Path, run_id: str | None = None, progress: bool | None = None) -> RunOutcome:
    """Run `cfg` with its files in `run_dir`; returns where run.json is and how it ended.

    Files an earlier attempt left without a run.json (a killed run) are set aside first.
    A signal raised while run.json is being written waits until it is written.
    """
    from remnant.api_key import redact, redact_file
    from remnant.client.metrics import client_summary, failure_summary, per_turn, saturation_limits, summarize
    from remnant.client.oversaturation import stop_limit
    from remnant.client.runner import ClientStopped, LoadClient
    from remnant.hosts import HostError, ServerSpec, make_host
    from remnant.hosts.base import signals_deferred
    from remnant.records.provenance import artifact, sources
    from remnant.records.schema import RecordError, write_validated
    from remnant.workloads import plan_workload
    from remnant.workloads.dataset_file import skipped_records

    run_dir = Path(run_dir)
    reserve = claim(run_dir)
    run_id = run_id or _new_run_id()
    requests_path = run_dir / REQUESTS_JSONL
    started_at, t_start = _now(), time.monotonic()
    stage = _Stage()
    status, error, signum = "completed", None, None
    host = None
    server_info = environment = metrics = failures = client_stop = client_record = None
    scraper = server_metrics = None  # the client's scraper of the server's /metrics, its summary
    phases: list = []
    limits = _base_limits(cfg)
    plan = None
    capture = capture_settings(cfg, run_dir)
    capture_rec = map_rec = None
    api_key = None  # known from the serve stage on: scrubbed from every record
    previous = signal.signal(signal.SIGTERM, _sigterm_as_interrupt)
    try:
        stage.name = "workload"
        plan = plan_workload(cfg.workload, cfg.model)
        limits += skipped_records(plan.dataset)  # and says so, once, on the log
        reuse = plan.params.get("reuse_factor")
        if reuse and reuse > 1:
            limits.append(f"the dataset's usable conversations were reused {reuse:.2f}x: repeated prompts hit "
                          "the prefix cache")
        map_rec = retention_map_record(cfg)
        stage.name = "serve"
        api_key = cfg.host.api_key()
        host = make_host(cfg.host)
        retention = cfg.retention if mode_of(cfg.mode.name).keeps_retention else None
        spec = ServerSpec(cfg.mode.name, retention, cfg.model, run_dir, run_dir / SERVER_LOG,
                          run_id=run_id, capture=capture, api_key=api_key)
        with host.serve(spec) as endpoint:
            environment = endpoint.environment
            server_info = endpoint.server_info
            limits += _check_served_mode(cfg.mode.name, server_info, endpoint.base_url,
                                         started_here=cfg.host.starts_server())
            limits += _native_decode_limits(server_info) + _packed_decode_limits(server_info)
            if cfg.workload.needs_server_info():
                stage.name = "workload"
                plan = plan_workload(cfg.workload, cfg.model, server_info)
            stage.name = "client"
            client = LoadClient(
                endpoint.base_url, requests_path,
                request_timeout_s=cfg.workload.request_timeout_s,
                flush_timeout_s=cfg.workload.flush_timeout_s,
                server_failure=endpoint.failure, progress=progress,
                stall_timeout_s=cfg.workload.stall_timeout_s,
                deadline_s=cfg.workload.deadline_s,
                api_key=api_key,
                server_metrics_interval_s=cfg.workload.server_metrics_interval_s,
                server_metrics_path=run_dir / SERVER_METRICS_JSONL,
                oversaturation=cfg.workload.oversaturation,
            )
            scraper = client.scraper  # started and stopped by client.run
            results = client.run(plan.phases, on_phase_end=lambda r: phases.append(r))
            if capture is not None:
                stage.name = "capture"
                ask_capture_write(endpoint.base_url, capture, api_key)
        stage.name = "metrics"
        measured = next(r for r in results if r.name == "measured")
        metrics = summarize(measured.records, duration_s=measured.duration_s)
        if any(r.turn is not None for r in measured.records):
            metrics["per_turn"] = per_turn(measured.records)
        limits += _pause_limits(metrics)
        w = cfg.workload
        client_record = client_summary(measured.records, measured.duration_s, measured.loop_cpu_s,
                                       measured.process_cpu_s, w.request_rate, w.arrival, w.saturation_cpu_share,
                                       w.saturation_dispatch_p99_ms)
        limits += saturation_limits(client_record)
        for r in results:
            if r.flush is not None and not r.flush.ok:
                limits.append(f"prefix cache flush before {r.name} failed: {r.flush.message}")
        failures = failure_summary(measured.records, cfg.workload.max_failed_share)
        if capture is not None:
            # The server is stopped: a capture short of its budget was written as it stopped.
            stage.name = "capture"
            capture_rec, capture_limits = capture_record(capture, run_dir)
            limits += capture_limits
        if metrics["failed"]:
            limits.append(f"{metrics['failed']} measured requests failed; metrics cover the {metrics['completed']} that completed")
        if metrics["completed"] == 0:
            first = f"; first error: {failures['errors'][0]['message']}" if failures and failures["errors"] else ""
            status, error = "failed", {"stage": "client", "type": "NoCompletedRequests",
                                       "message": f"no measured request completed{first}; see requests.jsonl"}
        elif failures and failures["share"] > failures["max_share"]:
            status = "degraded"
            error = {"stage": "client", "type": "FailedRequests",
                     "message": f"{failures['failed']} of {failures['measured']} measured requests failed "
                                f"({failures['share']:.0%}, more than workload.max_failed_share="
                                f"{failures['max_share']:g}); first error: {failures['errors'][0]['message']}"}
    except ClientStopped as exc:
        status = "failed"
        client_stop = exc.stop
        error = {"stage": "client", "type": exc.stop["reason"].capitalize(), "message": str(exc)}
        limits += stop_limit(exc.stop)
        if exc.phase is not None:
            phases.append(exc.phase)
            if exc.phase.name == "measured":
                failures = failure_summary(exc.phase.records, cfg.workload.max_failed_share)
    except KeyboardInterrupt as exc:
        status = "interrupted"
        signum = signum_of(exc)
        error = {"stage": stage.name, "type": "KeyboardInterrupt", "message": f"interrupted by {describe_signal(signum)}"}
    except (HostError, ValueError, OSError, RuntimeError) as exc:
        status = "failed"
        error = {"stage": stage.name, "type": type(exc).__name__, "message": str(exc)}
    except Exception as exc:  # noqa: BLE001 - a bug still leaves a run.json behind
        log.exception("run failed unexpectedly at %s", stage.name)
        status = "failed"
        error = {"stage": stage.name, "type": type(exc).__name__, "message": f"unexpected error: {exc!r}"}
    finally:
        signal.signal(signal.SIGTERM, previous)
    if scraper is not None:
        server_metrics, scrape_limits = scraper.record(phases)
        limits += scrape_limits

    # A second signal waits for run.json: what the run did is written before it stops.
    with signals_deferred():
        if reserve is not None:
            reserve.unlink(missing_ok=True)  # room for run.json, on a disk that may be full
        for text_record in (requests_path, run_dir / SERVER_LOG):
            # Before hashing: SGLang logs its ServerArgs, key included.
            redact_file(text_record, api_key)
        known = {CAPTURE_FILE: capture_rec["fingerprint"]} if capture_rec else {}  # hashed when it was read
        artifacts = [artifact(p, run_dir, known.get(p.name))
                     for p in (requests_path, run_dir / SERVER_METRICS_JSONL, run_dir / SERVER_LOG,
                               run_dir / CAPTURE_FILE) if p.is_file()]
        host_info = host.describe() if host is not None else {"kind": cfg.host.kind}
        # A container host knows the image that ran and the SGLang inside it; sources() cannot.
        run_sources = {**sources(), "image_digest": host_info.get("image_id")}
        if "sglang_version" in host_info:
            run_sources["sglang_version"] = host_info["sglang_version"]
        workload_rec = workload_record(cfg.workload.name, cfg.workload.seed, plan)
        doc = run_document(
            run_id=run_id, status=status, error=error, started_at=started_at, ended_at=_now(),
            duration_s=time.monotonic() - t_start, config=recorded_config(cfg), sources=run_sources,
            host=host_info, environment=environment, server_info=server_info, workload=workload_rec,
            phases=[p.to_dict() for p in phases], metrics=metrics if status in ("completed", "degraded") else None,
            failures=failures, client_stop=client_stop, artifacts=artifacts, limits=limits,
            client=client_record if status in ("completed", "degraded") else None,
            capture=capture_rec, retention_map=map_rec, server_metrics=server_metrics,
        )
        doc = redact(doc, api_key)  # SGLang's /server_info holds its ServerArgs, key included
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
    return RunOutcome(path, doc["status"], doc["error"], doc["metrics"], signum, write_error)


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
    doc = run_document(
        run_id=run_id or _new_run_id(), status="failed",
        error={"stage": "config", "type": "ConfigError", "message": message},
        started_at=now, ended_at=now, duration_s=0.0, config=config, sources=sources(),
        host={"kind": str(host.get("kind") or "unknown")},
        workload=workload_record(str(workload.get("name") or "unknown"),
                                 workload["seed"] if isinstance(workload.get("seed"), int) else 0),
        limits=["nothing ran: the configuration broke a rule"],
    )
    return write_validated(Path(run_dir) / RUN_JSON, doc)
