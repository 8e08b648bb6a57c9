"""Recording calibration captures while a server runs (SGLang's plugin, the embedded engine).

A capture server runs in native mode; its CSA layers hand every decode query (after RoPE)
and every C4 latent (before FP8 quantization) to a CaptureRecorder, which keeps the first
`tokens` decode queries and the first `records` latents of each CSA layer on the CPU. When
every CSA layer has both, it writes one remnant-capture/1 file (/2 with the parts below)
(remnant.calibration.captures, atomically) and ignores what comes later. Short of that,
the file is written with what the recorder has when the run asks for it
(`write_requested`: a marker file beside the capture, then the server's /flush_cache) or
at shutdown (`close()`). The request matters for SGLang, which stops its scheduler
processes with SIGKILL, so no exit handler runs there. Recording only copies: the server
computes as it would without it.

The embedded engine also hands it what the fidelity of the KV parts beyond C4 records
needs (remnant.calibration.fidelity_parts; remnant-capture/2): every layer's window
latents and decode queries, the indexer's queries, weights and keys of CSA layers, the
C128 latents of HCA layers, and the compressed latents and index keys the same compressor
inputs give when its state is held in bf16. Rows that belong together (a token's query and
its indexer query; a record's latent, its bf16-state twin and its index key) are handed
over in one call and kept or dropped together, so they stay aligned. Budgets: `tokens`
decode queries per layer, `records` C4 latents and `records` window latents per layer, and
up to records * 4 / 128 C128 latents per HCA layer (the C4 budget's span of tokens; a
capture is complete without them, since short sequences close no 128-token block).

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


#: Parts by what they are aligned with: a call hands over every part of its group at once.
DECODE_PARTS = ("queries", "index_queries", "index_weights")
RECORD_PARTS = ("latents", "latents_bf16", "index_keys", "index_keys_bf16")
#: The file's tensor name of each part (remnant.calibration.captures).
_TENSOR = {"queries": "q", "latents": "k", "window": "window", "index_queries": "index_q",
           "index_weights": "index_w", "index_keys": "index_k", "latents_bf16": "k_bf16",
           "index_keys_bf16": "index_k_bf16"}


@dataclass
class _Layer:
    ratio: int = 4
    parts: dict = field(default_factory=dict)  # part -> list of tensors
    n_queries: int = 0
    n_latents: int = 0
    n_window: int = 0


class CaptureRecorder:
    """Keeps the first `settings.tokens` decode queries and `settings.records` C4 latents of
    every CSA layer (and, where the server hands them over, the parts beyond C4 records:
    the module docstring), and writes them once as a capture file.

    layers: the layers a complete capture covers, when known (the file is written as soon as
    each has its budget); `expect` can give them later. ratios: each layer's compress ratio
    (layer -> 0, 4 or 128): a recorder given ratios also waits for every layer's window
    latents and records HCA and window-only layers; without, `layers` are CSA layers and
    only their queries and C4 latents count (SGLang's plugin). params: how the capture was
    made (server, versions, settings), stored in the file's metadata beside the settings.
    """

    def __init__(self, settings: CaptureSettings, params: dict | None = None,
                 layers: list[int] | None = None, ratios: dict[int, int] | None = None) -> None:
        settings.check()
        self.settings = settings
        self.params = dict(params or {})
        self._layers: dict[int, _Layer] = {}
        self._expected: set[int] | None = None
        self._ratios: dict[int, int] | None = None
        self._lock = threading.Lock()
        self.written: Path | None = None
        if layers is not None:
            self.expect(layers, ratios)

    @property
    def done(self) -> bool:
        """Written: later queries and latents are ignored."""
        return self.written is not None

    def expect(self, layers: list[int], ratios: dict[int, int] | None = None) -> None:
        """The layers a complete capture covers (CSA layers, or every layer with `ratios`)."""
        self._expected = set(layers)
        self._ratios = None if ratios is None else {i: int(ratios[i]) for i in layers}
        for layer in layers:
            self._layers.setdefault(layer, _Layer(ratio=4 if ratios is None else int(ratios[layer])))

    def _budget(self, layer: int, kind: str) -> int:
        s = self.settings
        if kind == "queries":
            return s.tokens
        if kind == "latents":
            ratio = self._layers[layer].ratio if layer in self._layers else 4
            # An HCA layer's records span ratio tokens each: as many tokens as the C4 budget's.
            return s.records if ratio != 128 else max(1, s.records * 4 // 128)
        return s.records

    def add_queries(self, layer: int, q: "torch.Tensor", index_q: "torch.Tensor | None" = None,
                    index_w: "torch.Tensor | None" = None) -> None:
        """Decode queries of one layer, [n, H, 512] (after RoPE), any float dtype/device; on a
        CSA layer also the indexer's queries [n, Hi, d] and head weights [n, Hi] of the same
        tokens (kept or dropped with them)."""
        self._add(layer, "queries", {"queries": (q, 3), "index_queries": (index_q, 3),
                                     "index_weights": (index_w, 2)})

    def add_latents(self, layer: int, k: "torch.Tensor", k_bf16: "torch.Tensor | None" = None,
                    index_k: "torch.Tensor | None" = None, index_k_bf16: "torch.Tensor | None" = None) -> None:
        """Compressed latents of one layer, [n, 512] (before FP8 quantization): C4 on CSA
        layers, C128 on HCA layers; with, row for row, the latents from the same compressor
        inputs held in bf16 [n, 512] and (CSA) the index keys [n, d] and their bf16-state
        twin."""
        self._add(layer, "latents", {"latents": (k, 2), "latents_bf16": (k_bf16, 2), "index_keys": (index_k, 2),
                                     "index_keys_bf16": (index_k_bf16, 2)})

    def add_window(self, layer: int, kv: "torch.Tensor") -> None:
        """Window latents of one layer, [n, 512]: the K = V its window records hold."""
        self._add(layer, "window", {"window": (kv, 2)})

    def wants(self, layer: int, kind: str) -> bool:
        """Whether `layer` still takes `kind` ("queries", "latents" or "window"): callers skip
        the copy."""
        if self.done or not self._records(layer, kind):
            return False
        entry = self._layers.get(layer)
        return entry is None or getattr(entry, f"n_{kind}") < self._budget(layer, kind)

    def _records(self, layer: int, part: str) -> bool:
        """Whether this recorder keeps `part` of `layer`: a recorder given no ratios keeps its
        (CSA) layers' queries and latents only, so its file stays remnant-capture/1."""
        if self._expected is not None and layer not in self._expected:
            return False
        return self._ratios is not None or part in ("queries", "latents")

    def _add(self, layer: int, kind: str, parts: dict) -> None:
        parts = {part: v for part, v in parts.items() if self._records(layer, part)}
        if kind not in parts:
            return
        lead = parts[kind][0]
        for part, (t, ndim) in parts.items():
            if t is None:
                continue
            if t.ndim != ndim or (part in ("queries", "latents", "window") and t.shape[-1] != 512) \
                    or t.shape[0] != lead.shape[0]:
                want = {"queries": "[n, H, 512]", "index_queries": "[n, Hi, d]", "index_weights": "[n, Hi]",
                        "index_keys": "[n, d]", "index_keys_bf16": "[n, d]"}.get(part, "[n, 512]")
                raise ValueError(f"capture of layer {layer}: {part} must be {want} with n = "
                                 f"{lead.shape[0]}, got {list(t.shape)}")
        with self._lock:
            if self.done:
                return
            entry = self._layers.setdefault(layer, _Layer())
            have = getattr(entry, f"n_{kind}")
            take = min(int(lead.shape[0]), self._budget(layer, kind) - have)
            if take <= 0:
                return
            for part, (t, _) in parts.items():
                if t is not None:
                    entry.parts.setdefault(part, []).append(t[:take].detach().float().to("cpu", copy=True))
            setattr(entry, f"n_{kind}", have + take)
            if self._complete():
                self._write(complete=True)

    def _complete(self) -> bool:
        if self._expected is None:
            return False
        for i in self._expected:
            e = self._layers[i]
            # C128 latents come one per 128 tokens of a sequence, none from shorter ones: an HCA
            # layer takes what it has when the rest is complete (params' counts_all say how many).
            kinds = ["queries"] + (["latents"] if e.ratio == 4 else []) + (["window"] if self._ratios is not None else [])
            if any(getattr(e, f"n_{kind}") < self._budget(i, kind) for kind in kinds):
                return False
        return True

    def counts(self) -> dict[int, tuple[int, int]]:
        """Per layer: (decode queries, compressed latents) kept so far."""
        return {i: (e.n_queries, e.n_latents) for i, e in sorted(self._layers.items())}

    def close(self) -> Path | None:
        """At shutdown: write what was captured, if not written yet and every layer has at
        least one query and one latent (else nothing is written and the log says why)."""
        with self._lock:
            if self.done:
                return self.written
            short = [i for i, e in sorted(self._layers.items()) if e.ratio == 4 and (e.n_queries == 0 or e.n_latents == 0)]
            if not any(e.ratio == 4 for e in self._layers.values()) or short:
                log.warning("remnant capture: nothing written to %s: %s", self.settings.path,
                            "no CSA layer was seen" if not self._layers else
                            f"CSA layers {short} have no decode query or no latent yet")
                return None
            return self._write(complete=False)

    def _write(self, complete: bool) -> Path:
        import torch

        from remnant.calibration.captures import Captures, LayerCapture, OtherLayerCapture, save_captures

        s = self.settings

        def cat(e: _Layer, part: str):
            # A part handed over with only some calls (none here) would misalign its rows.
            got = e.parts.get(part)
            if not got:
                return None
            t = torch.cat(got)
            lead = e.n_queries if part in DECODE_PARTS else e.n_latents if part in RECORD_PARTS else e.n_window
            return t if t.shape[0] == lead else None

        layers, other, skipped = {}, {}, []
        for i, e in sorted(self._layers.items()):
            if e.ratio == 4:
                if e.n_queries and e.n_latents:
                    layers[i] = LayerCapture(**{_TENSOR[p]: cat(e, p) for p in ("queries", "latents", "window",
                                                                                "index_queries", "index_weights",
                                                                                "index_keys", "latents_bf16",
                                                                                "index_keys_bf16")})
            elif e.n_queries and e.n_window:
                k = cat(e, "latents") if e.ratio else None
                other[i] = OtherLayerCapture(ratio=e.ratio, q=cat(e, "queries"), window=cat(e, "window"), k=k,
                                             k_bf16=cat(e, "latents_bf16") if k is not None else None)
            else:
                skipped.append(i)
        params = {**self.params, "tokens": s.tokens, "records": s.records, "complete": complete,
                  "counts": {str(i): {"queries": e.n_queries, "latents": e.n_latents}
                             for i, e in sorted(self._layers.items()) if e.ratio == 4}}
        if self._ratios is not None:
            params["counts_all"] = {str(i): {"ratio": e.ratio, "queries": e.n_queries, "latents": e.n_latents,
                                             "window": e.n_window} for i, e in sorted(self._layers.items())}
        path = save_captures(Captures(model_id=s.model_id, source=s.source, layers=layers,
                                      fingerprint="", params=params, other_layers=other), s.path)
        self.written = path
        self._layers = {i: _Layer(ratio=e.ratio, n_queries=e.n_queries, n_latents=e.n_latents, n_window=e.n_window)
                        for i, e in self._layers.items()}
        log.warning("remnant capture: wrote %s (%s; %d CSA layers, %d others%s)", path,
                    "budget reached" if complete else "short of the budget", len(layers), len(other),
                    f"; layers {skipped} had no decode query or window latent and are left out" if skipped else "")
        return path
