"""External host: a server already running at a URL; never started or stopped."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator
from urllib.parse import urlsplit

from remnant.config import MISSING
from remnant.config_errors import ConfigError, positive_finite
from remnant.hosts.base import HOSTS, Endpoint, HostConfig, ServerSpec, fetch_server_info, wait_healthy


@HOSTS.register
@dataclass
class ExternalHostConfig(HostConfig):
    """A server that is already running; never started or stopped."""

    kind: str = "external"
    base_url: str = MISSING
    health_timeout_s: float = 30.0

    def validate(self) -> None:
        super().validate()
        try:
            url = urlsplit(self.base_url)
            ok = url.scheme in ("http", "https") and bool(url.hostname) and (url.port or True)
        except ValueError:
            ok = False
        if not ok:
            raise ConfigError(f"host.base_url={self.base_url} is not an http(s) URL like http://127.0.0.1:30000")
        positive_finite(self.health_timeout_s, "host.health_timeout_s")

    def starts_server(self) -> bool:
        return False

    def capture_refusal(self) -> str | None:
        return ("Remnant does not start that server, so it cannot give it capture settings; start it with "
                "REMNANT_CAPTURE=<file> in its environment (docs/capture.md) and drive it with an ordinary run")

    def make(self) -> ExternalHost:
        return ExternalHost(self)


class ExternalHost:
    def __init__(self, cfg: ExternalHostConfig):
        self.cfg = cfg

    def describe(self) -> dict:
        return {"kind": "external", "base_url": self.cfg.base_url}

    @contextlib.contextmanager
    def serve(self, spec: ServerSpec) -> Iterator[Endpoint]:
        base_url = self.cfg.base_url.rstrip("/")
        wait_healthy(base_url, self.cfg.health_timeout_s, api_key=spec.api_key,
                     key_env=self.cfg.api_key_env)
        # A missing or wrong key fails here: /health needs none.
        info = fetch_server_info(base_url, spec.api_key, self.cfg.api_key_env)
        # Where an external server runs is not ours to inspect: environment stays unknown.
        yield Endpoint(base_url, environment=None, server_info=info)
