"""Remnant on Modal: kernel benchmarks on one GPU and the SGLang TP server on several.

The image is runners/docker/Dockerfile's (the pinned SGLang base plus remnant and its
plugin), built by Modal from this checkout. Functions:

  benchmark_kernels    remnant-kernels on kernels_gpu_count GPUs, model-free; returns its
                       JSON and the Modal machine's facts as JSON text
  inspect_model_cache  what the model volume holds (JSON text)
  download_model       the checkpoint into the model volume, only when absent
  serve                SGLang with Remnant's plugin on gpu_count GPUs for a mode and
                       retention, exposed through a Modal tunnel (remnant/hosts/modal.py
                       starts and always cancels it)

  modal run runners/modal/app.py::kernels --out kernels-h100.json      (1 GPU)
  modal run runners/modal/app.py::download_model --revision <commit>  (CPU)
  remnant-run host=modal model=dsv4_flash_0731 mode=kernel ...        (serve, 4 GPUs)

GPU types, counts, timeouts, volumes and the base image come from `Settings`, read from
the JSON in REMNANT_MODAL_SETTINGS at import (remnant-run sets it from conf/host/modal.yaml;
the defaults here are that file's). Importing this module needs neither Modal credentials
nor network; only running its functions does.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import modal

SETTINGS_ENV = "REMNANT_MODAL_SETTINGS"
MODELS_DIR = "/models"
RUNS_DIR = "/runs"
#: Marks a complete download inside a checkpoint directory (written last).
DOWNLOAD_MARKER = ".remnant-download.json"
#: The Docker image's entry script (runners/docker/serve.sh), which serves MODEL_PATH with
#: the REMNANT_* environment; serve runs it directly, as a container would.
SERVER_ENTRY = "/usr/local/bin/remnant-container-serve"

# parent.parent... never raises, also inside the container where this file is /root/app.py.
REPO = Path(__file__).resolve().parent.parent.parent
DOCKERFILE = REPO / "runners" / "docker" / "Dockerfile"
#: Not part of the build context (mirrors .gitignore): the upload stays small.
CONTEXT_IGNORE = [".git", ".venv", "**/__pycache__", "*.egg-info", "outputs", "multirun", "models",
                  ".pytest_cache", "build", ".device"]


@dataclass(frozen=True)
class Settings:
    """The app's resources: same names and defaults as conf/host/modal.yaml's fields."""

    app_name: str = "remnant"
    gpu: str = "H100"
    gpu_count: int = 4
    serve_timeout_s: int = 7200
    kernels_gpu_count: int = 1
    kernels_timeout_s: int = 1800
    download_timeout_s: int = 14400
    inspect_timeout_s: int = 300
    budget_gpu_hours: float = 8.0
    model_repo: str = "deepseek-ai/DeepSeek-V4-Flash"
    model_revision: str | None = None
    model_volume: str = "remnant-models"
    runs_volume: str = "remnant-runs"
    base_image: str = "lmsysorg/sglang:v0.5.18"
    port: int = 30000

    @classmethod
    def from_env(cls, environ: dict | None = None) -> Settings:
        """Settings from REMNANT_MODAL_SETTINGS (JSON), defaults for what it leaves out."""
        raw = (os.environ if environ is None else environ).get(SETTINGS_ENV)
        if not raw:
            return cls()
        data = json.loads(raw)
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"{SETTINGS_ENV} has unknown fields {unknown}; allowed: {', '.join(sorted(names))}")
        return cls(**data)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    def gpu_request(self, count: int) -> str:
        """Modal's GPU string: TYPE:COUNT."""
        return f"{self.gpu}:{count}"

    def check_budget(self) -> None:
        """The host config's checks and budget guard (remnant.hosts.modal.ModalHostConfig)
        on these settings: one rule, whichever side reads it."""
        from remnant.hosts.modal import ModalHostConfig

        ModalHostConfig(**dataclasses.asdict(self)).validate()

    def mismatch(self, expected: dict) -> str | None:
        """Why these settings are not the ones a run expects (None when they are)."""
        mine = dataclasses.asdict(self)
        for name in sorted(set(mine) | set(expected)):
            if mine.get(name) != expected.get(name):
                return (f"the deployed app has {name}={mine.get(name)!r}, the run expects host.{name}="
                        f"{expected.get(name)!r}: deploy it again (host.deploy=true)")
        return None


def model_dir(settings: Settings, repo_id: str | None = None, revision: str | None = None) -> Path:
    """Where a checkpoint lives on the model volume: /models/<repo id>/<revision>."""
    return Path(MODELS_DIR) / (repo_id or settings.model_repo) / (revision or settings.model_revision or "")


def launch_plan(request, settings: Settings, checkpoint: Path, workdir: Path) -> tuple[list[str], dict[str, str]]:
    """The server's command line and environment for a ServeRequest (remnant.hosts.modal).

    The environment is the Docker image's contract (runners/docker/Dockerfile): MODEL_PATH,
    PORT, REMNANT_TP_SIZE, REMNANT_RUN_ID, and the plugin's REMNANT_* settings as
    remnant.sglang.settings.Settings.to_env writes them. A retention map sent inline is
    written under `workdir`.
    """
    from remnant.sglang.settings import Settings as PluginSettings

    plugin = PluginSettings(request.mode)
    if request.mode != "native" and request.retention is not None:
        map_path = None
        if request.retention_map is not None:
            workdir.mkdir(parents=True, exist_ok=True)
            map_path = workdir / "retention-map.json"
            map_path.write_text(request.retention_map)
        plugin = PluginSettings(request.mode, tuple(request.retention), None if map_path is None else str(map_path),
                                request.retention_policy or None)
    env = {
        **request.env,
        "MODEL_PATH": str(checkpoint),
        "PORT": str(settings.port),
        "REMNANT_TP_SIZE": str(request.tp_size),
        "REMNANT_RUN_ID": request.run_id,
        **plugin.to_env(),
    }
    # The entry binds 127.0.0.1; a tunnel reaches the container's own address, so bind all.
    # SGLang's argument parser keeps the last --host.
    argv = ["bash", SERVER_ENTRY, "--host", "0.0.0.0", *request.server_args]
    return argv, env


def machine_facts() -> dict:
    """Where this container runs: Modal ids, GPUs as nvidia-smi lists them, versions."""
    from importlib import metadata

    def version(dist: str) -> str | None:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    gpus = []
    if shutil.which("nvidia-smi"):
        done = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=60, check=False)
        gpus = [line.strip() for line in done.stdout.splitlines() if line.strip()]
    return {
        "image_id": os.environ.get("MODAL_IMAGE_ID"),
        "task_id": os.environ.get("MODAL_TASK_ID"),
        "region": os.environ.get("MODAL_REGION"),
        "cloud_provider": os.environ.get("MODAL_CLOUD_PROVIDER"),
        "function_call_id": modal.current_function_call_id(),
        "nvidia_smi": gpus,
        "versions": {d: version(d) for d in ("remnant", "sglang", "torch", "triton", "modal")},
        "settings": dataclasses.asdict(SETTINGS),
    }


def collect_environment() -> dict:
    """remnant's run-record `environment`, collected in a child process so that this one
    holds no CUDA context (it would take GPU memory from the server)."""
    code = "import json; from remnant.records.provenance import environment; print(json.dumps(environment()))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    return json.loads(done.stdout)


SETTINGS = Settings.from_env()
SETTINGS.check_budget()
#: The settings travel with every function, so the containers see what the decorators saw.
FUNCTION_ENV = {SETTINGS_ENV: SETTINGS.to_json()}
#: The Docker recipe, as from_dockerfile gets it (tests read it here).
IMAGE_RECIPE = {"path": str(DOCKERFILE), "context_dir": str(REPO),
                "build_args": {"BASE_IMAGE": SETTINGS.base_image, "SERVER": "sglang"}}

app = modal.App(SETTINGS.app_name)
image = (
    modal.Image.from_dockerfile(DOCKERFILE, context_dir=REPO, build_args=IMAGE_RECIPE["build_args"],
                                ignore=CONTEXT_IGNORE)
    # Modal starts its own process in the container; the server entry would take its place.
    .entrypoint([])
)
model_volume = modal.Volume.from_name(SETTINGS.model_volume, create_if_missing=True)
runs_volume = modal.Volume.from_name(SETTINGS.runs_volume, create_if_missing=True)


@app.function(image=image, gpu=SETTINGS.gpu_request(SETTINGS.kernels_gpu_count),
              timeout=SETTINGS.kernels_timeout_s, env=FUNCTION_ENV)
def benchmark_kernels(quick: bool = False) -> dict[str, str]:
    """Run `remnant-kernels` (no model) and return {file name: JSON text}: kernels.json
    (schema remnant/kernel-bench) and modal.json (this machine's facts)."""
    out = Path("/tmp/remnant-kernels.json")
    cmd = ["remnant-kernels", "--out", str(out), *(["--quick"] if quick else [])]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    print(done.stdout, end="")
    print(done.stderr, end="", file=sys.stderr)
    if done.returncode != 0:
        tail = "\n".join(done.stderr.splitlines()[-20:])
        raise RuntimeError(f"remnant-kernels exited with code {done.returncode}:\n{tail}")
    return {"kernels.json": out.read_text(), "modal.json": json.dumps(machine_facts(), indent=2)}


@app.function(image=image, volumes={MODELS_DIR: model_volume}, timeout=SETTINGS.inspect_timeout_s,
              env=FUNCTION_ENV)
def inspect_model_cache() -> str:
    """JSON text: each checkpoint directory on the model volume, complete or not, and its size."""
    root = Path(MODELS_DIR)
    found = []
    for checkpoint in sorted(p for p in root.glob("*/*/*") if p.is_dir()):  # <org>/<repo>/<revision>
        marker = checkpoint / DOWNLOAD_MARKER
        found.append({
            "path": str(checkpoint),
            "complete": marker.is_file(),
            "download": json.loads(marker.read_text()) if marker.is_file() else None,
            "bytes": sum(p.stat().st_size for p in checkpoint.rglob("*") if p.is_file()),
        })
    pinned = model_dir(SETTINGS)
    return json.dumps({"volume": SETTINGS.model_volume, "checkpoints": found,
                       "pinned": {"repo": SETTINGS.model_repo, "revision": SETTINGS.model_revision,
                                  "present": bool(SETTINGS.model_revision) and (pinned / DOWNLOAD_MARKER).is_file()}},
                      indent=2)


@app.function(image=image, volumes={MODELS_DIR: model_volume}, timeout=SETTINGS.download_timeout_s,
              env=FUNCTION_ENV)
def download_model(repo_id: str = "", revision: str = "") -> str:
    """Download a checkpoint into the model volume unless it is there; returns its directory.

    `revision` may be a branch or tag: it is resolved to its commit, which names the
    directory and is what host.model_revision must pin.
    """
    from huggingface_hub import HfApi, snapshot_download

    repo_id = repo_id or SETTINGS.model_repo
    revision = revision or SETTINGS.model_revision or ""
    if not revision:
        raise ValueError("no revision: pass --revision <commit> (or --revision main to resolve the newest "
                         "and pin it as host.model_revision)")
    commit = HfApi().model_info(repo_id, revision=revision).sha
    target = model_dir(SETTINGS, repo_id, commit)
    if (target / DOWNLOAD_MARKER).is_file():
        print(f"{repo_id}@{commit} is already on volume {SETTINGS.model_volume}: {target}")
        return str(target)
    t0 = time.monotonic()
    snapshot_download(repo_id, revision=commit, local_dir=str(target))
    files = [p for p in target.rglob("*") if p.is_file()]
    (target / DOWNLOAD_MARKER).write_text(json.dumps({
        "repo_id": repo_id, "requested_revision": revision, "commit": commit,
        "files": len(files), "bytes": sum(p.stat().st_size for p in files),
        "seconds": round(time.monotonic() - t0, 1),
    }, indent=2))
    model_volume.commit()
    print(f"downloaded {repo_id}@{commit} to {target}; pin host.model_revision={commit}")
    return str(target)


@app.function(image=image, gpu=SETTINGS.gpu_request(SETTINGS.gpu_count),
              volumes={MODELS_DIR: model_volume, RUNS_DIR: runs_volume},
              timeout=SETTINGS.serve_timeout_s, env=FUNCTION_ENV)
def serve(request_json: str) -> None:
    """Serve the pinned checkpoint with Remnant's plugin until cancelled (the host does).

    Leaves <token>/environment.json and then <token>/endpoint.json (the tunnel URL and
    this machine's facts) on the runs volume for the host. The server's output is this
    function's log. Returns only by failing: a server that exits by itself is an error.
    """
    from remnant.hosts.modal import ENDPOINT_FILE, ENVIRONMENT_FILE, ServeRequest

    request = ServeRequest.from_json(request_json)
    why = SETTINGS.mismatch(request.settings)
    if why:
        raise RuntimeError(why)
    if not SETTINGS.model_revision:
        raise RuntimeError("model_revision is not set; pin host.model_revision")
    checkpoint = model_dir(SETTINGS)
    if not (checkpoint / DOWNLOAD_MARKER).is_file():
        raise RuntimeError(f"{SETTINGS.model_repo}@{SETTINGS.model_revision} is not on volume "
                           f"{SETTINGS.model_volume}: modal run runners/modal/app.py::download_model")
    out = Path(RUNS_DIR) / request.token
    out.mkdir(parents=True, exist_ok=True)
    (out / ENVIRONMENT_FILE).write_text(json.dumps(collect_environment(), indent=2))
    argv, env = launch_plan(request, SETTINGS, checkpoint, Path("/tmp/remnant") / request.token)
    print(f"[remnant] run {request.run_id}: {' '.join(argv)}", flush=True)
    proc = subprocess.Popen(argv, env={**os.environ, **env}, stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        with modal.forward(SETTINGS.port) as tunnel:
            (out / ENDPOINT_FILE).write_text(json.dumps({"url": tunnel.url, **machine_facts()}, indent=2))
            runs_volume.commit()
            code = proc.wait()
        raise RuntimeError(f"the server exited with code {code}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)


@app.local_entrypoint()
def kernels(out: str = "kernels-h100.json", quick: bool = False) -> None:
    """benchmark_kernels on Modal; writes its JSON to OUT and the machine's facts beside it
    (OUT with .modal.json). Check it with `remnant-check OUT`."""
    files = benchmark_kernels.remote(quick=quick)
    path = Path(out)
    path.write_text(files["kernels.json"])
    path.with_suffix(".modal.json").write_text(files["modal.json"])
    print(f"{path} (and {path.with_suffix('.modal.json')})")
