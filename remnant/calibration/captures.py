"""Calibration captures of CSA layers: what the retention policies read.

Per CSA layer a capture holds the decode queries q float32 [T, H, 512] as attention sees
them (after RoPE) and the C4 latents k float32 [n, 512] (K = V, before FP8 quantization).

A capture may also hold what the fidelity of the KV parts beyond C4 records needs
(remnant.calibration.fidelity_parts): per CSA layer its window latents, the indexer's
decode queries, head weights and keys (aligned with q and k row for row), and the C4
latents and index keys the same compressor inputs give when its state is held in bf16;
per HCA layer (`other_layers`, compress ratio 128) its decode queries, window latents,
C128 latents and their bf16-state twin; per window-only layer (ratio 0) its decode
queries and window latents.

File format: safetensors (no pickles), float32 little-endian tensors:
    layers.<L>.q, layers.<L>.k                   every CSA layer (v1: nothing else)
    layers.<L>.window | index_q | index_w | index_k | k_bf16 | index_k_bf16   optional (v2)
    other.<L>.q, other.<L>.window, [other.<L>.k, other.<L>.k_bf16]           (v2)
and header metadata
    {"format": "remnant-capture/1" or "/2", "model_id": str, "source": str,
     "params": JSON string of how the capture was made,
     v2 only: "ratios": JSON object, other layer -> its compress ratio (0 or 128)}.
Captures with nothing beyond v1's tensors are written as v1, byte for byte as before, so a
reader that knows only v1 still reads them and their fingerprints hold; load_captures
reads both. save_captures writes the header itself (keys in a fixed order, tensors by layer then q, k)
so the same captures always give the same bytes, hence the same fingerprint: safetensors'
own writer orders the metadata keys differently from one call to the next. Any
safetensors reader opens the file.

The command `python -m remnant.cli.captures --synthetic --out FILE [--seed N]` writes a
synthetic capture file (synthetic_captures with default parameters but the seed).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from remnant.kv.formats import HCA_RATIO, HEAD_DIM, NOPE_DIM
from remnant.records.files import atomic_write

FORMAT = "remnant-capture/1"
#: v1 plus the parts beyond C4 records (the module docstring).
FORMAT_V2 = "remnant-capture/2"
FORMATS = (FORMAT, FORMAT_V2)
#: The generator's name in a synthetic capture's params, hence in its fingerprint: the name
#: it was first recorded under (this module was remnant.kv.captures), kept so fingerprints hold.
SYNTHETIC_GENERATOR = "remnant.kv.captures.synthetic_captures/1"
#: The caveat every report measured on synthetic_captures carries.
SYNTHETIC_LIMIT = (
    "synthetic latents with heavy-tailed channels and planted high-energy channels, "
    "not captures of DeepSeek-V4: says how policies rank on that structure, not on the real model"
)
_NAME = re.compile(r"^(layers|other)\.(0|[1-9][0-9]*)\.(q|k|window|index_q|index_w|index_k|k_bf16|index_k_bf16)$")
#: A CSA layer's optional tensors (v2), and the dimensions each has.
CSA_EXTRAS = {"window": 2, "index_q": 3, "index_w": 2, "index_k": 2, "k_bf16": 2, "index_k_bf16": 2}


@dataclass
class LayerCapture:
    """Calibration data of one CSA layer.

    q: float32 [T, H, 512] decode queries (after RoPE), T tokens, H query heads.
    k: float32 [n, 512] C4 latents (K = V), before FP8 quantization.
    The parts beyond C4 records (None where the capture lacks them; v2 files):
    window: float32 [m, 512] window latents (K = V of the sliding-window records).
    index_q: float32 [T, Hi, d] the indexer's queries of q's tokens; index_w: float32
        [T, Hi] its head weights (scores = sum_h w relu(q_h . key)).
    index_k: float32 [n, d] the indexer's keys of k's records, before quantization.
    k_bf16, index_k_bf16: k's and index_k's rows from the same compressor inputs held in
        bf16 (host.compressor_state_dtype=bfloat16).
    """

    q: torch.Tensor
    k: torch.Tensor
    window: torch.Tensor | None = None
    index_q: torch.Tensor | None = None
    index_w: torch.Tensor | None = None
    index_k: torch.Tensor | None = None
    k_bf16: torch.Tensor | None = None
    index_k_bf16: torch.Tensor | None = None

    def check(self, name: str = "capture") -> None:
        """ValueError naming `name`.q / `name`.k (or the extra tensor) unless q is [T, H, 512]
        and k is [n, 512] floating tensors with T, H, n >= 1 and only finite values, and
        each extra present has its shape: window [m, 512], index_q [T, Hi, d], index_w
        [T, Hi], index_k and index_k_bf16 [n, d], k_bf16 [n, 512]."""
        _check_tensor(self.q, f"{name}.q", ndim=3)
        _check_tensor(self.k, f"{name}.k", ndim=2)
        t, n = self.q.shape[0], self.k.shape[0]
        want = {"window": None, "k_bf16": (n, HEAD_DIM)}
        if self.index_q is not None:
            want.update(index_w=(t, self.index_q.shape[1]))
        if self.index_k is not None:
            want.update(index_k_bf16=tuple(self.index_k.shape))
        if (self.index_q is None) != (self.index_w is None):
            raise ValueError(f"{name}: index_q and index_w come together; got only one")
        for kind, ndim in CSA_EXTRAS.items():
            t_ = getattr(self, kind)
            if t_ is None:
                continue
            _check_tensor(t_, f"{name}.{kind}", ndim, last=HEAD_DIM if kind in ("window", "k_bf16") else None)
            shape = want.get(kind)
            if kind == "index_q" and t_.shape[0] != t:
                raise ValueError(f"{name}.index_q has {t_.shape[0]} tokens; q has {t}")
            if kind == "index_k" and t_.shape[0] != n:
                raise ValueError(f"{name}.index_k has {t_.shape[0]} rows; k has {n}")
            if shape is not None and tuple(t_.shape) != shape:
                raise ValueError(f"{name}.{kind} must have shape {list(shape)}, got {list(t_.shape)}")

    def extras(self) -> dict[str, torch.Tensor]:
        """The parts beyond q and k this capture holds, by tensor name."""
        return {kind: getattr(self, kind) for kind in CSA_EXTRAS if getattr(self, kind) is not None}


@dataclass
class OtherLayerCapture:
    """Capture of a layer that is not CSA: HCA (ratio 128) or window-only (ratio 0).

    ratio: the layer's compress ratio. q: float32 [T, H, 512] decode queries (after RoPE).
    window: float32 [m, 512] window latents. k: float32 [n, 512] C128 latents (HCA layers;
    None on window-only ones, or an HCA layer that completed no 128-token block); k_bf16:
    k's rows from the compressor inputs held in bf16 (None where not recorded).
    """

    ratio: int
    q: torch.Tensor
    window: torch.Tensor
    k: torch.Tensor | None = None
    k_bf16: torch.Tensor | None = None

    def check(self, name: str = "capture") -> None:
        """ValueError naming the tensor for a bad ratio, shape or value."""
        if self.ratio not in (0, HCA_RATIO):
            raise ValueError(f"{name}: ratio={self.ratio!r}; a layer beside the CSA ones has ratio 0 or {HCA_RATIO}")
        _check_tensor(self.q, f"{name}.q", ndim=3)
        _check_tensor(self.window, f"{name}.window", ndim=2)
        if self.k is not None:
            if self.ratio != HCA_RATIO:
                raise ValueError(f"{name}.k: a window-only layer (ratio 0) has no compressed latents")
            _check_tensor(self.k, f"{name}.k", ndim=2)
        if self.k_bf16 is not None:
            if self.k is None or self.k_bf16.shape != self.k.shape:
                raise ValueError(f"{name}.k_bf16 must have k's shape "
                                 f"{None if self.k is None else list(self.k.shape)}, got {list(self.k_bf16.shape)}")
            _check_tensor(self.k_bf16, f"{name}.k_bf16", ndim=2)


@dataclass
class Captures:
    """Calibration captures of a model's CSA layers.

    layers: model layer index -> LayerCapture, ascending: the CSA layers. fingerprint:
    64-hex sha256 of the capture file, or of the canonical JSON of `params` for synthetic
    captures. params: how the captures were made (the generator's arguments for synthetic
    ones). other_layers: the HCA and window-only layers (v2 files; empty otherwise).
    """

    model_id: str
    source: str
    layers: dict[int, LayerCapture]
    fingerprint: str
    params: dict = field(default_factory=dict)
    other_layers: dict[int, OtherLayerCapture] = field(default_factory=dict)

    @property
    def format(self) -> str:
        """The file format these captures are written in: v1 unless they hold a part
        beyond the CSA layers' q and k."""
        if self.other_layers or any(c.extras() for c in self.layers.values()):
            return FORMAT_V2
        return FORMAT


def _check_tensor(t: object, name: str, ndim: int, last: int | None = HEAD_DIM) -> None:
    """last: the last dimension's required size (None: any, as the indexer's d and heads)."""
    tail = "512" if last == HEAD_DIM else "d"
    want = {3: f"[T, H, {tail}]", 2: f"[n, {tail}]"}[ndim]
    if not isinstance(t, torch.Tensor) or not t.is_floating_point():
        got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name} must be a float32 tensor {want}, got {got}")
    if t.ndim != ndim or (last is not None and t.shape[-1] != last) or 0 in t.shape:
        raise ValueError(f"{name} must have shape {want} with no empty dimension, got {list(t.shape)}")
    if not torch.isfinite(t).all():
        bad = int((~torch.isfinite(t)).sum())
        raise ValueError(f"{name} has {bad} non-finite values (NaN or inf)")


def _canonical(params: dict) -> str:
    return json.dumps(params, sort_keys=True, separators=(",", ":"), allow_nan=False)


def save_captures(c: Captures, path: str | os.PathLike) -> Path:
    """Write captures as a safetensors file (atomically); returns the path.

    Tensors are stored as float32; ValueError naming the tensor for a bad shape or a
    non-finite value. The written file's sha256 is the fingerprint load_captures reports.
    The format is c.format: v1 unless the captures hold a part beyond v1's.
    """
    path = Path(path)
    if not c.layers:
        raise ValueError(f"{path}: captures have no layers")
    fmt = c.format
    meta = {"format": fmt, "model_id": str(c.model_id), "source": str(c.source), "params": _canonical(c.params)}
    if fmt == FORMAT_V2:
        meta["ratios"] = _canonical({str(i): o.ratio for i, o in sorted(c.other_layers.items())})
    header: dict = {"__metadata__": meta}
    tensors: list[tuple[str, torch.Tensor]] = []
    for layer in sorted(c.layers):
        cap = c.layers[layer]
        cap.check(f"layers.{layer}")
        tensors += [(f"layers.{layer}.q", cap.q), (f"layers.{layer}.k", cap.k)]
        tensors += [(f"layers.{layer}.{kind}", t) for kind, t in cap.extras().items()]
    for layer in sorted(c.other_layers):
        other = c.other_layers[layer]
        other.check(f"other.{layer}")
        tensors += [(f"other.{layer}.{kind}", getattr(other, kind)) for kind in ("q", "window", "k", "k_bf16")
                    if getattr(other, kind) is not None]
    blobs: list[bytes] = []
    offset = 0
    for name, t in tensors:
        blob = t.detach().to("cpu", torch.float32).contiguous().numpy().astype("<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    head = json.dumps(header, separators=(",", ":")).encode("utf-8")
    head += b" " * (-len(head) % 8)  # safetensors pads its header to 8-byte alignment
    atomic_write(path, [len(head).to_bytes(8, "little"), head, *blobs])
    return path


def load_captures(path: str | os.PathLike) -> Captures:
    """Read a capture file written by save_captures (or any safetensors file in that format),
    remnant-capture/1 or /2.

    fingerprint is the sha256 of the file. ValueError naming the file (and the tensor or
    metadata key) for a missing file, a file that is not safetensors, another format, a
    tensor name save_captures does not write (a v1 file holds only layers.<L>.q and
    layers.<L>.k), a layer missing q or k, a non-float32 tensor, a bad shape (see
    LayerCapture.check, OtherLayerCapture.check), or non-finite values.
    """
    from safetensors import SafetensorError, safe_open

    from remnant.records.provenance import sha256_file

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: capture file does not exist")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            names = list(f.keys())
            tensors = {}
            for name in names:
                if _NAME.match(name) is None:
                    raise ValueError(f"{path}: tensor {name!r} is not layers.<L>.q or layers.<L>.k" + (
                        "" if meta.get("format") != FORMAT_V2 else
                        f" (or layers.<L>.{'|'.join(CSA_EXTRAS)}, other.<L>.q|window|k|k_bf16)"))
                tensors[name] = f.get_tensor(name)
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{path}: not a readable safetensors file: {e}") from None
    fmt = meta.get("format")
    if fmt not in FORMATS:
        raise ValueError(f"{path}: metadata format is {fmt!r}; expected one of {', '.join(map(repr, FORMATS))}")
    for key in ("model_id", "source", "params") + (("ratios",) if fmt == FORMAT_V2 else ()):
        if key not in meta:
            raise ValueError(f"{path}: metadata {key!r} is missing")
    params = _json_object(path, meta, "params")
    ratios = _json_object(path, meta, "ratios") if fmt == FORMAT_V2 else {}

    for name, t in tensors.items():
        if t.dtype != torch.float32:
            raise ValueError(f"{path}: tensor {name} is {t.dtype}; expected float32")
        group, _, kind = _NAME.match(name).groups()
        if fmt == FORMAT and (group != "layers" or kind not in ("q", "k")):
            raise ValueError(f"{path}: tensor {name!r} is not layers.<L>.q or layers.<L>.k ({FORMAT} holds only "
                             f"those; the parts beyond them need {FORMAT_V2})")
        if group == "other" and kind not in ("q", "window", "k", "k_bf16"):
            raise ValueError(f"{path}: tensor {name!r}: other.<L> holds q, window, k and k_bf16 only")
    found = sorted({int(m.group(2)) for m in map(_NAME.match, names) if m.group(1) == "layers"})
    if not found:
        raise ValueError(f"{path}: no layers.<L>.q / layers.<L>.k tensors")
    layers: dict[int, LayerCapture] = {}
    for layer in found:
        got = {kind: tensors.get(f"layers.{layer}.{kind}") for kind in ("q", "k", *CSA_EXTRAS)}
        for kind in ("q", "k"):
            if got[kind] is None:
                raise ValueError(f"{path}: tensor layers.{layer}.{kind} is missing")
        cap = LayerCapture(**got)
        cap.check(f"{path}: tensor layers.{layer}")
        layers[layer] = cap
    other: dict[int, OtherLayerCapture] = {}
    for layer in sorted({int(m.group(2)) for m in map(_NAME.match, names) if m.group(1) == "other"}):
        if str(layer) not in ratios:
            raise ValueError(f"{path}: metadata 'ratios' names no ratio for other.{layer}")
        got = {kind: tensors.get(f"other.{layer}.{kind}") for kind in ("q", "window", "k", "k_bf16")}
        for kind in ("q", "window"):
            if got[kind] is None:
                raise ValueError(f"{path}: tensor other.{layer}.{kind} is missing")
        cap = OtherLayerCapture(ratio=ratios[str(layer)], **got)
        cap.check(f"{path}: tensor other.{layer}")
        other[layer] = cap
    return Captures(model_id=meta["model_id"], source=meta["source"], layers=layers,
                    fingerprint=sha256_file(path), params=params, other_layers=other)


def _json_object(path: Path, meta: dict, key: str) -> dict:
    try:
        value = json.loads(meta[key])
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: metadata {key!r} is not JSON: {e.msg}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: metadata {key!r} must be a JSON object")
    return value


def synthetic_captures(layers=(2, 4), heads: int = 64, queries: int = 32, records: int = 512,
                       seed: int = 0, planted: int = 16, planted_gain: float = 8.0,
                       tail_df: float = 3.0, model_id: str = "synthetic") -> Captures:
    """Synthetic calibration captures with known important channels, for tests and a first try.

    Per layer L (numpy Generator seeded with [seed, L], so each layer is reproducible on its
    own and independent of the others):
      - channel scales s_c = |t_c| / median(|t|), t_c ~ Student-t(tail_df), c in 0..511:
        heavy-tailed, as real latents have a few outlier channels;
      - `planted` NoPE channels drawn uniformly without replacement from 0..447 (so not
        at the start, where `prefix` would find them by luck) get s_c = planted_gain *
        max(s_c, 1);
      - latents k[j, c] = s_c * z, z ~ N(0, 1), k: float32 [records, 512];
      - queries weight the same channels: per head a_hc = s_c * exp(0.25 * N(0, 1)), and
        q[t, h, c] = g_h * a_hc * z, with g_h chosen so that the logit q.k / sqrt(512)
        has standard deviation 2 for every head; the planted channels carry most of the
        logit variance, so attention scores are dominated by them. q: float32
        [queries, heads, 512].
    source = "synthetic"; params = the arguments above plus "generator" (the generator's
    name and version); fingerprint = sha256 of the canonical JSON of params (sorted keys,
    no spaces). The planted indices are not stored; synthetic_planted(params, layer)
    recomputes them.
    """
    layers = sorted(layers)
    _check_synthetic(layers, heads, queries, records, planted, planted_gain, tail_df)
    params = {"generator": SYNTHETIC_GENERATOR, "model_id": model_id, "layers": layers,
              "heads": heads, "queries": queries, "records": records, "seed": seed,
              "planted": planted, "planted_gain": float(planted_gain), "tail_df": float(tail_df)}
    out = {layer: _synthetic_layer(params, layer)[0] for layer in layers}
    fingerprint = hashlib.sha256(_canonical(params).encode("utf-8")).hexdigest()
    return Captures(model_id=model_id, source="synthetic", layers=out, fingerprint=fingerprint,
                    params=params)


def synthetic_planted(params: dict, layer: int) -> torch.Tensor:
    """The planted NoPE channels of `layer` in synthetic captures made with `params`:
    int64 [planted], sorted."""
    return _synthetic_layer(params, layer, planted_only=True)[1]


def _synthetic_layer(params: dict, layer: int, planted_only: bool = False):
    import numpy as np

    rng = np.random.default_rng([params["seed"], layer])
    t = np.abs(rng.standard_t(params["tail_df"], size=HEAD_DIM))
    scale = t / np.median(t)
    pos = np.sort(rng.choice(NOPE_DIM, size=params["planted"], replace=False))
    planted = torch.from_numpy(pos.astype(np.int64))
    if planted_only:
        return None, planted
    scale[pos] = params["planted_gain"] * np.maximum(scale[pos], 1.0)
    k = rng.standard_normal((params["records"], HEAD_DIM)) * scale
    a = scale[None, :] * np.exp(0.25 * rng.standard_normal((params["heads"], HEAD_DIM)))
    # Var(q.k) for one head = sum_c a_hc^2 s_c^2; scale each head to a logit std of 2.
    gain = 2.0 * math.sqrt(HEAD_DIM) / np.sqrt((a ** 2 * scale[None, :] ** 2).sum(-1))
    q = rng.standard_normal((params["queries"], params["heads"], HEAD_DIM)) * (a * gain[:, None])
    cap = LayerCapture(q=torch.from_numpy(q.astype(np.float32)), k=torch.from_numpy(k.astype(np.float32)))
    return cap, planted


def _check_synthetic(layers, heads, queries, records, planted, planted_gain, tail_df) -> None:
    if not layers or len(set(layers)) != len(layers) or any(
            isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in layers):
        raise ValueError(f"layers={layers!r} must be distinct non-negative layer indices, at least one")
    for name, value in (("heads", heads), ("queries", queries), ("records", records)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be an integer >= 1")
    if isinstance(planted, bool) or not isinstance(planted, int) or not 0 <= planted <= NOPE_DIM:
        raise ValueError(f"planted={planted!r} must be an integer in 0..{NOPE_DIM}")
    if not planted_gain > 0:
        raise ValueError(f"planted_gain={planted_gain!r} must be > 0")
    if not tail_df > 0:
        raise ValueError(f"tail_df={tail_df!r} must be > 0")
