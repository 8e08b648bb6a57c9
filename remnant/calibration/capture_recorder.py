"""Recording calibration captures while a server runs (SGLang's plugin, the embedded engine).

A capture server runs in native mode; its CSA layers hand every decode query (after RoPE)
and every C4 latent (before FP8 quantization) to a CaptureRecorder, which keeps the first
`tokens` decode queries and the first `records` latents of each CSA layer on the CPU. When
every CSA layer has both, it writes one remnant-capture/1 file
(remnant.calibration.captures, atomically) and ignores what comes later. Short of that,
the file is written with what the recorder has when the run asks for it
(`write_requested`: a marker file beside the capture, then the server's /flush_cache) or
at shutdown (`close()`). The request matters for SGLang, which stops its scheduler
processes with SIGKILL, so no exit handler runs there. Recording only copies: the server
computes as it would without it.

Settings come from plain values (CaptureSettings); `to_env` / `from_env` carry them to
SGLang's processes as REMNANT_CAPTURE* variables. Importing this module imports no torch.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Mapping

from remnant.config_errors import ConfigError

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

ENV_CAPTURE = "REMNANT_CAPTURE"
ENV_CAPTURE_TOKENS = "REMNANT_CAPTURE_TOKENS"
ENV_CAPTURE_RECORDS = "REMNANT_CAPTURE_RECORDS"
ENV_CAPTURE_SOURCE = "REMNANT_CAPTURE_SOURCE"
ENV_CAPTURE_MODEL_ID = "REMNANT_CAPTURE_MODEL_ID"

#: Defaults, the run config's too (remnant.config.CaptureConfig): 256 decode queries of 64
#: heads are 32 MiB of float32 per CSA layer; 4096 latents are 8 MiB. Both bound the file
#: and the time the policies take to read it.
DEFAULT_TOKENS = 256
DEFAULT_RECORDS = 4096


@dataclass(frozen=True)
class CaptureSettings:
    """Where and how much to capture.

    path: the capture file to write (.safetensors). tokens: decode query tokens kept per CSA
    layer. records: C4 latents kept per CSA layer. source: what was served (a workload name),
    recorded in the file and used to split training from evaluation data by source.
    model_id: the served model, recorded in the file.
    """

    path: str
    tokens: int = DEFAULT_TOKENS
    records: int = DEFAULT_RECORDS
    source: str = "unknown"
    model_id: str = "unknown"

    def check(self, prefix: str = "capture.") -> None:
        """ConfigError naming the first bad field as `prefix + name`."""
        if not str(self.path).strip():
            raise ConfigError(f"{prefix}path is empty; give the capture file to write")
        for name in ("tokens", "records"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{prefix}{name}={value!r} must be an integer >= 1")
        if not str(self.source).strip():
            raise ConfigError(f"{prefix}source is empty; name what the capture server serves")

    def to_env(self) -> dict[str, str]:
        """The REMNANT_CAPTURE* variables from_env reads back as these settings."""
        return {ENV_CAPTURE: os.path.abspath(self.path), ENV_CAPTURE_TOKENS: str(self.tokens),
                ENV_CAPTURE_RECORDS: str(self.records), ENV_CAPTURE_SOURCE: self.source,
                ENV_CAPTURE_MODEL_ID: self.model_id}

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> CaptureSettings | None:
        """Settings from the environment; None without REMNANT_CAPTURE. ConfigError names
        the variable and its value."""
        env = os.environ if environ is None else environ
        path = env.get(ENV_CAPTURE, "").strip()
        if not path:
            return None
        values = {}
        for name, var, default in (("tokens", ENV_CAPTURE_TOKENS, DEFAULT_TOKENS),
                                   ("records", ENV_CAPTURE_RECORDS, DEFAULT_RECORDS)):
            text = env.get(var, "").strip()
            try:
                values[name] = int(text) if text else default
            except ValueError:
                raise ConfigError(f"{var}={text!r} is not an integer") from None
            if values[name] < 1:
                raise ConfigError(f"{var}={text} must be >= 1")
        if Path(path).is_dir():
            raise ConfigError(f"{ENV_CAPTURE}={path} is a directory; give the capture file to write")
        return cls(path=path, source=env.get(ENV_CAPTURE_SOURCE, "").strip() or "unknown",
                   model_id=env.get(ENV_CAPTURE_MODEL_ID, "").strip() or "unknown", **values)


def write_request(path: str | os.PathLike) -> Path:
    """The marker file that asks the server recording into `path` to write it now: a run
    creates it, then calls /flush_cache (the file's directory is the one a container mounts)."""
    return Path(f"{path}.write-now")


def write_requested(recorder: CaptureRecorder | None) -> Path | None:
    """At /flush_cache: write `recorder`'s capture if the run asked for it (close()); the
    path written, or None."""
    if recorder is None or not write_request(recorder.settings.path).exists():
        return None
    return recorder.close()


@dataclass
class _Layer:
    queries: list = field(default_factory=list)
    latents: list = field(default_factory=list)
    n_queries: int = 0
    n_latents: int = 0


class CaptureRecorder:
    """Keeps the first `settings.tokens` decode queries and `settings.records` C4 latents of
    every CSA layer, and writes them once as a capture file.

    layers: the model's CSA layer indices, when known (the file is written as soon as each
    has its budget); `expect` can give them later. params: how the capture was made (server,
    versions, settings), stored in the file's metadata beside the settings.
    """

    def __init__(self, settings: CaptureSettings, params: dict | None = None,
                 layers: list[int] | None = None) -> None:
        settings.check()
        self.settings = settings
        self.params = dict(params or {})
        self._layers: dict[int, _Layer] = {}
        self._expected: set[int] | None = None
        self._lock = threading.Lock()
        self.written: Path | None = None
        if layers is not None:
            self.expect(layers)

    @property
    def done(self) -> bool:
        """Written: later queries and latents are ignored."""
        return self.written is not None

    def expect(self, layers: list[int]) -> None:
        """The CSA layers a complete capture covers."""
        self._expected = set(layers)
        for layer in layers:
            self._layers.setdefault(layer, _Layer())

    def add_queries(self, layer: int, q: "torch.Tensor") -> None:
        """Decode queries of one CSA layer, [n, H, 512] (after RoPE), any float dtype/device."""
        self._add(layer, q, "queries", self.settings.tokens, ndim=3)

    def add_latents(self, layer: int, k: "torch.Tensor") -> None:
        """C4 latents of one CSA layer, [n, 512] (before FP8 quantization)."""
        self._add(layer, k, "latents", self.settings.records, ndim=2)

    def wants(self, layer: int, kind: str) -> bool:
        """Whether `layer` still takes `kind` ("queries" or "latents"): callers skip the copy."""
        if self.done:
            return False
        entry = self._layers.get(layer)
        budget = self.settings.tokens if kind == "queries" else self.settings.records
        return entry is None or getattr(entry, f"n_{kind}") < budget

    def _add(self, layer: int, t: "torch.Tensor", kind: str, budget: int, ndim: int) -> None:
        if t.ndim != ndim or t.shape[-1] != 512:
            want = "[n, H, 512]" if ndim == 3 else "[n, 512]"
            raise ValueError(f"capture of layer {layer}: {kind} must be {want}, got {list(t.shape)}")
        with self._lock:
            if self.done:
                return
            entry = self._layers.setdefault(layer, _Layer())
            have = getattr(entry, f"n_{kind}")
            take = min(int(t.shape[0]), budget - have)
            if take <= 0:
                return
            getattr(entry, kind).append(t[:take].detach().float().to("cpu", copy=True))
            setattr(entry, f"n_{kind}", have + take)
            if self._complete():
                self._write(complete=True)

    def _complete(self) -> bool:
        if self._expected is None:
            return False
        s = self.settings
        return all(self._layers[i].n_queries >= s.tokens and self._layers[i].n_latents >= s.records
                   for i in self._expected)

    def counts(self) -> dict[int, tuple[int, int]]:
        """Per layer: (decode queries, latents) kept so far."""
        return {i: (e.n_queries, e.n_latents) for i, e in sorted(self._layers.items())}

    def close(self) -> Path | None:
        """At shutdown: write what was captured, if not written yet and every layer has at
        least one query and one latent (else nothing is written and the log says why)."""
        with self._lock:
            if self.done:
                return self.written
            short = [i for i, e in sorted(self._layers.items()) if e.n_queries == 0 or e.n_latents == 0]
            if not self._layers or short:
                log.warning("remnant capture: nothing written to %s: %s", self.settings.path,
                            "no CSA layer was seen" if not self._layers else
                            f"CSA layers {short} have no decode query or no latent yet")
                return None
            return self._write(complete=False)

    def _write(self, complete: bool) -> Path:
        import torch

        from remnant.calibration.captures import Captures, LayerCapture, save_captures

        s = self.settings
        layers = {i: LayerCapture(q=torch.cat(e.queries), k=torch.cat(e.latents))
                  for i, e in sorted(self._layers.items()) if e.n_queries and e.n_latents}
        params = {**self.params, "tokens": s.tokens, "records": s.records, "complete": complete,
                  "counts": {str(i): {"queries": e.n_queries, "latents": e.n_latents}
                             for i, e in sorted(self._layers.items())}}
        path = save_captures(Captures(model_id=s.model_id, source=s.source, layers=layers,
                                      fingerprint="", params=params), s.path)
        self.written = path
        self._layers = {i: _Layer(n_queries=e.n_queries, n_latents=e.n_latents) for i, e in self._layers.items()}
        log.warning("remnant capture: wrote %s (%s; %d CSA layers)", path,
                    "budget reached" if complete else "short of the budget", len(layers))
        return path
