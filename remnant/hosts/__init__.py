"""Hosts start servers. Each kind's module (remnant/hosts/<kind>.py) holds its config
class, registered in remnant.hosts.base.HOSTS, whose make() builds the Host."""

from __future__ import annotations

from remnant.hosts.base import HOSTS, Endpoint, Host, HostConfig, HostError, ServerSpec


def make_host(cfg: HostConfig) -> Host:
    """The Host of `cfg`; ValueError (ConfigError) names the kinds there are."""
    HOSTS.get(cfg.kind)
    return cfg.make()


__all__ = ["Endpoint", "Host", "HostError", "ServerSpec", "make_host"]
