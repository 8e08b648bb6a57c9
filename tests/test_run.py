"""remnant.run's records of where a run's decode ran."""

from __future__ import annotations

import httpx

from remnant.run import _native_decode_limits
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


def test_the_server_reports_which_kernel_decodes_native_records(tiny_model_dir, tmp_path, monkeypatch):
    for name, extra, want in (("reference", (), ("reference", "decode steps attend through the torch reference "
                                                                "(decode_path=reference)")),
                              ("kernels", ("--decode-path", "kernels"),
                               ("triton", "FlashMLA runs on CUDA GPUs, not on device=cpu"))):
        (tmp_path / name).mkdir()
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        server = start_server(tiny_model_dir, tmp_path / name, *extra)
        try:
            native = httpx.get(f"{server.base_url}/server_info", timeout=10).json()["remnant_native_decode"]
        finally:
            stop_server(server)
        assert (native["kernel"], native["reason"], native["flashmla_version"]) == (*want, None)
