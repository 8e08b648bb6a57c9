"""Local host: the server in a Docker container on this Linux host (docs/hosts.md).

The image comes from runners/docker/Dockerfile, built with the repository as context and
tagged `remnant-server:<server>-<hash>`, the hash covering every file the build reads and
the build args; it is built only when no image has that tag (or on host.rebuild=true).
The container runs on the host's network with ipc=host, the GPUs of host.gpus, the model
directory mounted read-only, and labels naming the run; its output streams into the run's
server.log. It is stopped and removed however the run ends: success, failure, Ctrl-C or
SIGTERM (run.py turns SIGTERM into KeyboardInterrupt). A run killed outright (SIGKILL)
leaves its container; `cleanup` removes those, as its command (remnant.cli.local) does:

    python -m remnant.cli.local cleanup            # containers of runs no longer alive
    python -m remnant.cli.local cleanup --all      # every container remnant started
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import os
import re
import socket
import subprocess
import sys
import tarfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from remnant.api_key import SERVER_ENV, refuse_inline_keys
from remnant.config import ModelConfig
from remnant.config_errors import ConfigError, positive_finite
from remnant.hosts.base import (HOSTS, Endpoint, HostConfig, HostError, ServerSpec, fetch_server_info, log_tail,
                                signals_deferred, wait_healthy)
from remnant.hosts.sglang_server import SGLangKVFields, plugin_settings
from remnant.records.files import writing

#: Values of LocalHostConfig.server: what the image serves.
LOCAL_SERVERS = ("sglang", "embedded")


@HOSTS.register
@dataclass
class LocalHostConfig(SGLangKVFields, HostConfig):
    """A Docker container on this Linux host, from the image runners/docker/Dockerfile builds.

    `server` picks what the image serves: sglang (SGLang with Remnant's plugin, on the GPUs
    in `gpus`) or embedded (remnant-serve, CPU). The image is tagged by a hash of its build
    context and built when missing (or always, with rebuild=true). The KV fields
    (SGLangKVFields) reach SGLang only: server=embedded refuses values other than their
    defaults, as the container's remnant-serve is not given them.
    """

    kind: str = "local"
    server: str = "sglang"
    #: The image the Dockerfile builds on (BASE_IMAGE): a tag or a digest.
    base_image: str = "lmsysorg/sglang:v0.5.18"
    rebuild: bool = False
    #: GPU ids as this host numbers them, comma-separated ("0,1,2,3"); empty: no GPU.
    gpus: str = ""
    shm_size: str = "32g"
    #: The server's port and the distributed rendezvous port (SGLang's NCCL port), on
    #: this host's network; 0 picks a free one.
    port: int = 0
    master_port: int = 0
    startup_timeout_s: float = 1800.0
    stop_timeout_s: float = 30.0
    log_tail_lines: int = 40
    #: Shell command run before the container starts, e.g. to reserve the GPUs of a shared
    #: node; GPUS and REMNANT_RUN_ID are in its environment, a non-zero exit stops the run.
    reserve_command: str | None = None
    #: Extra environment of the server (SGLANG_* switches, HF_TOKEN, ...).
    env: dict[str, str] = field(default_factory=dict)
    #: Server arguments after the model's server_args.
    server_args: list[str] = field(default_factory=list)

    def gpu_ids(self) -> list[int]:
        """`gpus` as a list of ids; raises ConfigError naming the field when it is not one."""
        text = str(self.gpus).strip()
        if not text:
            return []
        parts = [p.strip() for p in text.split(",")]
        if not all(p.isdigit() for p in parts) or len(set(parts)) != len(parts):
            raise ConfigError(f"host.gpus={self.gpus} is not a list of distinct GPU ids like 0,1,2,3 (GPUS)")
        return [int(p) for p in parts]

    def validate(self) -> None:
        super().validate()
        if self.server not in LOCAL_SERVERS:
            raise ConfigError(f"host.server={self.server} is not a server; allowed: {', '.join(LOCAL_SERVERS)}")
        if not str(self.base_image).strip():
            raise ConfigError("host.base_image is empty; give an image tag or digest like lmsysorg/sglang:v0.5.18")
        self.gpu_ids()
        for name in ("port", "master_port"):
            value = getattr(self, name)
            if not 0 <= value <= 65535:
                raise ConfigError(f"host.{name}={value} must be a port in 1..65535, or 0 for a free one")
        if self.port and self.port == self.master_port:
            raise ConfigError(f"host.master_port={self.master_port} is host.port too; they must differ")
        if not re.fullmatch(r"[1-9][0-9]*[bkmg]?", str(self.shm_size)):
            raise ConfigError(f"host.shm_size={self.shm_size} is not a size like 32g, 512m")
        positive_finite(self.startup_timeout_s, "host.startup_timeout_s")
        positive_finite(self.stop_timeout_s, "host.stop_timeout_s")
        refuse_inline_keys(self.server_args, self.env, "host.server_args", "host.env")
        self.validate_kv_fields(self.env, self.server_args, self.server == "sglang",
                                "host.server=embedded's remnant-serve (use host=embedded)")

    def check_model(self, model: ModelConfig) -> None:
        """The model's checkpoint directory, and for SGLang one GPU per tensor-parallel rank."""
        if model.tp_size < 1:
            raise ConfigError(f"model.tp_size={model.tp_size} must be >= 1")
        if model.path is not None and not os.path.isdir(model.path):
            raise ConfigError(f"model.path={model.path} is not a directory (MODEL_PATH)")
        if self.server == "sglang":
            if model.path is None:
                raise ConfigError(
                    f"model.path is not set; host.server=sglang serves a checkpoint: set MODEL_PATH "
                    f"(or model.path=...) to model={model.name}'s directory"
                )
            gpus = self.gpu_ids()
            if len(gpus) != model.tp_size:
                raise ConfigError(
                    f"host.gpus={self.gpus or '(none)'} gives {len(gpus)} GPUs; model={model.name} has "
                    f"tp_size={model.tp_size}, so it needs {model.tp_size} (GPUS=0,1,2,3 style)"
                )

    def serves_sglang(self) -> bool:
        return self.server == "sglang"

    def make(self) -> LocalHost:
        return LocalHost(self)

#: Labels on every container this host starts; cleanup finds containers by them.
LABEL_RUN_ID = "remnant.run_id"
LABEL_RUN_DIR = "remnant.run_dir"
LABEL_PID = "remnant.pid"
LABEL_HOSTNAME = "remnant.hostname"

IMAGE_REPOSITORY = "remnant-server"
DOCKERFILE = "runners/docker/Dockerfile"
#: What the Dockerfile COPYs: the build context holds these and nothing else, and its
#: hash covers them. Keep in step with the Dockerfile.
CONTEXT_PATHS = ("pyproject.toml", "README.md", "conf", "schemas", "remnant", "runners/docker")
_SKIP = re.compile(r"(^|/)(__pycache__|[^/]*\.egg-info|\.[^/]*)(/|$)|\.py[co]$")

#: Lines the legacy builder prints about itself, not about the build's commands.
_BUILDER_CHATTER = re.compile(r"^(---> |Removing intermediate container |Running in |Successfully )")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # the builder colours a command's stderr

MODEL_MOUNT = "/model"
RETENTION_MAP_MOUNT = "/remnant/retention-map.json"
#: Where a capture run's directory is mounted (read-write): the server writes its capture there.
CAPTURE_MOUNT = "/remnant/capture"


def repo_root() -> Path:
    """The checkout the build context comes from: the directory above the remnant package."""
    import remnant

    return Path(remnant.__file__).resolve().parent.parent


def context_files(root: Path) -> list[Path]:
    """The files of the build context, relative to `root`, sorted."""
    files = []
    for name in CONTEXT_PATHS:
        top = root / name
        if top.is_file():
            files.append(Path(name))
            continue
        if not top.is_dir():
            raise HostError(f"{top} is missing: host=local builds its image from a remnant checkout")
        for path in top.rglob("*"):
            rel = path.relative_to(root)
            if path.is_file() and not _SKIP.search(rel.as_posix()):
                files.append(rel)
    return sorted(files)


def context_digest(root: Path, files: list[Path], buildargs: dict[str, str]) -> str:
    """sha256 over the context's paths, executable bits and contents, and the build args."""
    h = hashlib.sha256()
    for key in sorted(buildargs):
        h.update(f"arg {key}={buildargs[key]}\0".encode())
    for rel in files:
        path = root / rel
        h.update(f"file {rel.as_posix()} {os.access(path, os.X_OK):d}\0".encode())
        h.update(hashlib.sha256(path.read_bytes()).digest())
    return h.hexdigest()


def context_tar(root: Path, files: list[Path]) -> io.BytesIO:
    """The build context as an uncompressed tar with fixed owners and times."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for rel in files:
            info = tar.gettarinfo(str(root / rel), arcname=rel.as_posix())
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            info.mtime = 0
            with open(root / rel, "rb") as f:
                tar.addfile(info, f)
    buf.seek(0)
    return buf


def _one_line(text: str, limit: int = 300) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def docker_client():
    """A client of the Docker Engine that DOCKER_HOST (or the default socket) names."""
    import docker

    try:
        client = docker.from_env()
        client.ping()
    except docker.errors.DockerException as exc:
        where = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
        raise HostError(f"no Docker Engine answers at {where}: {_one_line(exc)}") from None
    return client


def _port_free(port: int) -> str | None:
    """None when a server could listen on 127.0.0.1:port, else why not."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError as exc:
            return exc.strerror or str(exc)
    return None


def _free_port(avoid: int = 0) -> int:
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port != avoid:
            return port


class LocalHost:
    def __init__(self, cfg: LocalHostConfig):
        self.cfg = cfg
        self._info: dict = {"kind": "local", "server": cfg.server, "gpus": cfg.gpu_ids()}

    def describe(self) -> dict:
        return dict(self._info)

    # -- image ---------------------------------------------------------------------

    def buildargs(self) -> dict[str, str]:
        return {"BASE_IMAGE": self.cfg.base_image, "SERVER": self.cfg.server}

    def ensure_image(self, client, log) -> object:
        """The image of the current build context: reused when its tag exists, else built.
        Build output goes to `log` (a binary file)."""
        import docker

        root = repo_root()
        if not (root / DOCKERFILE).is_file():
            raise HostError(f"{root / DOCKERFILE} is missing: host=local builds its image from a remnant checkout")
        files = context_files(root)
        buildargs = self.buildargs()
        digest = context_digest(root, files, buildargs)
        tag = f"{IMAGE_REPOSITORY}:{self.cfg.server}-{digest[:16]}"
        self._info.update({"image": tag, "base_image": self.cfg.base_image})
        if not self.cfg.rebuild:
            with contextlib.suppress(docker.errors.ImageNotFound):
                image = client.images.get(tag)
                self._info.update({"image_id": image.id, "image_built": False})
                return image
        log.write(f"remnant: building {tag} from {DOCKERFILE} (BASE_IMAGE={self.cfg.base_image}, "
                  f"SERVER={self.cfg.server})\n".encode())
        log.flush()
        t0 = time.monotonic()
        step, output = "", ""  # the build's current step, and the last line its commands printed
        image_id = None
        try:
            stream = client.api.build(
                fileobj=context_tar(root, files), custom_context=True, dockerfile=DOCKERFILE, tag=tag,
                buildargs=buildargs, network_mode="host", rm=True, forcerm=True, pull=False, decode=True,
                labels={"remnant.context_sha256": digest},
            )
            for chunk in stream:
                if "stream" in chunk:
                    text = chunk["stream"]
                    log.write(text.encode(errors="replace"))
                    for line in filter(None, map(str.strip, _ANSI.sub("", text).splitlines())):
                        if line.startswith("Step "):
                            step, output = line.split(" : ")[0], ""
                        elif not _BUILDER_CHATTER.match(line):
                            output = line
                elif "error" in chunk:
                    log.write(f"ERROR: {chunk['error']}\n".encode(errors="replace"))
                    log.flush()
                    raise HostError(
                        f"image build failed{' at ' + step if step else ''} (BASE_IMAGE={self.cfg.base_image}): "
                        f"{_one_line(chunk['error'])}{'; last output: ' + _one_line(output, 200) if output else ''}; "
                        f"build output in {Path(log.name).name}"
                    )
                elif "aux" in chunk and "ID" in chunk["aux"]:
                    image_id = chunk["aux"]["ID"]
        except docker.errors.APIError as exc:
            raise HostError(f"image build failed (BASE_IMAGE={self.cfg.base_image}): "
                            f"{_one_line(exc.explanation or exc)}") from None
        finally:
            log.flush()
        image = client.images.get(image_id or tag)
        self._info.update({"image_id": image.id, "image_built": True,
                           "image_build_s": round(time.monotonic() - t0, 3)})
        return image

    # -- container -----------------------------------------------------------------

    def _model_dir(self, spec: ServerSpec) -> Path:
        if spec.model.path:
            path = Path(spec.model.path).resolve()
            if not path.is_dir():
                raise HostError(f"model.path={spec.model.path} is not a directory (MODEL_PATH)")
            return path
        if self.cfg.server != "embedded":
            raise HostError(f"model.path is not set; host.server={self.cfg.server} serves a checkpoint (MODEL_PATH)")
        from remnant.engine.model_dir import write_model_dir

        return write_model_dir(dataclasses.asdict(spec.model), spec.run_dir / "model").resolve()

    def _ports(self) -> tuple[int, int]:
        port = self.cfg.port or _free_port()
        master_port = self.cfg.master_port or _free_port(avoid=port)
        for name, value, given in (("port", port, self.cfg.port), ("master_port", master_port, self.cfg.master_port)):
            if given and (why := _port_free(value)):
                raise HostError(f"host.{name}={value} is in use on this host ({why}); "
                                f"choose a free port, or 0 for any")
        return port, master_port

    def _reserve(self, spec: ServerSpec, run_id: str, log) -> None:
        """Run host.reserve_command (e.g. a GPU reservation on a shared node) before start."""
        cmd = self.cfg.reserve_command
        if not cmd:
            return
        env = {**os.environ, "GPUS": ",".join(map(str, self.cfg.gpu_ids())), "REMNANT_RUN_ID": run_id,
               "REMNANT_RUN_DIR": str(spec.run_dir)}
        log.write(f"remnant: reserve_command: {cmd}\n".encode())
        log.flush()
        self._info["reserve_command"] = cmd
        try:
            done = subprocess.run(cmd, shell=True, env=env, stdout=log, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL, timeout=self.cfg.startup_timeout_s, check=False)
        except subprocess.TimeoutExpired:
            raise HostError(f"host.reserve_command did not finish within host.startup_timeout_s="
                            f"{self.cfg.startup_timeout_s:g}s: {_one_line(cmd, 120)}") from None
        if done.returncode != 0:
            raise HostError(f"host.reserve_command exited with code {done.returncode}: {_one_line(cmd, 120)} "
                            f"(its output is in {spec.log_path.name})")

    def _command(self, spec: ServerSpec) -> list[str]:
        """The container's command: server arguments after the image's own (serve.sh)."""
        # The model's server_args are SGLang flags; host.server_args go to either server.
        model_args = spec.model.server_args if self.cfg.server == "sglang" else []
        return [*model_args, *self.cfg.server_args, *self.cfg.sglang_server_args()]

    def _environment(self, spec: ServerSpec, run_id: str, port: int, master_port: int) -> dict[str, str]:
        """The container's environment: the image's contract (runners/docker/serve.sh) and
        the plugin's settings, with the retention map where the container mounts it."""
        plugin = plugin_settings(spec, self.cfg, RETENTION_MAP_MOUNT)
        capture = {} if spec.capture is None else dataclasses.replace(
            spec.capture, path=f"{CAPTURE_MOUNT}/{Path(spec.capture.path).name}").to_env()
        return {
            **{str(k): str(v) for k, v in self.cfg.env.items()},
            **capture,
            "MODEL_PATH": MODEL_MOUNT,
            "PORT": str(port),
            "MASTER_PORT": str(master_port),
            "REMNANT_TP_SIZE": str(spec.model.tp_size),
            "REMNANT_RUN_ID": run_id,
            **plugin.to_env(),
            # remnant-serve and remnant.cli.sglang_launch read the key here (never from argv).
            **({} if spec.api_key is None else {SERVER_ENV: spec.api_key}),
        }

    @contextlib.contextmanager
    def serve(self, spec: ServerSpec) -> Iterator[Endpoint]:
        import docker
        from docker.types import DeviceRequest

        run_id = spec.run_id or uuid.uuid4().hex[:12]
        name = "remnant-" + re.sub(r"[^a-zA-Z0-9_.-]", "-", run_id)
        labels = {LABEL_RUN_ID: run_id, LABEL_RUN_DIR: str(spec.run_dir.resolve()), LABEL_PID: str(os.getpid()),
                  LABEL_HOSTNAME: socket.gethostname()}
        port, master_port = self._ports()
        model_dir = self._model_dir(spec)
        client = docker_client()
        container = None
        streamer: threading.Thread | None = None
        with writing(spec.log_path):
            log = open(spec.log_path, "ab")
        try:
            image = self.ensure_image(client, log)
            self._reserve(spec, run_id, log)
            volumes = {str(model_dir): {"bind": MODEL_MOUNT, "mode": "ro"}}
            if spec.retention is not None and spec.retention.map_path:
                volumes[str(Path(spec.retention.map_path).resolve())] = {"bind": RETENTION_MAP_MOUNT, "mode": "ro"}
            if spec.capture is not None:
                volumes[str(Path(spec.capture.path).resolve().parent)] = {"bind": CAPTURE_MOUNT, "mode": "rw"}
            gpus = self.cfg.gpu_ids()
            devices = [DeviceRequest(device_ids=[str(g) for g in gpus], capabilities=[["gpu"]])] if gpus else []
            command = self._command(spec)
            self._info.update({"container_name": name, "port": port, "master_port": master_port,
                               "model_dir": str(model_dir), "command": command, "run_id": run_id})
            try:
                container = client.containers.create(
                    image.id, command=command, name=name, labels=labels,
                    environment=self._environment(spec, run_id, port, master_port),
                    network_mode="host", ipc_mode="host", shm_size=self.cfg.shm_size, init=True,
                    device_requests=devices, volumes=volumes, detach=True,
                )
                self._info["container_id"] = container.id
                log.write(f"remnant: container {name} ({container.id[:12]}) from {self._info['image']}\n".encode())
                log.flush()
                container.start()
            except docker.errors.APIError as exc:
                why = _one_line(exc.explanation or exc)
                hint = f" (host.gpus={self.cfg.gpus}: is the NVIDIA container toolkit installed?)" if gpus and "gpu" in why else ""
                raise HostError(f"container {name} did not start: {why}{hint}") from None
            streamer = threading.Thread(target=_stream_logs, args=(container, spec.log_path), daemon=True,
                                        name=f"logs-{name}")
            streamer.start()
            base_url = f"http://127.0.0.1:{port}"
            self._info["base_url"] = base_url

            def failure() -> str | None:
                try:
                    container.reload()
                except docker.errors.NotFound:
                    return f"container {name} is gone"
                except docker.errors.DockerException:
                    return None  # the daemon did not answer this time; the client sees real failures
                if container.status not in ("exited", "dead"):
                    return None
                state = container.attrs.get("State", {})
                streamer.join(timeout=5)
                oom = " (killed: out of memory)" if state.get("OOMKilled") else ""
                return (f"container {name} exited with code {state.get('ExitCode')}{oom}; "
                        f"last lines of {spec.log_path.name}:\n" + log_tail(spec.log_path, self.cfg.log_tail_lines))

            try:
                wait_healthy(base_url, self.cfg.startup_timeout_s, failure, api_key=spec.api_key,
                             key_env=self.cfg.api_key_env)
            except HostError as exc:
                if failure() is None:
                    raise HostError(f"{exc}; last lines of {spec.log_path.name}:\n"
                                    + log_tail(spec.log_path, self.cfg.log_tail_lines)) from None
                raise
            info = fetch_server_info(base_url, spec.api_key, self.cfg.api_key_env)
            # Provenance from where the server runs: the container's own Python.
            inside = _container_provenance(container)
            self._info["sglang_version"] = inside.get("sglang_version")
            env = (info or {}).get("environment") or inside.get("environment")
            yield Endpoint(base_url, environment=env, failure=failure, server_info=info)
        finally:
            with signals_deferred():
                self._remove(client, container, run_id)
                if streamer is not None:
                    streamer.join(timeout=10)
                log.close()
                client.close()

    def _remove(self, client, container, run_id: str) -> None:
        """Stop (SIGTERM, then SIGKILL after stop_timeout_s) and remove the run's container;
        record its exit code. Looks it up by label when creation was cut short."""
        import docker

        targets = [container] if container is not None else client.containers.list(
            all=True, filters={"label": f"{LABEL_RUN_ID}={run_id}"})
        for c in targets:
            try:
                c.reload()
                if c.status in ("running", "restarting", "paused", "created"):
                    c.stop(timeout=int(self.cfg.stop_timeout_s))
                c.reload()
                self._info["exit_code"] = c.attrs.get("State", {}).get("ExitCode")
                c.remove(force=True)
            except docker.errors.NotFound:
                pass
            except docker.errors.DockerException as exc:
                self._info["cleanup_error"] = _one_line(exc)
                print(f"remnant: container {c.name} was not removed ({_one_line(exc, 200)}); "
                      f"python -m remnant.cli.local cleanup removes it", file=sys.stderr)


def _container_provenance(container) -> dict:
    """The container's environment() and SGLang version, from its own Python ({} on failure)."""
    import json

    import docker

    code = ("import json; from importlib import metadata; from remnant.records.provenance import environment\n"
            "try: v = metadata.version('sglang')\nexcept metadata.PackageNotFoundError: v = None\n"
            "print(json.dumps({'environment': environment(), 'sglang_version': v}))")
    try:
        done = container.exec_run(["python3", "-c", code], stdout=True, stderr=False)
        return json.loads(done.output.decode().strip().splitlines()[-1]) if done.exit_code == 0 else {}
    except (docker.errors.DockerException, ValueError, IndexError):
        return {}


def _stream_logs(container, path: Path) -> None:
    """Append the container's stdout and stderr to `path` until it stops."""
    import docker

    with open(path, "ab") as f, contextlib.suppress(docker.errors.DockerException, OSError):
        for chunk in container.logs(stream=True, follow=True, stdout=True, stderr=True):
            f.write(chunk)
            f.flush()


# -- cleanup ---------------------------------------------------------------------------


def _orchestrator_alive(labels: dict) -> bool:
    """Whether the remnant-run that started a container still runs on this machine."""
    if labels.get(LABEL_HOSTNAME) != socket.gethostname():
        return True  # another machine's run (a shared daemon): not ours to judge
    try:
        pid = int(labels.get(LABEL_PID, "0"))
    except ValueError:
        return False
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup(run_id: str | None = None, everything: bool = False) -> list[str]:
    """Remove containers remnant started: those of `run_id`, every one (`everything`), or
    by default those whose remnant-run is gone. Returns the names removed."""
    import docker

    client = docker_client()
    label = f"{LABEL_RUN_ID}={run_id}" if run_id else LABEL_RUN_ID
    removed, failed = [], []
    for c in client.containers.list(all=True, filters={"label": label}):
        if run_id is None and not everything and _orchestrator_alive(c.labels):
            continue
        try:
            c.remove(force=True)
        except docker.errors.NotFound:
            continue  # gone meanwhile (its run's own cleanup got there first)
        except docker.errors.DockerException as exc:
            failed.append(f"{c.name} ({exc})")
            continue
        removed.append(c.name)
    if failed:
        raise HostError(f"could not remove {', '.join(failed)}; removed {len(removed)}: {', '.join(removed) or 'none'}")
    return removed
