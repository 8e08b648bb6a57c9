"""remnant.run's records of where a run's decode ran."""

from __future__ import annotations

import httpx

from remnant.run import _native_decode_limits, _packed_decode_limits
from tests.conftest import start_server, stop_server


def test_a_gpu_run_on_the_triton_native_kernel_says_so_and_why():
    info = {"device": "cuda", "remnant_native_decode": {
        "kernel": "triton", "reason": "FlashMLA's sparse decode takes 64 or 128 query heads; this model has 8"}}
    (limit,) = _native_decode_limits(info)
    assert limit.startswith("decode over native records (native and triton modes, window-only and HCA layers) ran "
                            "on Remnant's Triton native kernel, not FlashMLA's V4 decode that SGLang runs")
    assert limit.endswith("this model has 8")
    for quiet in ({"device": "cuda", "remnant_native_decode": {"kernel": "flashmla", "reason": None}},
                  {"device": "cpu", "remnant_native_decode": {"kernel": "reference", "reason": "..."}},
                  {}, None):  # FlashMLA ran; the CPU reference; a server that does not say (SGLang)
        assert _native_decode_limits(quiet) == []


def test_a_gpu_run_says_which_kernel_ran_kernel_modes_packed_decode():
    why = "the SM90 Gluon kernel cannot take it: it reads bf16 q, got torch.float32"
    (limit,) = _packed_decode_limits({"device": "cuda", "remnant_packed_decode": {"kernel": "triton", "reason": why}})
    assert limit == ("kernel mode's decode over packed records ran on Remnant's Triton kernel, not the SM90 Gluon "
                     f"kernel: {why}")
    (limit,) = _packed_decode_limits({"device": "cuda", "remnant_packed_decode": {"kernel": "sm90", "reason": None}})
    assert "ran on the SM90 Gluon kernel" in limit
    for quiet in ({"device": "cuda", "remnant_packed_decode": {"kernel": None, "reason": None}},
                  {"device": "cpu", "remnant_packed_decode": {"kernel": "triton", "reason": "..."}}, {}, None):
        assert _packed_decode_limits(quiet) == []


def test_the_server_reports_which_kernel_decodes_native_records(tiny_model_dir, tmp_path, monkeypatch):
    for name, extra, want in (("reference", (), ("reference", "decode steps attend through the torch reference "
                                                                "(decode_path=reference)")),
                              ("kernels", ("--decode-path", "kernels"),
                               ("triton", "FlashMLA runs on CUDA GPUs, not on device=cpu"))):
        (tmp_path / name).mkdir()
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        server = start_server(tiny_model_dir, tmp_path / name, *extra)
        try:
            info = httpx.get(f"{server.base_url}/server_info", timeout=10).json()
        finally:
            stop_server(server)
        native = info["remnant_native_decode"]
        assert info["remnant_packed_decode"] == {"kernel": None, "reason": None}  # native mode: no packed layer
        assert (native["kernel"], native["reason"], native["flashmla_version"]) == (*want, None)


def test_a_pause_of_the_server_short_of_a_stall_is_named_in_limits():
    """SIGSTOP then SIGCONT within the stall timeout: the run completes, and its limits say
    that one request waited that long between two tokens."""
    from remnant.client.metrics import summarize
    from remnant.client.request_record import RequestRecord
    from remnant.run import _pause_limits

    def rec(i: int, times: list[float]) -> RequestRecord:
        return RequestRecord(id=f"m-{i}", phase="measured", index=i, intended_start_s=0.0, start_s=0.0,
                             end_s=times[-1], success=True, ttft_s=times[0], chunk_times_s=times,
                             chunk_tokens=[1] * len(times), prompt_tokens=4, completion_tokens=len(times))

    paused = summarize([rec(0, [0.1, 0.2, 120.2, 120.3]), rec(1, [0.1, 0.2, 0.3])])
    (limit,) = _pause_limits(paused)
    assert limit.startswith("a request waited 120.0s between two tokens (itl_ms.max)")
    assert _pause_limits(summarize([rec(0, [0.1, 0.2, 0.3])])) == []


def test_set_aside_never_overwrites_an_earlier_attempt(tmp_path):
    from remnant.run import leftovers, set_aside

    for attempt in ("first", "second"):
        (tmp_path / "requests.jsonl").write_text(attempt)
        (tmp_path / ".hydra").mkdir()
        (tmp_path / "server.port").write_text("1")
        assert sorted(leftovers(tmp_path)) == [".hydra", "requests.jsonl", "server.port"]
        moved = set_aside(tmp_path, "killed")
        assert {p.name.split(".killed-")[0] for p in moved} == {"requests", ".hydra"}
        assert leftovers(tmp_path) == []
    kept = sorted(p.read_text() for p in tmp_path.glob("requests.killed-*.jsonl"))
    assert kept == ["first", "second"]
