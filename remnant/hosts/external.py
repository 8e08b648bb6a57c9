"""External host: a server already running at a URL; never started or stopped."""

from __future__ import annotations

import contextlib
from typing import Iterator

from remnant.config import ExternalHostConfig
from remnant.hosts.base import Endpoint, ServerSpec, fetch_server_info, wait_healthy


class ExternalHost:
    def __init__(self, cfg: ExternalHostConfig):
        self.cfg = cfg

    def describe(self) -> dict:
        return {"kind": "external", "base_url": self.cfg.base_url}

    @contextlib.contextmanager
    def serve(self, spec: ServerSpec) -> Iterator[Endpoint]:
        base_url = self.cfg.base_url.rstrip("/")
        wait_healthy(base_url, self.cfg.health_timeout_s)
        # Where an external server runs is not ours to inspect: environment stays unknown.
        yield Endpoint(base_url, environment=None, server_info=fetch_server_info(base_url))
