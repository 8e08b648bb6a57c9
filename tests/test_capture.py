"""Capture -> build_map -> packed run, on the embedded engine: the capture a native server
records, the map built from it, and the run that serves with that map, each carrying the
capture's fingerprint on."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from remnant.calibration.capture_recorder import CaptureRecorder, CaptureSettings
from remnant.calibration.captures import load_captures
from remnant.config import ModelConfig
from remnant.engine.model import Model, ModelArgs
from remnant.engine.pools import new_sequence, scratch_pools
from remnant.kv.codec import dequantize, quantize
from remnant.records.provenance import sha256_file

BIN = Path(sys.executable).parent


def _cli(name: str, *args: str, cwd: Path, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / name), *args], cwd=cwd, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_capture_then_build_map_then_a_packed_run_with_it(tmp_path):
    cap_dir = tmp_path / "capture"
    p = _cli("remnant-capture", "workload=smoke", "capture.tokens=8", "capture.records=16",
             f"hydra.run.dir={cap_dir}", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    doc = json.loads((cap_dir / "run.json").read_text())
    assert doc["status"] == "completed" and doc["schema_version"] == 5
    cap = doc["capture"]
    path = cap_dir / "capture.safetensors"
    assert cap["path"] == "capture.safetensors" and cap["fingerprint"] == sha256_file(path)
    assert (cap["layers"], cap["heads"], cap["queries"], cap["latents"], cap["complete"]) == ([1, 3], 8, 8, 16, True)
    assert cap["source"] == "smoke" and cap["model_id"] == "tiny"
    assert "capture.safetensors" in {a["path"] for a in doc["artifacts"]}
    assert any(line.startswith("a capture run:") for line in doc["limits"])
    captures = load_captures(path)
    assert captures.fingerprint == cap["fingerprint"] and captures.params["server"] == "remnant-serve"
    assert {i: (tuple(c.q.shape), tuple(c.k.shape)) for i, c in captures.layers.items()} == {
        1: ((8, 8, 512), (16, 512)), 3: ((8, 8, 512), (16, 512))}

    map_path = tmp_path / "map.json"
    b = subprocess.run([sys.executable, "-m", "remnant.cli.build_map", "--captures", str(path), "--policy", "attention",
                        "--retention", "256", "--out", str(map_path)], capture_output=True, text=True, timeout=120)
    assert b.returncode == 0, b.stderr
    assert json.loads(map_path.read_text())["calibration"]["fingerprint"] == cap["fingerprint"]

    run_dir = tmp_path / "packed"
    r = _cli("remnant-run", "mode=kernel", f"retention.map_path={map_path}", "workload=smoke",
             f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    run = json.loads((run_dir / "run.json").read_text())
    assert run["capture"] is None
    used = run["retention_map"]
    assert used["sha256"] == sha256_file(map_path) and used["policy"]["name"] == "attention"
    assert used["calibration"]["fingerprint"] == cap["fingerprint"]
    assert run["server_info"]["remnant_retention"]["calibration"]["fingerprint"] == cap["fingerprint"]
    check = _cli("remnant-check", str(cap_dir / "run.json"), str(run_dir / "run.json"), str(map_path), cwd=tmp_path)
    assert check.returncode == 0, check.stdout + check.stderr


@pytest.mark.slow
def test_a_capture_short_of_its_budget_is_written_when_the_run_ends(tmp_path):
    """The run asks for the write before it stops the server (SGLang's schedulers die by
    SIGKILL): server.log shows it came at that request, not at shutdown."""
    p = _cli("remnant-capture", "workload=smoke", "capture.tokens=1000", "capture.source=tiny-smoke",
             f"hydra.run.dir={tmp_path}/run", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    doc = json.loads((tmp_path / "run" / "run.json").read_text())
    cap = doc["capture"]
    assert not cap["complete"] and cap["queries"] < 1000 and cap["source"] == "tiny-smoke"
    assert any("stopped short of its budget" in line for line in doc["limits"])
    assert load_captures(tmp_path / "run" / cap["path"]).params["complete"] is False
    log = (tmp_path / "run" / "server.log").read_text()
    assert log.rindex("flush_cache done") < log.index("remnant capture: wrote") < log.index("application shutdown")
    assert not (tmp_path / "run" / "capture.safetensors.write-now").exists()


@pytest.mark.parametrize("args, message", [
    (("mode=kernel",), "capture=on needs mode=native, got mode=kernel"),
    (("host=external", "host.base_url=http://127.0.0.1:9"),
     "capture=on is not possible on host=external: Remnant does not start that server"),
    (("host=modal",), "capture=on is not possible on host=modal: the capture file would be written inside"),
    (("capture.records=0",), "capture.records=0 must be an integer >= 1"),
])
def test_a_capture_that_cannot_run_is_one_line(tmp_path, args, message):
    p = _cli("remnant-capture", "workload=smoke", *args, f"hydra.run.dir={tmp_path}/run", cwd=tmp_path, timeout=60)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert p.stderr.strip().splitlines()[-1].startswith(f"remnant-run: error: {message}")


def _model() -> Model:
    return Model(ModelArgs.from_hf_config(dataclasses.asdict(ModelConfig())))


def _serve(m: Model, prompt: list[int], steps: int) -> list[torch.Tensor]:
    pools = scratch_pools(m, 512, 1)
    seq = new_sequence(pools, 512)
    out = [m.forward([seq], [prompt], pools)]
    for _ in range(steps):
        out.append(m.forward([seq], [[int(out[-1].argmax())]], pools))
    return out


def test_recording_changes_nothing_the_model_computes_and_keeps_what_attention_saw(tmp_path):
    prompt = torch.randint(0, 256, (70,), generator=torch.Generator().manual_seed(3)).tolist()
    plain = _serve(_model(), prompt, 6)
    m = _model()
    rec = CaptureRecorder(CaptureSettings(str(tmp_path / "c.safetensors"), tokens=4, records=100), layers=m.csa_layers)
    m.recorder = rec
    recorded = _serve(m, prompt, 6)
    for a, b in zip(plain, recorded):
        assert torch.equal(a, b)
    assert rec.counts() == {1: (4, 19), 3: (4, 19)}  # 4 of 6 decode steps; 70 + 6 tokens close 19 records
    caps = load_captures(rec.close())
    # The latents are what the native path quantized: the stored records are their FP8 codes.
    pools = scratch_pools(m, 512, 1)
    seq = new_sequence(pools, 512)
    m.recorder = None
    m.forward([seq], [prompt], pools)
    stored = pools.c4[1].read(seq.page_tensor(), torch.arange(17))
    assert torch.equal(quantize(caps.layers[1].k[:17]), stored)
    assert torch.allclose(dequantize(stored), caps.layers[1].k[:17], rtol=0.07, atol=1e-3)


def test_remnant_serve_refuses_a_capture_outside_native_mode(tiny_model_dir, tmp_path):
    p = subprocess.run([sys.executable, "-m", "remnant.cli.serve", "--model-dir", str(tiny_model_dir),
                        "--port", "0", "--mode", "kernel", "--retention-policy", "prefix",
                        "--capture", str(tmp_path / "c.safetensors")],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert p.stderr.strip().splitlines()[-1] == ("remnant-serve: error: --capture needs --mode native, got kernel: "
                                                 "a capture records the native model's latents")
