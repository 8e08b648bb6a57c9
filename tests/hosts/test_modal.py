"""Modal host, checked on a CPU without credentials or network: the app imports, its
functions declare the intended GPUs, timeouts, volumes and image, a run's request
round-trips to what `serve` launches, the budget guard refuses, and the host refuses
clearly when modal is not set up. The test marked `modal` needs an account and bills."""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra

from remnant.cli.run import register_configs, to_run_config
from remnant.config import ModelConfig, RetentionConfig
from remnant.config_errors import ConfigError
from remnant.hosts import ServerSpec
from remnant.hosts.modal import APP_SETTINGS, ModalHostConfig, ServeRequest, app_settings, credentials_problem

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent

app = pytest.importorskip("runners.modal.app", reason="modal is not installed (pip install -e '.[test]')")


def _declared(function) -> dict:
    """What a modal Function was declared with. The SDK keeps gpu, volumes and image in the
    function's private `_spec`, and the timeout only in the closure that creates it on
    Modal (modal 1.6); this helper is the one place that reads those internals."""
    from modal._utils.async_utils import synchronizer

    impl = synchronizer._translate_in(function)
    timeout = inspect.getclosurevars(impl._load).nonlocals["timeout"]
    return {"gpu": impl._spec.gpus, "timeout": timeout,
            "volumes": {path: vol.name for path, vol in impl._spec.volumes.items()},
            "image": impl._spec.image is synchronizer._translate_in(app.image)}


def _no_modal_env(tmp_path: Path) -> dict:
    """An environment where modal finds no credentials: empty config, no MODAL_* tokens."""
    config = tmp_path / "modal.toml"
    config.write_text("")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MODAL_")}
    return {**env, "HOME": str(tmp_path), "MODAL_CONFIG_PATH": str(config)}


def _compose(overrides: list[str]):
    GlobalHydra.instance().clear()
    register_configs()
    with initialize_config_module(config_module="remnant.conf", version_base=None):
        return to_run_config(compose(config_name="config", overrides=overrides))


def _spec(tmp_path: Path, mode: str = "kernel", retention: RetentionConfig | None = None) -> ServerSpec:
    model = ModelConfig(name="dsv4", tp_size=4, server_args=["--trust-remote-code"])
    return ServerSpec(mode, None if mode == "native" else (retention or RetentionConfig()), model,
                      tmp_path / "20260101-run", tmp_path / "server.log")


def test_app_imports_on_a_fresh_machine(tmp_path):
    p = subprocess.run([sys.executable, "-c", "import runners.modal.app as a; print(a.app.name)"],
                       cwd=REPO, env=_no_modal_env(tmp_path), capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "remnant"


def test_modal_cli_reads_the_entrypoints(tmp_path):
    """`modal run` imports the file as a script (not as runners.modal.app) and parses the
    README's commands' options; --help contacts nothing."""
    for ref, option in (("kernels", "--out TEXT"), ("download_model", "--revision TEXT")):
        p = subprocess.run([sys.executable, "-m", "modal", "run", f"runners/modal/app.py::{ref}", "--help"],
                           cwd=REPO, env=_no_modal_env(tmp_path), capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stderr
        assert option in p.stdout


def test_functions_declare_gpus_timeouts_and_volumes():
    s = app.Settings()
    assert _declared(app.serve) == {"gpu": "H100:4", "timeout": s.serve_timeout_s, "image": True,
                                    "volumes": {"/models": "remnant-models", "/runs": "remnant-runs"}}
    assert _declared(app.benchmark_kernels) == {"gpu": "H100:1", "timeout": s.kernels_timeout_s,
                                                "image": True, "volumes": {}}
    assert _declared(app.download_model) == {"gpu": None, "timeout": s.download_timeout_s, "image": True,
                                             "volumes": {"/models": "remnant-models"}}
    assert _declared(app.inspect_model_cache) == {"gpu": None, "timeout": s.inspect_timeout_s, "image": True,
                                                  "volumes": {"/models": "remnant-models"}}


def test_settings_drive_the_decorators(tmp_path):
    settings = {"gpu": "H200", "gpu_count": 2, "serve_timeout_s": 600, "model_volume": "other-models"}
    code = ("import json, runners.modal.app as a; s = a.serve._spec_; "
            "print(json.dumps([s.gpus, s.volumes['/models'].name, a.SETTINGS.serve_timeout_s]))")
    env = {**_no_modal_env(tmp_path), app.SETTINGS_ENV: json.dumps(settings)}
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout) == ["H200:2", "other-models", 600]


def test_image_is_the_docker_recipe():
    assert app.IMAGE_RECIPE == {"path": str(REPO / "runners" / "docker" / "Dockerfile"), "context_dir": str(REPO),
                                "build_args": {"BASE_IMAGE": "lmsysorg/sglang:v0.5.18", "SERVER": "sglang"}}
    dockerfile = REPO / "runners" / "docker" / "Dockerfile"
    if not dockerfile.is_file():
        pytest.skip("runners/docker/Dockerfile is not in this checkout")
    text = dockerfile.read_text()
    for arg in app.IMAGE_RECIPE["build_args"]:
        assert f"ARG {arg}" in text  # a build arg the Dockerfile does not declare is ignored
    assert app.SERVER_ENTRY in text  # serve runs the image's own entry script


def test_host_config_and_app_settings_agree():
    """conf/host/modal.yaml, ModalHostConfig and the app's Settings: same names, same defaults."""
    assert set(APP_SETTINGS) == {f.name for f in dataclasses.fields(app.Settings)}
    composed = _compose(["host=modal"]).host
    assert isinstance(composed, ModalHostConfig)
    assert app_settings(composed) == dataclasses.asdict(app.Settings())
    assert app_settings(ModalHostConfig()) == dataclasses.asdict(app.Settings())


def test_budget_guard_refuses_at_compose_time():
    with pytest.raises(ConfigError) as err:
        _compose(["host=modal", "host.serve_timeout_s=9000"])
    assert str(err.value) == (
        "host.gpu_count=4 x host.serve_timeout_s=9000 plans 10.00 GPU-hours for serve, over "
        "host.budget_gpu_hours=8; lower host.serve_timeout_s or raise host.budget_gpu_hours")
    with pytest.raises(ConfigError, match=r"host.kernels_gpu_count=8 x host.kernels_timeout_s=3600 plans 8.00 "
                                          r"GPU-hours for benchmark_kernels, over host.budget_gpu_hours=4"):
        _compose(["host=modal", "host.kernels_gpu_count=8", "host.kernels_timeout_s=3600", "host.budget_gpu_hours=4",
                  "host.serve_timeout_s=3600"])
    assert _compose(["host=modal", "host.serve_timeout_s=9000", "host.budget_gpu_hours=10"]).host.serve_timeout_s == 9000


def test_budget_guard_in_the_app(tmp_path):
    with pytest.raises(ValueError, match="host.gpu_count=4 x host.serve_timeout_s=36000 plans 40.00 GPU-hours for serve"):
        app.Settings(serve_timeout_s=36000).check_budget()
    env = {**_no_modal_env(tmp_path), app.SETTINGS_ENV: json.dumps({"serve_timeout_s": 36000})}
    p = subprocess.run([sys.executable, "-c", "import runners.modal.app"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and "over host.budget_gpu_hours=8" in p.stderr


def test_request_round_trips_to_the_server_launch(tmp_path):
    cfg = ModalHostConfig(model_revision="0123abc", server_args=["--mem-fraction-static", "0.85"],
                          env={"SGLANG_X": "1"})
    request = ServeRequest.from_spec(_spec(tmp_path), cfg, token="tok")
    decoded = ServeRequest.from_json(request.to_json())
    assert decoded == request
    checkpoint = app.model_dir(app.Settings(model_revision="0123abc"))
    assert checkpoint == Path("/models/deepseek-ai/DeepSeek-V4-Flash/0123abc")
    argv, env = app.launch_plan(decoded, app.Settings(model_revision="0123abc"), checkpoint, tmp_path / "work")
    assert argv == ["bash", app.SERVER_ENTRY, "--host", "0.0.0.0", "--trust-remote-code",
                    "--mem-fraction-static", "0.85"]
    assert env == {"SGLANG_X": "1", "MODEL_PATH": str(checkpoint), "PORT": "30000", "REMNANT_MODE": "kernel",
                   "REMNANT_TP_SIZE": "4", "REMNANT_RUN_ID": "20260101-run", "REMNANT_RETENTION": "256",
                   "REMNANT_RETENTION_POLICY": "attention"}
    assert app.Settings(model_revision="0123abc").mismatch(decoded.settings) is None


def test_the_api_key_reaches_the_servers_environment_never_its_command_line(tmp_path):
    spec = dataclasses.replace(_spec(tmp_path), api_key="sk-modal-test-key-1")
    request = ServeRequest.from_json(ServeRequest.from_spec(spec, ModalHostConfig(model_revision="0123abc"),
                                                            "tok").to_json())
    argv, env = app.launch_plan(request, app.Settings(model_revision="0123abc"), Path("/models/x"), tmp_path / "work")
    assert env["REMNANT_API_KEY"] == "sk-modal-test-key-1" and "sk-modal-test-key-1" not in " ".join(argv)
    assert "sk-modal-test-key-1" not in repr(spec)
    with pytest.raises(ConfigError, match="host.env sets REMNANT_API_KEY: a key there would be recorded"):
        ModalHostConfig(env={"REMNANT_API_KEY": "sk-modal-test-key-1"}).validate()
    with pytest.raises(ConfigError, match="host.server_args holds --api-key"):
        ModalHostConfig(server_args=["--api-key", "sk-modal-test-key-1"]).validate()


def test_request_carries_per_layer_retention_and_the_map(tmp_path):
    map_path = tmp_path / "map.json"
    map_path.write_text('{"schema": "remnant/retention-map", "layers": []}\n')
    spec = _spec(tmp_path, "triton", RetentionConfig(per_layer=[128, 384], map_path=str(map_path)))
    request = ServeRequest.from_json(ServeRequest.from_spec(spec, ModalHostConfig(), "tok").to_json())
    _, env = app.launch_plan(request, app.Settings(), Path("/models/x"), tmp_path / "work")
    assert env["REMNANT_RETENTION"] == "128,384"
    assert Path(env["REMNANT_RETENTION_MAP"]).read_text() == map_path.read_text()

    native = ServeRequest.from_json(ServeRequest.from_spec(_spec(tmp_path, "native"), ModalHostConfig(), "t").to_json())
    _, env = app.launch_plan(native, app.Settings(), Path("/models/x"), tmp_path / "work2")
    assert env["REMNANT_MODE"] == "native"
    assert not any(k.startswith("REMNANT_RETENTION") for k in env)


def test_request_decoding_names_what_is_wrong():
    good = json.loads(ServeRequest("t", "r", "kernel", [256], "attention", None, 4, [], {}, {}).to_json())
    with pytest.raises(ValueError, match="not a remnant/modal-serve-request v1 document"):
        ServeRequest.from_json(json.dumps({**good, "schema_version": 2}))
    with pytest.raises(ValueError, match=r"unknown \['extra'\]"):
        ServeRequest.from_json(json.dumps({**good, "extra": 1}))
    with pytest.raises(ValueError, match="mode=fast is not a mode"):
        ServeRequest.from_json(json.dumps({**good, "mode": "fast"}))
    with pytest.raises(ValueError, match="tp_size=0 must be"):
        ServeRequest.from_json(json.dumps({**good, "tp_size": 0}))


def test_stale_deployment_is_named():
    expected = app_settings(ModalHostConfig(gpu_count=4))
    assert app.Settings(gpu_count=2).mismatch(expected) == (
        "the deployed app has gpu_count=2, the run expects host.gpu_count=4: deploy it again (host.deploy=true)")


def _credentials_in(env: dict) -> str:
    code = "from remnant.hosts.modal import credentials_problem; print(credentials_problem())"
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    return p.stdout.strip()


def test_credentials_are_read_from_modal_config_only(tmp_path):
    env = _no_modal_env(tmp_path)
    assert _credentials_in(env).startswith("modal is not set up: no token found in ")
    # Values in the environment are what modal would send; nothing is contacted here.
    assert _credentials_in({**env, "MODAL_TOKEN_ID": "ak-x", "MODAL_TOKEN_SECRET": "as-x"}) == "None"
    assert "token_id or token_secret is missing" in _credentials_in({**env, "MODAL_TOKEN_ID": "ak-x"})
    (tmp_path / "modal.toml").write_text('[default]\ntoken_id = "ak-x"\ntoken_secret = "as-x"\n')
    assert _credentials_in(env) == "None"


def test_run_refuses_when_modal_is_not_set_up(tmp_path):
    run_dir = tmp_path / "run"
    p = subprocess.run([str(BIN / "remnant-run"), "host=modal", "model.tp_size=4", "workload=smoke",
                        "host.model_revision=0123abc", f"hydra.run.dir={run_dir}"],
                       cwd=tmp_path, env=_no_modal_env(tmp_path), capture_output=True, text=True, timeout=180)
    assert p.returncode == 1
    assert "remnant-run: run failed at serve: modal is not set up: no token found in " in p.stderr
    assert "(run `modal token new`)" in p.stderr
    doc = json.loads((run_dir / "run.json").read_text())
    assert (doc["status"], doc["error"]["stage"]) == ("failed", "serve")
    assert doc["host"]["kind"] == "modal" and doc["host"]["function_call_id"] is None
    assert doc["host"]["modal_image_id"] is None and doc["sources"]["image_digest"] is None


def test_host_refuses_an_unpinned_checkpoint_and_a_tp_mismatch(tmp_path, monkeypatch):
    from remnant.hosts import HostError, make_host
    import remnant.hosts.modal as host_module

    monkeypatch.setattr(host_module, "credentials_problem", lambda: None)  # past the token check only
    with pytest.raises(HostError, match="host.model_revision is not set"):
        make_host(ModalHostConfig()).check(_spec(tmp_path))
    spec = _spec(tmp_path)
    spec.model = ModelConfig()
    with pytest.raises(HostError, match="model=tiny has tp_size=1; host=modal serves on host.gpu_count=4 GPUs"):
        make_host(ModalHostConfig(model_revision="0123abc")).check(spec)


@pytest.mark.modal
def test_kernels_on_modal(tmp_path):
    """Runs benchmark_kernels (quick) on one Modal GPU and validates its JSON: needs an
    account and bills about a GPU-minute plus the first image build."""
    why = credentials_problem()
    if why:
        pytest.skip(why)
    if os.environ.get("REMNANT_MODAL_TESTS") != "1":
        pytest.skip("bills GPU time on Modal: set REMNANT_MODAL_TESTS=1 to run it")
    out = tmp_path / "kernels.json"
    p = subprocess.run([sys.executable, "-m", "modal", "run", "runners/modal/app.py::kernels", "--out", str(out),
                        "--quick"], cwd=REPO, capture_output=True, text=True, timeout=3600)
    assert p.returncode == 0, p.stderr[-4000:]
    check = subprocess.run([str(BIN / "remnant-check"), str(out)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
