"""Capacity report command, and the engine's own capacity against the analytic formula."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

from remnant.engine.capacity_report import load_model_preset, report
from remnant.records.schema import validate
from tests.conftest import start_server, stop_server


def test_v4_flash_report():
    doc = report(load_model_preset("dsv4_flash_attn"), 40 << 30, [4096, 32768, 131072], [256],
                 max_running_requests=256)
    validate(doc)
    assert doc["model"]["csa_layers"] == 21 and doc["model"]["hca_layers"] == 20
    assert doc["formula"]["capacity_ratio"] == pytest.approx(1.2113, abs=5e-5)
    assert doc["token_ratio"] == pytest.approx(doc["formula"]["capacity_ratio"], rel=0.01)
    by_len = {r["request_tokens"]: r for r in doc["lengths"]}
    assert by_len[131072]["native"]["bound_by"] == "full_tokens"
    assert by_len[131072]["packed"]["requests"] > by_len[131072]["native"]["requests"]
    # Every standard combination at R = 256: the figures docs/kv.md states.
    combos = {c["name"]: c for c in doc["combinations"]}
    assert list(combos) == ["native", "c4", "c4+swa", "c4+swa+c128", "c4+swa+c128+mxfp4_index",
                            "c4+swa+c128+mxfp4_index+bf16_state", "c4+csa_swa", "c4+csa_swa+bf16_state",
                            "c4+csa_swa+mxfp4_index+bf16_state"]
    assert {n: round(c["capacity_ratio"], 4) for n, c in combos.items()} == {
        "native": 1.0, "c4": 1.2113, "c4+swa": 1.4647, "c4+swa+c128": 1.476, "c4+swa+c128+mxfp4_index": 1.5775,
        "c4+swa+c128+mxfp4_index+bf16_state": 1.8291, "c4+csa_swa": 1.3231, "c4+csa_swa+bf16_state": 1.4957,
        "c4+csa_swa+mxfp4_index+bf16_state": 1.6}
    assert all(c["served"] for c in combos.values())  # the engine serves each (they pack the C4 records)
    assert [(c["part_bytes"]["swa_record"], c["part_bytes"]["swa_packed_layers"]) for c in combos.values()] == [
        (584, 0), (584, 0), (328, 43), (328, 43), (328, 43), (328, 43), (328, 21), (328, 21), (328, 21)]
    # The native and c4 combinations are the report's native and packed sides.
    for name, mode in (("native", doc["modes"][0]), ("c4", doc["modes"][1])):
        assert combos[name]["bytes_per_token"] == mode["bytes_per_token"]
        assert combos[name]["max_total_num_tokens"] == mode["max_total_num_tokens"]
    top = combos["c4+swa+c128+mxfp4_index+bf16_state"]
    assert top["part_bytes"] == {"swa_record": 328, "swa_packed_layers": 43, "c4_record": 328, "c128_record": 328, "index_key": 68,
                                 "state_dtype": 2}
    assert top["fixed_bytes"]["c128_state"] * 2 == combos["native"]["fixed_bytes"]["c128_state"]
    assert top["token_ratio"] > top["capacity_ratio"]  # the halved fixed C128 state leaves more for tokens


def test_combination_retention():
    doc = report(load_model_preset("dsv4_flash_attn"), 40 << 30, [4096], [256], combination_retention=128)
    validate(doc)
    assert doc["settings"]["combination_retention"] == 128
    c4_swa = next(c for c in doc["combinations"] if c["name"] == "c4+swa")
    assert c4_swa["part_bytes"]["swa_record"] == 200
    assert c4_swa["bytes_per_token"]["swa"] == pytest.approx(0.1 * 200 * 43)
    assert doc["formula"]["capacity_ratio"] == pytest.approx(1.2113, abs=5e-5)  # the packed side keeps --retention


def test_command_and_errors(tmp_path):
    out = tmp_path / "capacity.json"
    cmd = [sys.executable, "-m", "remnant.cli.capacity_report"]
    p = subprocess.run([*cmd, "--model", "tiny", "--budget-gib", "0.1", "--lengths", "512,4096", "--out", str(out)],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    doc = json.loads(out.read_text())
    validate(doc)
    assert (doc["schema"], doc["schema_version"]) == ("remnant/capacity", 3)
    assert len(doc["combinations"]) == 9 and "c4+swa+c128+mxfp4_index+bf16_state: " in p.stderr
    assert "(not served)" not in p.stderr  # the engine serves every standard combination
    for args, message in ((["--model", "huge"], "--model huge is not a model preset; allowed:"),
                          (["--retention", "100"], "retention=100 is not allowed"),
                          (["--combination-retention", "100"], "retention=100 is not allowed")):
        p = subprocess.run([*cmd, *args, "--budget-gib", "1", "--out", str(tmp_path / "x.json")],
                           capture_output=True, text=True)
        assert p.returncode == 2 and message in p.stderr and "Traceback" not in p.stderr


@pytest.mark.slow
def test_engine_capacity_matches_the_formula(tiny_model_dir, tmp_path):
    """remnant-serve sizes its pools from the budget: packed/native tokens = the analytic ratio."""
    infos, parts = {}, {}
    for name, mode, state, keys in (("native", "native", "float32", "fp8"), ("kernel", "kernel", "float32", "fp8"),
                                    ("kernel_parts", "kernel", "bfloat16", "mxfp4")):
        (tmp_path / name).mkdir()
        s = start_server(tiny_model_dir, tmp_path / name, "--mode", mode, "--retention", "256",
                         "--kv-budget-mib", "512", "--max-running-requests", "8", "--compressor-state-dtype", state,
                         "--index-key-format", keys)
        try:
            info = httpx.get(f"{s.base_url}/server_info", timeout=10).json()
            infos[name], parts[name] = info["capacity"], (info["compressor_state_dtype"], info["index_key_format"])
            assert info["remnant_overlap_answers"] is False  # on by default, but not on the cpu
            assert info["remnant_launch_ahead"] is False  # on by default, but not on the cpu
        finally:
            stop_server(s)
    assert parts["kernel_parts"] == ("bfloat16", "mxfp4") and parts["native"] == ("float32", "fp8")
    # bf16 state halves the state's bytes a token (and the fixed C128 state), MXFP4 keys
    # take 68 bytes for FP8's 132: more tokens.
    more, kernel = infos["kernel_parts"]["bytes_per_token"], infos["kernel"]["bytes_per_token"]
    for part in ("c4_state", "c4_indexer_state"):
        assert more[part] == kernel[part] / 2
    assert more["c4_indexer"] / kernel["c4_indexer"] == pytest.approx(68 / 132)
    assert infos["kernel_parts"]["max_total_num_tokens"] > infos["kernel"]["max_total_num_tokens"]
    ratio = infos["kernel"]["max_total_num_tokens"] / infos["native"]["max_total_num_tokens"]
    native_bpt = sum(infos["native"]["bytes_per_token"].values())
    packed_bpt = sum(infos["kernel"]["bytes_per_token"].values())
    assert infos["native"]["bytes_per_token"]["c4"] / infos["kernel"]["bytes_per_token"]["c4"] == pytest.approx(584 / 328)
    assert ratio == pytest.approx(native_bpt / packed_bpt, rel=0.01)
    for info in infos.values():
        # What the engine allocated is what was accounted, but for page padding of the
        # split pages (C4, C128 and the SWA pool's window-sized blocks: 128 x 584 bytes padded
        # to 130 x 576, +0.17%).
        alloc, acct = info["allocated_bytes"], info["accounted_bytes"]
        for part in ("c4_indexer", "c4_state", "c4_indexer_state", "c128_state"):
            assert alloc[part] == acct[part], part
        assert acct["c4"] <= alloc["c4"] <= acct["c4"] * 1.01
        assert alloc["swa"] == acct["swa"] // (128 * 584) * 130 * 576
        assert sum(acct.values()) <= 512 << 20
