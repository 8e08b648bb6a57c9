"""What a host is (docs/hosts.md): HostConfig, the fields every host has (each kind's config
class in remnant/hosts/<kind>.py extends it and registers in HOSTS), and the Host protocol:
start a server, wait for it, hand out an endpoint, always stop it. Hosts never interpret
metrics; the client never starts or stops servers."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Protocol

from remnant.api_key import bearer, read_key
from remnant.config import MISSING, Kinds, ModelConfig, RetentionConfig
from remnant.config_errors import at_least

if TYPE_CHECKING:
    import httpx

    from remnant.calibration.capture_recorder import CaptureSettings


class HostError(RuntimeError):
    """The server could not be started, reached or kept running; the message says why."""


@dataclass
class ServerSpec:
    """What to serve: mode, retention (None for native), model, and where logs go."""

    mode: str
    retention: RetentionConfig | None
    model: ModelConfig
    run_dir: Path
    log_path: Path
    #: The run's id (run.json's run_id): container hosts label what they start with it.
    run_id: str | None = None
    #: A capture run's remnant.calibration.capture_recorder.CaptureSettings (its path is
    #: in run_dir), or None: the server records its CSA layers' queries and latents there.
    capture: "CaptureSettings | None" = None
    #: The server's API key (remnant.api_key: read from host.api_key_env), or None. A host
    #: that starts the server gives it the key through its environment; every probe sends it.
    api_key: str | None = field(default=None, repr=False)


@dataclass
class Endpoint:
    """A server that answered /health. `failure()` says why it stopped, None while it runs."""

    base_url: str
    environment: dict | None = None
    failure: Callable[[], str | None] = field(default=lambda: None)
    server_info: dict | None = None


class Host(Protocol):
    def serve(self, spec: ServerSpec) -> AbstractContextManager[Endpoint]: ...

    def describe(self) -> dict: ...


@dataclass
class HostConfig:
    """Common fields of every host; `kind` picks the implementation (HOSTS)."""

    kind: str = MISSING
    #: The environment variable holding the server's API key (remnant.api_key), or None
    #: for a server without one. The name is recorded, never the key.
    api_key_env: str | None = None

    def validate(self) -> None:
        """ConfigError naming the first field out of its range; a kind adds its own fields."""
        at_least(self, "host.", ("log_tail_lines",), 0)
        self.api_key()

    def api_key(self) -> str | None:
        """The key in the variable api_key_env names (None without one); ConfigError where
        that variable holds none a run can send."""
        return read_key(self.api_key_env)

    def check_model(self, model: ModelConfig) -> None:
        """ConfigError where this host cannot serve `model` (nothing by default)."""

    def serves_sglang(self) -> bool:
        """Whether the server is SGLang with Remnant's plugin, which cannot calibrate a
        retention map at load as the embedded engine does."""
        return False

    def starts_server(self) -> bool:
        """Whether the run starts (and so configures) the server it drives."""
        return True

    def capture_refusal(self) -> str | None:
        """Why this host cannot run a capture (capture=on), in one line; None where it can."""
        return None

    def limits(self) -> list[str]:
        """Caveats of runs on this host that every run.json of it carries."""
        return []

    def make(self) -> Host:
        """The Host that serves runs with this config (remnant.hosts.make_host)."""
        raise NotImplementedError(f"host kind {self.kind} has no make()")


#: Host kinds: remnant/hosts/<kind>.py registers its HostConfig subclass.
HOSTS = Kinds("host", "remnant.hosts")


def wait_healthy(
    base_url: str,
    timeout_s: float,
    failure: Callable[[], str | None] = lambda: None,
    interval_s: float = 0.2,
    api_key: str | None = None,
    key_env: str | None = None,
) -> None:
    """Poll GET /health until 200; raise HostError on timeout, when `failure()` reports, or
    at once when the server refuses the API key (SGLang answers /health without one, but a
    server that wants one there will not start answering later). key_env: the variable
    the key came from (host.api_key_env), for the message."""
    import httpx  # here, not at import: the host configs above load without it

    deadline = time.monotonic() + timeout_s
    last = "no answer yet"
    with httpx.Client(timeout=5.0, headers=bearer(api_key)) as client:
        while True:
            why = failure()
            if why:
                raise HostError(why)
            try:
                r = client.get(f"{base_url}/health")
                if r.status_code == 200:
                    return
                _check_key_accepted(r, base_url, api_key, key_env)
                last = f"HTTP {r.status_code}"
            except httpx.HTTPError as exc:
                last = f"{type(exc).__name__}: {exc}"
            if time.monotonic() > deadline:
                raise HostError(f"{base_url}/health did not answer 200 within {timeout_s:g}s (last: {last})")
            time.sleep(interval_s)


def fetch_server_info(base_url: str, api_key: str | None = None, key_env: str | None = None) -> dict | None:
    """GET /server_info once the server is healthy (None if it has none). This is the
    readiness check of the API key too (/health needs none): HostError, in one line, where
    the server refuses the key or wants one and none was given."""
    import httpx

    try:
        r = httpx.get(f"{base_url}/server_info", timeout=10.0, headers=bearer(api_key))
    except httpx.HTTPError:
        return None
    _check_key_accepted(r, base_url, api_key, key_env)
    try:
        return r.json() if r.status_code == 200 else None
    except ValueError:
        return None


def _check_key_accepted(r: httpx.Response, base_url: str, api_key: str | None, key_env: str | None) -> None:
    """HostError where the server answered 401 or 403: it wants a key, or not this one."""
    if r.status_code not in (401, 403):
        return
    text = _error_text(r)
    said = f"GET {r.url.path} answered HTTP {r.status_code}" + (f" ({text})" if text else "")
    if api_key is None:
        raise HostError(f"the server at {base_url} wants an API key: {said}; put the key in an environment "
                        "variable and name it: host.api_key_env=VAR")
    raise HostError(f"the server at {base_url} refused the API key in host.api_key_env={key_env}: {said}; check "
                    f"the key that {key_env} holds")


def _error_text(r: httpx.Response) -> str:
    """A refusal's error message, in one short line ('' where the body has none)."""
    try:
        doc = r.json()
        text = doc.get("error", doc.get("detail", "")) if isinstance(doc, dict) else ""
    except ValueError:
        text = r.text
    if isinstance(text, dict):
        text = text.get("message", "")
    text = " ".join(str(text).split())
    return text if len(text) <= 160 else text[:157] + "..."


def log_tail(path: Path, lines: int) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return "(no server log)"
    return "\n".join(text[-lines:]) or "(server log is empty)"


def lost_log(path: Path) -> str | None:
    """For a server that exited and left its log empty: the line that says the log cannot
    be written (a full disk), so its own error, which went there, is lost. Found by
    appending a line of our own, which stays where it can be written (then None); None
    too where the log holds something."""
    from remnant.records.files import WriteError, writing

    try:
        if not path.is_file() or path.stat().st_size > 0:
            return None
        with writing(path), open(path, "a", encoding="utf-8") as f:
            f.write("remnant-run: the server exited and left this log empty\n")
    except WriteError as exc:
        return str(exc)
    except OSError:
        return None
    return None


@contextmanager
def signals_deferred() -> Iterator[None]:
    """Hold SIGINT and SIGTERM while cleaning up, so a second Ctrl-C cannot leave a
    container or a remote call behind; they are delivered when the block ends."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
