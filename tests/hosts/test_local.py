"""Local host: remnant-run serves from a Docker container and always removes it.

Tests marked `docker` drive a real Docker Engine (.ci/run starts one): the CPU test image
is runners/docker/Dockerfile built on remnant-test-base:bookworm (made locally by
runners/docker/make_test_base.sh, no registry), serving the embedded engine. They skip
only where no Docker Engine answers.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import docker
import pytest

from remnant.config import ModelConfig, RetentionConfig
from remnant.config_errors import ConfigError
from remnant.hosts import HostError, ServerSpec, make_host
from remnant.hosts.local import LABEL_RUN_DIR, LABEL_RUN_ID, LocalHostConfig, context_digest, context_files
from tests.signals import default_sigint

# (pytest -n runs this module in one worker, --dist loadfile: its tests share the Docker
# Engine and build the same images, which two workers would race to build.)

BIN = Path(sys.executable).parent
ROOT = Path(__file__).resolve().parents[2]
BASE_IMAGE = "remnant-test-base:bookworm"
# host=local serving the embedded engine from the CPU test image.
LOCAL = ["host=local", "host.server=embedded", f"host.base_image={BASE_IMAGE}"]


def remnant_run(*args: str, cwd: Path, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "remnant-run"), *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.fixture(scope="session")
def docker_engine():
    """A client of a running Docker Engine, with the CPU test base image made for today's
    requirements."""
    from remnant.hosts.local import docker_client

    try:
        client = docker_client()
    except HostError as exc:
        pytest.skip(f"{exc} (.ci/run starts one as root: dockerd --iptables=false --bridge=none)")
    # Always asked: it returns at once where the image was made for today's requirements,
    # and rebuilds one made before a dependency was added (image builds run offline).
    done = subprocess.run([str(ROOT / "runners" / "docker" / "make_test_base.sh"), BASE_IMAGE],
                          capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, f"make_test_base.sh failed:\n{done.stdout}\n{done.stderr}"
    return client


def _containers(client, run_dir: Path) -> list:
    return client.containers.list(all=True, filters={"label": f"{LABEL_RUN_DIR}={run_dir.resolve()}"})


def _check(path: Path) -> None:
    done = subprocess.run([str(BIN / "remnant-check"), str(path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.docker
def test_run_in_a_container_completes_and_removes_it(docker_engine, tmp_path):
    run_dir = tmp_path / "run"
    p = remnant_run(*LOCAL, "mode=kernel", "workload=smoke", f"hydra.run.dir={run_dir}",
                    "host.reserve_command='echo $REMNANT_RUN_ID > reserved.txt'", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    doc = json.loads((run_dir / "run.json").read_text())
    assert doc["status"] == "completed" and doc["metrics"]["completed"] == 6
    assert (tmp_path / "reserved.txt").read_text().strip() == doc["run_id"]  # ran before the server
    host = doc["host"]
    assert host["kind"] == "local" and host["server"] == "embedded" and host["gpus"] == []
    assert host["image"].startswith("remnant-server:embedded-") and host["base_image"] == BASE_IMAGE
    assert host["image_id"].startswith("sha256:") and len(host["container_id"]) == 64
    assert doc["sources"]["image_digest"] == host["image_id"]
    # Provenance from inside the container: the test image has no SGLang, this venv has.
    assert host["sglang_version"] is None and doc["sources"]["sglang_version"] is None
    assert doc["environment"]["torch"] and doc["environment"]["cpu_count"] >= 1
    assert doc["server_info"]["engine"] == "remnant-embedded" and doc["server_info"]["remnant_mode"] == "kernel"
    assert doc["server_info"]["c4_record_bytes"] == [328, 328]
    log = (run_dir / "server.log").read_text()
    assert "remnant-serve listening on" in log  # the container's own output, streamed
    assert not docker_engine.containers.list(all=True, filters={"label": f"{LABEL_RUN_ID}={doc['run_id']}"})
    _check(run_dir / "run.json")

    # The same build context reuses the image (in a tree others edit meanwhile the context,
    # hence the tag, may have changed: then, and only then, it is built anew).
    again = tmp_path / "again"
    p = remnant_run(*LOCAL, "workload=smoke", "workload.measured_requests=1", f"hydra.run.dir={again}", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    host2 = json.loads((again / "run.json").read_text())["host"]
    same = host2["image"] == host["image"]
    assert host2["image_built"] is not same and (host2["image_id"] == host["image_id"]) is same
    assert host2["container_id"] != host["container_id"]
    assert not _containers(docker_engine, again)


@pytest.mark.docker
def test_a_secured_server_in_a_container_completes_and_no_file_holds_the_key(docker_engine, tmp_path):
    from tests.test_api_key import KEY, KEY_ENV, files_holding

    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k != "REMNANT_API_KEY"}
    p = remnant_run(*LOCAL, "workload=smoke", f"host.api_key_env={KEY_ENV}", f"hydra.run.dir={run_dir}",
                    cwd=tmp_path, env={**env, KEY_ENV: KEY})
    assert p.returncode == 0, p.stderr
    doc = json.loads((run_dir / "run.json").read_text())
    assert doc["status"] == "completed" and doc["metrics"]["completed"] == 6
    # The server in the container got the key from its environment and wanted it.
    assert "API key required" in (run_dir / "server.log").read_text()
    assert files_holding(run_dir) == [] and KEY not in p.stdout + p.stderr
    assert not _containers(docker_engine, run_dir)


@pytest.mark.docker
def test_a_capture_in_a_container_lands_in_the_run_directory(docker_engine, tmp_path):
    """remnant-capture on host=local: the container writes the capture through its mount of
    the run directory, and is removed after."""
    run_dir = tmp_path / "run"
    p = subprocess.run([str(BIN / "remnant-capture"), *LOCAL, "workload=smoke", "capture.tokens=4",
                        "capture.records=8", f"hydra.run.dir={run_dir}"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    doc = json.loads((run_dir / "run.json").read_text())
    cap = doc["capture"]
    assert (cap["queries"], cap["latents"], cap["complete"], cap["source"]) == (4, 8, True, "smoke")
    from remnant.calibration.captures import load_captures

    captures = load_captures(run_dir / "capture.safetensors")
    assert captures.fingerprint == cap["fingerprint"] and captures.params["server"] == "remnant-serve"
    assert not _containers(docker_engine, run_dir)
    _check(run_dir / "run.json")


def _start_long_run(tmp_path: Path, run_dir: Path, client) -> tuple[subprocess.Popen, object]:
    proc = subprocess.Popen(
        [str(BIN / "remnant-run"), *LOCAL, "workload=smoke", "workload.measured_requests=2000",
         f"hydra.run.dir={run_dir}"],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=default_sigint,
    )
    requests = run_dir / "requests.jsonl"
    deadline = time.monotonic() + 300
    while not (requests.exists() and len(requests.read_text().splitlines()) >= 5):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.1)
    (container,) = _containers(client, run_dir)
    return proc, container


@pytest.mark.docker
def test_server_dying_in_the_container_fails_the_run(docker_engine, tmp_path):
    run_dir = tmp_path / "run"
    proc, container = _start_long_run(tmp_path, run_dir, docker_engine)
    # SIGKILL every process of the container but its init: the server dies, not docker.
    container.exec_run(["bash", "-c", "kill -KILL -1"])
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, err
    doc = json.loads((run_dir / "run.json").read_text())
    assert doc["status"] == "failed" and doc["metrics"] is None
    assert f"container {container.name} exited with code 137" in doc["error"]["message"]
    records = [json.loads(line) for line in (run_dir / "requests.jsonl").read_text().splitlines()]
    assert sum(r["success"] for r in records) >= 5  # every finished request kept
    assert doc["host"]["container_id"] == container.id
    assert not _containers(docker_engine, run_dir)
    _check(run_dir / "run.json")


@pytest.mark.docker
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_interrupt_stops_and_removes_the_container(docker_engine, tmp_path, sig):
    run_dir = tmp_path / "run"
    proc, container = _start_long_run(tmp_path, run_dir, docker_engine)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + sig, err  # 130 for Ctrl-C, 143 for SIGTERM
    doc = json.loads((run_dir / "run.json").read_text())
    assert doc["status"] == "interrupted" and doc["error"]["stage"] == "client"
    assert len((run_dir / "requests.jsonl").read_text().splitlines()) >= 5
    assert doc["host"]["container_id"] == container.id
    assert not _containers(docker_engine, run_dir)
    _check(run_dir / "run.json")


@pytest.mark.docker
def test_port_in_use_is_one_line(docker_engine, tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        p = remnant_run(*LOCAL, "workload=smoke", f"host.port={port}", f"hydra.run.dir={tmp_path}/run", cwd=tmp_path)
    assert p.returncode == 1
    assert p.stderr.strip().splitlines() == [
        f"remnant-run: run failed at serve: host.port={port} is in use on this host (Address already in use); "
        "choose a free port, or 0 for any"
    ]
    doc = json.loads((tmp_path / "run" / "run.json").read_text())
    assert doc["status"] == "failed" and doc["error"]["stage"] == "serve"
    assert not _containers(docker_engine, tmp_path / "run")


@pytest.mark.docker
def test_failed_reservation_stops_the_run(docker_engine, tmp_path):
    p = remnant_run(*LOCAL, "workload=smoke", "host.reserve_command='echo GPUs busy; exit 3'",
                    f"hydra.run.dir={tmp_path}/run", cwd=tmp_path)
    assert p.returncode == 1
    assert p.stderr.strip().splitlines() == [
        "remnant-run: run failed at serve: host.reserve_command exited with code 3: echo GPUs busy; exit 3 "
        "(its output is in server.log)"
    ]
    assert "GPUs busy" in (tmp_path / "run" / "server.log").read_text()
    assert not _containers(docker_engine, tmp_path / "run")


@pytest.mark.docker
def test_image_build_failure_is_one_line(docker_engine, tmp_path):
    # No registry is reachable and no such image is here: FROM fails.
    p = remnant_run("host=local", "host.server=embedded", "host.base_image=remnant-test-base:missing",
                    "workload=smoke", f"hydra.run.dir={tmp_path}/run", cwd=tmp_path)
    assert p.returncode == 1
    (line,) = p.stderr.strip().splitlines()
    # (Step 2 is FROM; the total is the Dockerfile's step count.)
    assert re.match(r"remnant-run: run failed at serve: image build failed at Step 2/\d+ "
                    r"\(BASE_IMAGE=remnant-test-base:missing\): ", line), line
    assert "build output in server.log" in line
    doc = json.loads((tmp_path / "run" / "run.json").read_text())
    assert doc["status"] == "failed" and "image build failed" in doc["error"]["message"]


@pytest.mark.docker
def test_failing_dockerfile_step_names_its_output(docker_engine, tmp_path):
    # A server the Dockerfile refuses (config validation would stop it before the host).
    host = make_host(LocalHostConfig(server="bogus", base_image=BASE_IMAGE))
    spec = ServerSpec("native", None, ModelConfig(path=str(tmp_path)), tmp_path, tmp_path / "server.log",
                      run_id="bogus-build")
    with pytest.raises(HostError) as err:
        with host.serve(spec):
            pass
    msg = str(err.value)
    assert "\n" not in msg and re.match(r"image build failed at Step 4/\d+ \(BASE_IMAGE=remnant-test-base:bookworm\)",
                                         msg), msg
    assert "returned a non-zero code: 1" in msg
    assert "last output: SERVER=bogus is not a server; allowed: sglang, embedded" in msg
    assert "SERVER=bogus is not a server" in (tmp_path / "server.log").read_text()


@pytest.mark.docker
def test_startup_timeout_shows_log_tail_and_removes(docker_engine, tmp_path):
    p = remnant_run(*LOCAL, "workload=smoke", "host.startup_timeout_s=0.01", f"hydra.run.dir={tmp_path}/run",
                    cwd=tmp_path)
    assert p.returncode == 1
    doc = json.loads((tmp_path / "run" / "run.json").read_text())
    assert "did not answer 200 within 0.01s" in doc["error"]["message"]
    assert "last lines of server.log" in doc["error"]["message"]
    assert not _containers(docker_engine, tmp_path / "run")


@pytest.mark.docker
def test_gpus_without_a_gpu_runtime_name_the_field(docker_engine, tmp_path):
    if "nvidia" in (docker_engine.info().get("Runtimes") or {}):
        pytest.skip("this Docker Engine has the NVIDIA runtime: GPU requests succeed here")
    spec = ServerSpec("native", None, ModelConfig(), tmp_path, tmp_path / "server.log", run_id="gpu-request")
    host = make_host(LocalHostConfig(server="embedded", base_image=BASE_IMAGE, gpus="0"))
    with pytest.raises(HostError, match=r"did not start: .*\(host.gpus=0: is the NVIDIA container toolkit installed\?\)"):
        with host.serve(spec):
            pass
    assert not docker_engine.containers.list(all=True, filters={"label": f"{LABEL_RUN_ID}=gpu-request"})


@pytest.mark.docker
def test_cleanup_removes_what_a_killed_run_left(docker_engine, tmp_path):
    run_dir = tmp_path / "run"
    proc, container = _start_long_run(tmp_path, run_dir, docker_engine)
    proc.kill()  # SIGKILL: no finally runs, the container stays
    proc.communicate(timeout=30)
    assert [c.id for c in _containers(docker_engine, run_dir)] == [container.id]
    # A container whose run is alive (this process) stays, unless named.
    alive = docker_engine.containers.run(
        BASE_IMAGE, ["sleep", "600"], detach=True, network_mode="host",
        labels={LABEL_RUN_ID: "alive-run", "remnant.pid": str(os.getpid()), "remnant.hostname": socket.gethostname()},
    )
    try:
        done = subprocess.run([sys.executable, "-m", "remnant.cli.local", "cleanup"],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert f"removed {container.name}" in done.stdout and "alive-run" not in done.stdout
        assert not _containers(docker_engine, run_dir)
        alive.reload()
        assert alive.status == "running"
        done = subprocess.run([sys.executable, "-m", "remnant.cli.local", "cleanup", "--run-id", "alive-run"],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and f"removed {alive.name}" in done.stdout
    finally:
        with contextlib.suppress(docker.errors.NotFound):
            alive.remove(force=True)


# -- without a Docker Engine ----------------------------------------------------------


def test_missing_model_path_is_one_line(tmp_path, monkeypatch):
    p = remnant_run(*LOCAL, "model.path=/nonexistent/model", "workload=smoke", cwd=tmp_path)
    assert p.returncode == 2
    assert p.stderr.strip() == "remnant-run: error: model.path=/nonexistent/model is not a directory (MODEL_PATH)"
    env = {k: v for k, v in os.environ.items() if k != "MODEL_PATH"}
    p = remnant_run("host=local", "model=dsv4_flash_0731", "workload=smoke", cwd=tmp_path, env={**env, "GPUS": "0,1,2,3"})
    assert p.returncode == 2
    assert p.stderr.strip() == (
        "remnant-run: error: model.path is not set; host.server=sglang serves a checkpoint: set MODEL_PATH "
        "(or model.path=...) to model=dsv4_flash_0731's directory"
    )


def _validate(cfg: LocalHostConfig, model: ModelConfig) -> None:
    """What remnant.config.validate asks of a host: its fields, then what it needs of the model."""
    cfg.validate()
    cfg.check_model(model)


@pytest.mark.parametrize(("host", "model", "message"), [
    (dict(gpus="0,1"), dict(tp_size=4), r"host.gpus=0,1 gives 2 GPUs; model=tiny has tp_size=4, so it needs 4"),
    (dict(gpus=""), dict(tp_size=4), r"host.gpus=\(none\) gives 0 GPUs"),
    (dict(gpus="0,a"), {}, "host.gpus=0,a is not a list of distinct GPU ids"),
    (dict(gpus="1,1"), {}, "host.gpus=1,1 is not a list of distinct GPU ids"),
    (dict(server="vllm"), {}, "host.server=vllm is not a server; allowed: sglang, embedded"),
    (dict(port=30000, master_port=30000), {}, "host.master_port=30000 is host.port too"),
    (dict(port=70000), {}, r"host.port=70000 must be a port in 1..65535"),
    (dict(shm_size="lots"), {}, "host.shm_size=lots is not a size"),
])
def test_local_rules_name_the_field(tmp_path, host, model, message):
    cfg = LocalHostConfig(**{"gpus": "0,1,2,3", **host})
    with pytest.raises(ConfigError, match=message):
        _validate(cfg, ModelConfig(path=str(tmp_path), **{"tp_size": 4, **model}))


def test_a_valid_sglang_host(tmp_path):
    _validate(LocalHostConfig(gpus="0,1,2,3"), ModelConfig(path=str(tmp_path), tp_size=4))
    assert LocalHostConfig(gpus=" 3, 1 ").gpu_ids() == [3, 1]


def test_a_capture_gives_the_sglang_container_the_plugins_capture_settings(tmp_path):
    """The plugin reads REMNANT_CAPTURE* (remnant.sglang); the path is where the container
    mounts the run directory."""
    from remnant.calibration.capture_recorder import CaptureSettings
    from remnant.hosts.local import CAPTURE_MOUNT

    host = LocalHostConfig(gpus="0,1,2,3").make()
    capture = CaptureSettings(str(tmp_path / "capture.safetensors"), 64, 512, "sharegpt", "/models/dsv4")
    spec = ServerSpec("native", None, ModelConfig(path=str(tmp_path), tp_size=4), tmp_path, tmp_path / "log",
                      capture=capture)
    env = host._environment(spec, "run1", 30000, 30001)
    assert CaptureSettings.from_env(env) == CaptureSettings(f"{CAPTURE_MOUNT}/capture.safetensors", 64, 512,
                                                            "sharegpt", "/models/dsv4")
    assert env["REMNANT_MODE"] == "native"


def test_context_digest_follows_content_and_args(tmp_path):
    files = context_files(ROOT)
    names = {f.as_posix() for f in files}
    assert {"runners/docker/Dockerfile", "runners/docker/serve.sh", "pyproject.toml", "remnant/hosts/local.py"} <= names
    assert not any("__pycache__" in n or n.endswith(".pyc") for n in names)
    args = {"BASE_IMAGE": BASE_IMAGE, "SERVER": "embedded"}
    first = context_digest(ROOT, files, args)
    assert context_digest(ROOT, files, args) == first
    assert context_digest(ROOT, files, {**args, "SERVER": "sglang"}) != first
    # A copy with one byte changed hashes differently.
    for rel in files[:3]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes((ROOT / rel).read_bytes())
    assert context_digest(tmp_path, files[:3], args) == context_digest(ROOT, files[:3], args)
    (tmp_path / files[0]).write_bytes((ROOT / files[0]).read_bytes() + b"\n")
    assert context_digest(tmp_path, files[:3], args) != context_digest(ROOT, files[:3], args)


def test_retention_reaches_the_container_environment(tmp_path):
    from remnant.hosts.local import LocalHost

    host = LocalHost(LocalHostConfig(server="embedded"))
    spec = ServerSpec("triton", RetentionConfig(retention=128, per_layer=[128, 384], map_path=str(tmp_path / "m.json"),
                                                policy="magnitude"),
                      ModelConfig(tp_size=1), tmp_path, tmp_path / "server.log", run_id="r1")
    env = host._environment(spec, "r1", 31000, 31001)
    assert env == {"MODEL_PATH": "/model", "PORT": "31000", "MASTER_PORT": "31001", "REMNANT_MODE": "triton",
                   "REMNANT_TP_SIZE": "1", "REMNANT_RUN_ID": "r1", "REMNANT_RETENTION": "128,384",
                   "REMNANT_RETENTION_POLICY": "magnitude", "REMNANT_RETENTION_MAP": "/remnant/retention-map.json"}


def test_readme_command_composes_from_the_environment(tmp_path, monkeypatch):
    """GPUS=0,1,2,3 MODEL_PATH=... remnant-run host=local model=dsv4_flash_0731 mode=kernel workload=longswe
    retention.map_path=map.json"""
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    from remnant.cli.run import register_configs, to_run_config

    for name, value in {"GPUS": "0,1,2,3", "MODEL_PATH": str(tmp_path), "PORT": "31234", "MASTER_PORT": "31235"}.items():
        monkeypatch.setenv(name, value)
    GlobalHydra.instance().clear()
    register_configs()
    with initialize_config_module(config_module="remnant.conf", version_base=None):
        overrides = ["host=local", "model=dsv4_flash_0731", "mode=kernel", "workload=longswe"]
        # SGLang cannot calibrate at load: without a map the default policy is refused.
        with pytest.raises(ConfigError, match="retention.policy=attention needs calibration"):
            to_run_config(compose(config_name="config", overrides=overrides))
        (tmp_path / "map.json").write_text("{}")
        cfg = to_run_config(compose(config_name="config", overrides=[*overrides, f"retention.map_path={tmp_path / 'map.json'}"]))
    assert isinstance(cfg.host, LocalHostConfig) and cfg.host.server == "sglang"
    assert cfg.host.gpu_ids() == [0, 1, 2, 3] and (cfg.host.port, cfg.host.master_port) == (31234, 31235)
    assert cfg.host.base_image == "lmsysorg/sglang:v0.5.18"
    assert cfg.model.path == str(tmp_path) and cfg.model.tp_size == 4
    assert "--trust-remote-code" in cfg.model.server_args
    assert "--enable-metrics" in cfg.model.server_args  # else SGLang answers /metrics with 404
