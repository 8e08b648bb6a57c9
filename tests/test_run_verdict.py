"""remnant.run_verdict: a run's status, error and limits from its facts, built here by hand
with no server."""

from __future__ import annotations

import json
import signal
from importlib import resources
from pathlib import Path


from remnant.client.metrics import client_summary, failure_summary, summarize
from remnant.client.request_record import RequestRecord
from remnant.client.runner import ClientStopped, FlushResult, PhaseResult
from remnant.config import ModelConfig, RunConfig
from remnant.hosts.base import HostError
from remnant.hosts.embedded import EmbeddedHostConfig
from remnant.hosts.external import ExternalHostConfig
from remnant.run_verdict import (RunFacts, base_limits, native_decode_limits, packed_decode_limits, pause_limits,
                                 served_mode_error, verdict)
from remnant.signals import Interrupted
from remnant.workloads.random import RandomWorkloadConfig

EXTERNAL = "http://127.0.0.1:1"


def _cfg(host=None, max_failed_share: float = 0.1) -> RunConfig:
    cfg = RunConfig(workload=RandomWorkloadConfig(input_len=16, max_failed_share=max_failed_share),
                    host=host or EmbeddedHostConfig(), model=ModelConfig())
    cfg.workload.validate()
    return cfg


def _rec(i: int, ok: bool = True, times=(0.1, 0.2, 0.3)) -> RequestRecord:
    if not ok:
        return RequestRecord(id=f"m-{i}", phase="measured", index=i, intended_start_s=0.0, start_s=0.0, end_s=0.5,
                             error="HTTP 500: boom")
    return RequestRecord(id=f"m-{i}", phase="measured", index=i, intended_start_s=0.0, start_s=0.0,
                         end_s=times[-1], success=True, ttft_s=times[0], chunk_times_s=list(times),
                         chunk_tokens=[1] * len(times), prompt_tokens=4, completion_tokens=len(times))


def _measured(cfg: RunConfig, records: list[RequestRecord], flush: FlushResult | None = None,
              **more) -> RunFacts:
    """Facts of a run whose client ran through and measured `records`, on a server that
    answered without a word about itself."""
    phase = PhaseResult("measured", flush, 0.0, 1.0, len(records), sum(not r.success for r in records), records)
    w = cfg.workload
    return RunFacts(stage="metrics", served=True, results=[phase], phases=[phase],
                    metrics=summarize(records, duration_s=1.0),
                    client=client_summary(records, 1.0, 0.1, 0.1, None, "closed", 0.9, 1000.0),
                    failures=failure_summary(records, w.max_failed_share), **more)


def _oversaturated_stop() -> dict:
    example = Path(str(resources.files("remnant.schemas"))) / "run/examples/valid/v5-failed-oversaturated.json"
    return json.loads(example.read_text())["client_stop"]


def test_a_gpu_run_on_the_triton_native_kernel_says_so_and_why():
    info = {"device": "cuda", "remnant_native_decode": {
        "kernel": "triton", "reason": "FlashMLA's sparse decode takes 64 or 128 query heads; this model has 8"}}
    (limit,) = native_decode_limits(info)
    assert limit.startswith("decode over native records (native and triton modes, window-only and HCA layers) ran "
                            "on Remnant's Triton native kernel, not FlashMLA's V4 decode that SGLang runs")
    assert limit.endswith("this model has 8")
    for quiet in ({"device": "cuda", "remnant_native_decode": {"kernel": "flashmla", "reason": None}},
                  {"device": "cpu", "remnant_native_decode": {"kernel": "reference", "reason": "..."}},
                  {}, None):  # FlashMLA ran; the CPU reference; a server that does not say (SGLang)
        assert native_decode_limits(quiet) == []


def test_a_gpu_run_says_which_kernel_ran_kernel_modes_packed_decode():
    why = "the SM90 Gluon kernel cannot take it: it reads bf16 q, got torch.float32"
    (limit,) = packed_decode_limits({"device": "cuda", "remnant_packed_decode": {"kernel": "triton", "reason": why}})
    assert limit == ("kernel mode's decode over packed records ran on Remnant's Triton kernel, not the SM90 Gluon "
                     f"kernel: {why}")
    (limit,) = packed_decode_limits({"device": "cuda", "remnant_packed_decode": {"kernel": "sm90", "reason": None}})
    assert "ran on the SM90 Gluon kernel" in limit
    for quiet in ({"device": "cuda", "remnant_packed_decode": {"kernel": None, "reason": None}},
                  {"device": "cpu", "remnant_packed_decode": {"kernel": "triton", "reason": "..."}}, {}, None):
        assert packed_decode_limits(quiet) == []


def test_a_pause_of_the_server_short_of_a_stall_is_named_in_limits():
    """SIGSTOP then SIGCONT within the stall timeout: the run completes, and its limits say
    that one request waited that long between two tokens."""
    from remnant.client.metrics import summarize
    from remnant.client.request_record import RequestRecord

    def rec(i: int, times: list[float]) -> RequestRecord:
        return RequestRecord(id=f"m-{i}", phase="measured", index=i, intended_start_s=0.0, start_s=0.0,
                             end_s=times[-1], success=True, ttft_s=times[0], chunk_times_s=times,
                             chunk_tokens=[1] * len(times), prompt_tokens=4, completion_tokens=len(times))

    paused = summarize([rec(0, [0.1, 0.2, 120.2, 120.3]), rec(1, [0.1, 0.2, 0.3])])
    (limit,) = pause_limits(paused)
    assert limit.startswith("a request waited 120.0s between two tokens (itl_ms.max)")
    assert pause_limits(summarize([rec(0, [0.1, 0.2, 0.3])])) == []


def test_a_run_that_got_through_completed_with_only_its_configs_caveats():
    cfg = _cfg()
    ended = verdict(cfg, _measured(cfg, [_rec(i) for i in range(4)]))
    assert (ended.status, ended.error, ended.client_stop, ended.signum) == ("completed", None, None, None)
    assert ended.measured and ended.limits == base_limits(cfg)


def test_failed_requests_above_the_share_allowed_degrade_the_run():
    cfg = _cfg(max_failed_share=0.2)
    ended = verdict(cfg, _measured(cfg, [_rec(0), _rec(1), _rec(2, ok=False)]))
    assert ended.status == "degraded" and ended.measured
    assert ended.error == {"stage": "client", "type": "FailedRequests",
                           "message": "1 of 3 measured requests failed (33%, more than workload.max_failed_share=0.2); "
                                      "first error: HTTP 500: boom"}
    assert ended.limits[-1] == "1 measured requests failed; metrics cover the 2 that completed"
    # At or below the share the run completed, and still says what failed.
    below = verdict(_cfg(max_failed_share=0.5), _measured(_cfg(max_failed_share=0.5), [_rec(0), _rec(1, ok=False)]))
    assert below.status == "completed" and below.limits[-1].startswith("1 measured requests failed")


def test_a_run_with_no_completed_request_failed_at_the_client():
    cfg = _cfg()
    ended = verdict(cfg, _measured(cfg, [_rec(0, ok=False), _rec(1, ok=False)]))
    assert (ended.status, ended.measured) == ("failed", False)
    assert ended.error == {"stage": "client", "type": "NoCompletedRequests",
                           "message": "no measured request completed; first error: HTTP 500: boom; see requests.jsonl"}


def test_a_stopped_client_fails_the_run_and_says_why():
    cfg = _cfg()
    stop = _oversaturated_stop()
    ended = verdict(cfg, RunFacts(stage="client", served=True, ended_by=ClientStopped(stop, None),
                                  scrape_limits=["the scrape's caveat"]))
    assert (ended.status, ended.client_stop, ended.measured) == ("failed", stop, False)
    assert ended.error["stage"] == "client" and ended.error["type"] == "Oversaturated"
    assert ended.error["message"].startswith("the server was over-saturated in the measured phase")
    assert ended.limits[-2].startswith("the run was stopped early at") and "over-saturated" in ended.limits[-2]
    assert ended.limits[-1] == "the scrape's caveat"  # the scrape's caveats come last


def test_a_signal_interrupts_the_run_at_its_stage():
    ended = verdict(_cfg(), RunFacts(stage="serve", ended_by=Interrupted(signal.SIGTERM)))
    assert (ended.status, ended.signum) == ("interrupted", signal.SIGTERM)
    assert ended.error == {"stage": "serve", "type": "KeyboardInterrupt",
                           "message": "interrupted by SIGTERM (signal 15)"}
    assert verdict(_cfg(), RunFacts(stage="client", ended_by=KeyboardInterrupt())).signum == signal.SIGINT


def test_an_error_fails_the_run_at_its_stage_and_a_bug_says_it_is_one():
    ended = verdict(_cfg(), RunFacts(stage="workload", ended_by=ValueError("workload.dataset_path=x: no such file")))
    assert ended.error == {"stage": "workload", "type": "ValueError",
                           "message": "workload.dataset_path=x: no such file"}
    ended = verdict(_cfg(), RunFacts(stage="metrics", ended_by=KeyError("measured")))
    assert ended.status == "failed"
    assert ended.error == {"stage": "metrics", "type": "KeyError", "message": "unexpected error: KeyError('measured')"}


def test_an_external_server_in_another_mode_is_refused_and_one_that_does_not_say_is_named():
    external = _cfg(ExternalHostConfig(base_url=EXTERNAL))
    assert served_mode_error("native", {"remnant_mode": "native"}, EXTERNAL) is None
    assert served_mode_error("native", {}, EXTERNAL) is None
    why = served_mode_error("kernel", {"remnant_mode": "native"}, EXTERNAL)
    assert why == (f"mode=kernel, but the server at {EXTERNAL} reports remnant_mode='native': give mode=native or "
                   "drive a server started in kernel mode")
    (silent,) = [limit for limit in verdict(external, RunFacts(served=True, server_info={}, ended_by=HostError("x"))
                                            ).limits if "did not report its mode" in limit]
    assert silent.endswith(f"mode={external.mode.name} is as configured, not checked")
    # A server this run started has the run's mode: nothing to say.
    started = verdict(_cfg(), RunFacts(served=True, ended_by=HostError("x"))).limits
    assert not any("did not report its mode" in limit for limit in started)


def test_a_server_in_another_mode_does_not_lend_the_run_its_kernels():
    gpu = {"device": "cuda", "remnant_native_decode": {"kernel": "triton", "reason": "heads"}}
    cfg = _cfg(ExternalHostConfig(base_url=EXTERNAL))
    mine = verdict(cfg, RunFacts(served=True, server_info={**gpu, "remnant_mode": cfg.mode.name},
                                 ended_by=HostError("x")))
    assert native_decode_limits(gpu)[0] in mine.limits
    other = "kernel" if cfg.mode.name != "kernel" else "native"
    theirs = verdict(cfg, RunFacts(served=True, server_info={**gpu, "remnant_mode": other}, ended_by=HostError("x")))
    assert native_decode_limits(gpu)[0] not in theirs.limits


def test_limits_come_in_the_order_the_run_found_them():
    cfg = _cfg(ExternalHostConfig(base_url=EXTERNAL))
    gpu = {"device": "cuda", "remnant_native_decode": {"kernel": "triton", "reason": "heads"}}
    flush = FlushResult(ok=False, status_code=500, attempts=3, elapsed_s=1.0, message="HTTP 500")
    paused = [_rec(0, times=(0.1, 0.2, 30.2)), _rec(1, ok=False), _rec(2), _rec(3), _rec(4), _rec(5), _rec(6),
              _rec(7), _rec(8), _rec(9), _rec(10)]
    facts = _measured(cfg, paused, flush, plan_limits=["the plan's caveat"], capture_limits=["the capture's caveat"],
                      scrape_limits=["the scrape's caveat"])
    facts.server_info = gpu
    facts.client = {**facts.client, "loop_cpu_share": 0.95}
    ended = verdict(cfg, facts)
    assert ended.status == "completed"
    rest = ended.limits[len(base_limits(cfg)):]
    assert [limit[:24] for limit in rest] == [limit[:24] for limit in [
        "the plan's caveat",
        "the external server did not report its mode",
        native_decode_limits(gpu)[0],
        *pause_limits(facts.metrics),
        "the load client was saturated",
        "prefix cache flush before measured failed: HTTP 500",
        "the capture's caveat",
        "1 measured requests failed",
        "the scrape's caveat",
    ]]
    assert ended.limits[:len(base_limits(cfg))] == base_limits(cfg)
