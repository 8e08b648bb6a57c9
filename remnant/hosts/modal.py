"""Modal host: the SGLang server of runners/modal/app.py on Modal GPUs, through a tunnel.

The run deploys the app with the host config's settings (or reuses the deployed one),
spawns `serve`, waits for the tunnel URL that `serve` leaves on the runs volume, and hands
the client that URL once /health answers. Server logs stream into server.log. The call is
cancelled, with its containers, on success, failure, Ctrl-C and SIGTERM; if this process
dies outright, Modal still stops `serve` at host.serve_timeout_s.

What crosses the boundary is JSON text: the host sends a `ServeRequest`, `serve` writes
endpoint.json and environment.json (collected on the Modal machine) to the runs volume.
The modal SDK is imported only when a server starts: configs and tests need none of it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from remnant.api_key import SERVER_ENV, refuse_inline_keys
from remnant.config_errors import ConfigError, at_least, positive_finite
from remnant.hosts.base import (HOSTS, Endpoint, HostConfig, HostError, ServerSpec, fetch_server_info, log_tail,
                                signals_deferred, wait_healthy)
from remnant.hosts.sglang_server import SGLangKVFields, plugin_settings
from remnant.kv.modes import mode_of
from remnant.records.files import writing
from remnant.records.kinds import MODAL_SERVE_REQUEST

log = logging.getLogger(__name__)

#: runners/modal/app.py reads its settings from this variable (JSON) at import.
SETTINGS_ENV = "REMNANT_MODAL_SETTINGS"
#: ModalHostConfig fields that are the app's settings (runners/modal/app.py `Settings`).
APP_SETTINGS = (
    "app_name", "gpu", "gpu_count", "serve_timeout_s", "kernels_gpu_count", "kernels_timeout_s",
    "download_timeout_s", "inspect_timeout_s", "budget_gpu_hours", "model_repo", "model_revision",
    "model_volume", "runs_volume", "base_image", "port",
)
ENDPOINT_FILE = "endpoint.json"
ENVIRONMENT_FILE = "environment.json"
_POLL_S = 2.0
_LOG_DRAIN_S = 15.0


@HOSTS.register
@dataclass
class ModalHostConfig(SGLangKVFields, HostConfig):
    """The same SGLang server on Modal GPUs (runners/modal/app.py), reached through a tunnel.

    The fields from `app_name` to `port` are the app's settings (runners/modal/app.py
    `Settings`, same names): the host deploys the app with them. Planned GPU time is
    gpu_count x serve_timeout_s (Modal stops `serve` at its timeout), and
    kernels_gpu_count x kernels_timeout_s for `benchmark_kernels`; a plan over
    budget_gpu_hours is refused before anything starts. The KV fields (SGLangKVFields)
    reach the server's environment through the ServeRequest's env.
    """

    kind: str = "modal"
    app_name: str = "remnant"
    gpu: str = "H100"
    #: GPUs of `serve`, and SGLang's --tp-size (model.tp_size must match).
    gpu_count: int = 4
    serve_timeout_s: int = 7200
    kernels_gpu_count: int = 1
    kernels_timeout_s: int = 1800
    download_timeout_s: int = 14400
    inspect_timeout_s: int = 300
    budget_gpu_hours: float = 8.0
    model_repo: str = "deepseek-ai/DeepSeek-V4-Flash"
    #: The checkpoint's commit on the hub; `serve` refuses to start without one.
    model_revision: str | None = None
    model_volume: str = "remnant-models"
    runs_volume: str = "remnant-runs"
    base_image: str = "lmsysorg/sglang:v0.5.18"
    port: int = 30000
    #: `modal deploy` the app before the run (quick when nothing changed); false reuses
    #: the deployed app, which must have been deployed with the same settings.
    deploy: bool = True
    #: Modal environment (null: the profile's default).
    environment: str | None = None
    #: runners/modal/app.py of a remnant checkout (null: the one remnant is imported from).
    app_path: str | None = None
    #: Until /health answers through the tunnel: container start, weights, CUDA graphs.
    startup_timeout_s: float = 1800.0
    log_tail_lines: int = 40
    #: Extra environment of the server (SGLANG_* switches, ...).
    env: dict[str, str] = field(default_factory=dict)
    #: Server arguments after the model's server_args.
    server_args: list[str] = field(default_factory=list)

    def planned_gpu_hours(self) -> dict[str, float]:
        """GPU-hours each GPU function may bill at most: GPUs x timeout."""
        return {"serve": self.gpu_count * self.serve_timeout_s / 3600,
                "benchmark_kernels": self.kernels_gpu_count * self.kernels_timeout_s / 3600}

    def validate(self) -> None:
        """The fields, and the budget guard: the planned GPU-hours must fit the budget."""
        super().validate()
        at_least(self, "host.", ("gpu_count", "kernels_gpu_count", "serve_timeout_s", "kernels_timeout_s",
                                 "download_timeout_s", "inspect_timeout_s"), 1)
        positive_finite(self.startup_timeout_s, "host.startup_timeout_s")
        positive_finite(self.budget_gpu_hours, "host.budget_gpu_hours")
        if not 1 <= self.port <= 65535:
            raise ConfigError(f"host.port={self.port} must be a port in 1..65535")
        refuse_inline_keys(self.server_args, self.env, "host.server_args", "host.env")
        self.validate_kv_fields(self.env, self.server_args, True)
        for function, (count, timeout) in {"serve": ("gpu_count", "serve_timeout_s"),
                                           "benchmark_kernels": ("kernels_gpu_count", "kernels_timeout_s")}.items():
            planned = self.planned_gpu_hours()[function]
            if planned > self.budget_gpu_hours:
                raise ConfigError(
                    f"host.{count}={getattr(self, count)} x host.{timeout}={getattr(self, timeout)} plans "
                    f"{planned:.2f} GPU-hours for {function}, over host.budget_gpu_hours={self.budget_gpu_hours:g}; "
                    f"lower host.{timeout} or raise host.budget_gpu_hours"
                )

    def serves_sglang(self) -> bool:
        return True

    def capture_refusal(self) -> str | None:
        return ("the capture file would be written inside the Modal container, which does not bring it back; "
                "capture with host=local (or host=embedded) and upload the map you build from it")

    def make(self) -> ModalHost:
        return ModalHost(self)


def app_settings(cfg: ModalHostConfig) -> dict:
    """The app's settings as this host config states them."""
    return {name: getattr(cfg, name) for name in APP_SETTINGS}


@dataclass
class ServeRequest:
    """What the host sends to the Modal `serve` function, as JSON text (never a pickle).

    `retention` is one value (uniform) or one per CSA layer, None for native;
    `retention_map` is the map file's JSON text, carried inline because the file is on
    this machine. `settings` are the app settings the run expects; `serve` refuses to
    start under others (a stale deployment).
    """

    token: str
    run_id: str
    mode: str
    retention: list[int] | None
    retention_policy: str | None
    retention_map: str | None
    tp_size: int
    server_args: list[str]
    env: dict[str, str]
    settings: dict = field(default_factory=dict)

    @classmethod
    def from_spec(cls, spec: ServerSpec, cfg: ModalHostConfig, token: str) -> ServeRequest:
        ret = spec.retention
        return cls(
            token=token,
            run_id=spec.run_id or Path(spec.run_dir).name,
            mode=spec.mode,
            retention=None if ret is None else ret.values(),
            retention_policy=None if ret is None else ret.policy,
            retention_map=None if ret is None or not ret.map_path else Path(ret.map_path).read_text(),
            tp_size=cfg.gpu_count,
            server_args=[*spec.model.server_args, *cfg.server_args, *cfg.sglang_server_args()],
            # The key reaches the server's environment (launch_plan), never its command line;
            # launch_plan writes mode and retention itself, the plugin's other parts come here.
            env={**{str(k): str(v) for k, v in cfg.env.items()},
                 **plugin_settings(spec, cfg, None).parts_env(),
                 **({} if spec.api_key is None else {SERVER_ENV: spec.api_key})},
            settings=app_settings(cfg),
        )

    def to_json(self) -> str:
        return json.dumps({**MODAL_SERVE_REQUEST.header(), **dataclasses.asdict(self)}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ServeRequest:
        """Decode and check a request; ValueError names the first field that is wrong."""
        doc = json.loads(text)
        if not isinstance(doc, dict):
            raise ValueError("a serve request is a JSON object")
        header = {key: doc.pop(key, None) for key in MODAL_SERVE_REQUEST.header()}
        if header != MODAL_SERVE_REQUEST.header():
            raise ValueError(f"not a {MODAL_SERVE_REQUEST.name} v{MODAL_SERVE_REQUEST.version} document")
        names = {f.name for f in dataclasses.fields(cls)}
        if set(doc) != names:
            raise ValueError(f"serve request fields differ: missing {sorted(names - set(doc))}, "
                             f"unknown {sorted(set(doc) - names)}")
        req = cls(**doc)
        mode_of(req.mode)  # a ValueError naming the modes there are
        if req.retention is not None and not (
                isinstance(req.retention, list) and req.retention and all(isinstance(v, int) for v in req.retention)):
            raise ValueError(f"retention={req.retention} is not a list of integers")
        if not isinstance(req.tp_size, int) or req.tp_size < 1:
            raise ValueError(f"tp_size={req.tp_size} must be an integer >= 1")
        if not all(isinstance(a, str) for a in req.server_args):
            raise ValueError(f"server_args={req.server_args} must be strings")
        return req


def credentials_problem() -> str | None:
    """Why the modal SDK could not authenticate, from its config file and environment
    alone (no network): None when a token (or OAuth client) is configured."""
    try:
        import modal.config
    except ImportError:
        return "modal is not installed (pip install modal, or pip install -e '.[modal]')"
    config = modal.config.config
    token = [config.get("token_id"), config.get("token_secret")]
    oauth = [config.get("oauth_refresh_token"), config.get("oauth_client_id")]
    if all(token) or all(oauth):
        return None
    if any(token):
        return (f"modal is not set up: token_id or token_secret is missing (in {modal.config.user_config_path} "
                "or MODAL_TOKEN_ID / MODAL_TOKEN_SECRET); run `modal token new`")
    return (f"modal is not set up: no token found in {modal.config.user_config_path} or "
            "MODAL_TOKEN_ID / MODAL_TOKEN_SECRET (run `modal token new`)")


def default_app_path() -> Path:
    """runners/modal/app.py of the checkout remnant is imported from."""
    return Path(__file__).resolve().parents[2] / "runners" / "modal" / "app.py"


class ModalHost:
    def __init__(self, cfg: ModalHostConfig):
        self.cfg = cfg
        self._info: dict = {
            "kind": "modal", "app_name": cfg.app_name, "environment": cfg.environment,
            "gpu": cfg.gpu, "gpu_count": cfg.gpu_count,
            "model": {"repo": cfg.model_repo, "revision": cfg.model_revision, "volume": cfg.model_volume},
            # Modal's image id (im-...), not a registry digest: run.json's image_digest stays null.
            "app_id": None, "function_call_id": None, "modal_image_id": None,
        }

    def describe(self) -> dict:
        return dict(self._info)

    def check(self, spec: ServerSpec) -> None:
        """Refuse, before any Modal call, what cannot work; HostError names the cause."""
        why = credentials_problem()
        if why:
            raise HostError(why)
        if not self.cfg.model_revision:
            raise HostError(
                "host.model_revision is not set: pin the checkpoint's commit "
                f"(modal run runners/modal/app.py::download_model --revision main prints {self.cfg.model_repo}'s)"
            )
        if spec.model.tp_size != self.cfg.gpu_count:
            raise HostError(
                f"model={spec.model.name} has tp_size={spec.model.tp_size}; host=modal serves on "
                f"host.gpu_count={self.cfg.gpu_count} GPUs, so they must match (give a model config with "
                f"tp_size={self.cfg.gpu_count})"
            )

    @contextlib.contextmanager
    def serve(self, spec: ServerSpec) -> Iterator[Endpoint]:
        self.check(spec)
        import modal

        cfg = self.cfg
        token = f"{Path(spec.run_dir).name}-{uuid.uuid4().hex[:8]}"
        request = ServeRequest.from_spec(spec, cfg, token)
        self._info["token"] = token
        deadline = time.monotonic() + cfg.startup_timeout_s
        with writing(spec.log_path):
            logfile = open(spec.log_path, "a", encoding="utf-8", errors="replace")
        call = pump = None
        try:
            if cfg.deploy:
                self._deploy(logfile)
                deadline = time.monotonic() + cfg.startup_timeout_s  # the build is not startup
            try:
                self._info["app_id"] = modal.App.lookup(cfg.app_name, environment_name=cfg.environment).app_id
            except modal.exception.NotFoundError:
                raise HostError(f"modal app {cfg.app_name} is not deployed: run with host.deploy=true "
                                "or `modal deploy runners/modal/app.py`") from None
            serve_fn = modal.Function.from_name(cfg.app_name, "serve", environment_name=cfg.environment)
            call = serve_fn.spawn(request.to_json())
            self._info["function_call_id"] = call.object_id
            pump = threading.Thread(target=_pump_logs, args=(call, logfile), daemon=True, name="modal-logs")
            pump.start()
            failure = _call_failure(call, cfg, spec.log_path)
            runs = modal.Volume.from_name(cfg.runs_volume, environment_name=cfg.environment,
                                          create_if_missing=True)
            endpoint = self._wait_file(runs, f"{token}/{ENDPOINT_FILE}", deadline, failure)
            base_url = str(endpoint["url"]).rstrip("/")
            self._info.update(base_url=base_url, modal_image_id=endpoint.get("image_id"), remote=endpoint)
            if (endpoint.get("versions") or {}).get("sglang"):
                self._info["sglang_version"] = endpoint["versions"]["sglang"]
            try:
                wait_healthy(base_url, max(deadline - time.monotonic(), 1.0), failure, interval_s=_POLL_S,
                             api_key=spec.api_key, key_env=self.cfg.api_key_env)
            except HostError as exc:
                raise HostError(f"{exc}; last lines of {spec.log_path.name}:\n"
                                + log_tail(spec.log_path, cfg.log_tail_lines)) from None
            environment = self._wait_file(runs, f"{token}/{ENVIRONMENT_FILE}", time.monotonic() + 60, failure)
            info = fetch_server_info(base_url, spec.api_key, self.cfg.api_key_env)
            yield Endpoint(base_url, environment=environment, failure=failure, server_info=info)
        finally:
            if call is not None:
                self._stop(call)
            if pump is not None:
                pump.join(_LOG_DRAIN_S)
            logfile.close()

    def _deploy(self, logfile) -> None:
        """`modal deploy` the app with this config's settings; output goes to server.log."""
        path = Path(self.cfg.app_path) if self.cfg.app_path else default_app_path()
        if not path.is_file():
            raise HostError(f"host.app_path={path} is not a file; host=modal deploys runners/modal/app.py "
                            "of a remnant checkout")
        cmd = [sys.executable, "-m", "modal", "deploy", "--name", self.cfg.app_name]
        if self.cfg.environment:
            cmd += ["--env", self.cfg.environment]
        cmd.append(str(path))
        env = {**os.environ, SETTINGS_ENV: json.dumps(app_settings(self.cfg), sort_keys=True)}
        logfile.write(f"[remnant] {' '.join(cmd)}\n")
        logfile.flush()
        done = subprocess.run(cmd, stdout=logfile, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                              env=env, check=False)
        if done.returncode != 0:
            raise HostError(f"modal deploy exited with code {done.returncode}; see server.log")
        self._info["deployed"] = True

    @staticmethod
    def _wait_file(volume, path: str, deadline: float, failure) -> dict:
        """A JSON file `serve` writes to the runs volume, polled until it appears."""
        while True:
            why = failure()
            if why:
                raise HostError(why)
            try:
                doc = json.loads(b"".join(volume.read_file(path)))
                if isinstance(doc, dict):
                    return doc
            except FileNotFoundError:
                pass
            if time.monotonic() > deadline:
                raise HostError(f"serve did not write {path} on the runs volume in time (host.startup_timeout_s)")
            time.sleep(_POLL_S)

    def _stop(self, call) -> None:
        """Cancel the call and its containers; a second Ctrl-C or SIGTERM must not skip this."""
        with signals_deferred():
            try:
                call.cancel(terminate_containers=True)
                self._info["stopped"] = True
            except Exception as exc:  # noqa: BLE001 - say so loudly; Modal's timeout is the backstop
                self._info["stopped"] = False
                self._info["stop_error"] = f"{type(exc).__name__}: {exc}"
                log.error("could not cancel modal call %s (%s); stop it with `modal app stop %s` or it runs "
                          "until host.serve_timeout_s=%s", call.object_id, exc, self.cfg.app_name,
                          self.cfg.serve_timeout_s)


def _pump_logs(call, logfile) -> None:
    """Copy the call's log stream into server.log until the call ends."""
    try:
        for entry in call.logs.stream():
            logfile.write(entry.message)
            logfile.flush()
    except Exception as exc:  # noqa: BLE001 - logs are best effort; the run goes on
        with contextlib.suppress(ValueError):
            logfile.write(f"[remnant] modal log stream ended: {type(exc).__name__}: {exc}\n")


def _call_failure(call, cfg: ModalHostConfig, log_path: Path):
    """`Endpoint.failure` for a spawned call: None while it runs, why once it has ended.
    Polls Modal at most every few seconds; a passing network error is not an end."""
    import modal.exception as mexc

    state = {"at": 0.0, "why": None}

    def failure() -> str | None:
        if state["why"] or time.monotonic() - state["at"] < _POLL_S:
            return state["why"]
        state["at"] = time.monotonic()
        try:
            call.get(timeout=0)
        except mexc.FunctionTimeoutError:
            why = f"serve reached its timeout (host.serve_timeout_s={cfg.serve_timeout_s})"
        except mexc.OutputExpiredError:
            why = "serve ended long ago (its output expired)"
        except mexc.TimeoutError:
            return None  # still running
        except (mexc.ConnectionError, mexc.ServiceError, mexc.InternalError, mexc.ResourceExhaustedError):
            return None
        except Exception as exc:  # noqa: BLE001 - the remote error is the reason
            why = f"serve failed on Modal: {type(exc).__name__}: {exc}"
        else:
            why = "serve returned: the server exited"
        state["why"] = f"{why}; last lines of {log_path.name}:\n" + log_tail(log_path, cfg.log_tail_lines)
        return state["why"]

    return failure
