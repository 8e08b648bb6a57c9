"""Hosts start servers; make_host loads the implementation a host config names."""

from __future__ import annotations

from remnant.config import HostConfig
from remnant.hosts.base import Endpoint, Host, HostError, ServerSpec

KINDS = ("embedded", "external", "local", "modal")


def make_host(cfg: HostConfig) -> Host:
    if cfg.kind == "embedded":
        from remnant.hosts.embedded import EmbeddedHost

        return EmbeddedHost(cfg)
    if cfg.kind == "external":
        from remnant.hosts.external import ExternalHost

        return ExternalHost(cfg)
    if cfg.kind == "local":
        from remnant.hosts.local import LocalHost

        return LocalHost(cfg)
    if cfg.kind == "modal":
        from remnant.hosts.modal import ModalHost

        return ModalHost(cfg)
    raise ValueError(f"host.kind={cfg.kind} is not a host; allowed: {', '.join(KINDS)}")


__all__ = ["Endpoint", "Host", "HostError", "ServerSpec", "make_host"]
