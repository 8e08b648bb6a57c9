"""Calibration captures of CSA layers: what the retention policies read.

Per CSA layer a capture holds the decode queries q float32 [T, H, 512] as attention sees
them (after RoPE) and the C4 latents k float32 [n, 512] (K = V, before FP8 quantization).

File format: safetensors (no pickles), one pair of tensors per layer, `layers.<L>.q` and
`layers.<L>.k` (float32, little-endian), and header metadata
    {"format": "remnant-capture/1", "model_id": str, "source": str,
     "params": JSON string of how the capture was made}.
save_captures writes the header itself (keys in a fixed order, tensors by layer then q, k)
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

from remnant.kv.formats import HEAD_DIM, NOPE_DIM
from remnant.records.files import atomic_write

FORMAT = "remnant-capture/1"
#: The generator's name in a synthetic capture's params, hence in its fingerprint: the name
#: it was first recorded under (this module was remnant.kv.captures), kept so fingerprints hold.
SYNTHETIC_GENERATOR = "remnant.kv.captures.synthetic_captures/1"
#: The caveat every report measured on synthetic_captures carries.
SYNTHETIC_LIMIT = (
    "synthetic latents with heavy-tailed channels and planted high-energy channels, "
    "not captures of DeepSeek-V4: says how policies rank on that structure, not on the real model"
)
_NAME = re.compile(r"^layers\.(0|[1-9][0-9]*)\.(q|k)$")


@dataclass
class LayerCapture:
    """Calibration data of one CSA layer.

    q: float32 [T, H, 512] decode queries (after RoPE), T tokens, H query heads.
    k: float32 [n, 512] C4 latents (K = V), before FP8 quantization.
    """

    q: torch.Tensor
    k: torch.Tensor

    def check(self, name: str = "capture") -> None:
        """ValueError naming `name`.q / `name`.k unless q is [T, H, 512] and k is [n, 512]
        floating tensors with T, H, n >= 1 and only finite values."""
        _check_tensor(self.q, f"{name}.q", ndim=3)
        _check_tensor(self.k, f"{name}.k", ndim=2)


@dataclass
class Captures:
    """Calibration captures of a model's CSA layers.

    layers: model layer index -> LayerCapture, ascending. fingerprint: 64-hex sha256 of the
    capture file, or of the canonical JSON of `params` for synthetic captures.
    params: how the captures were made (the generator's arguments for synthetic ones).
    """

    model_id: str
    source: str
    layers: dict[int, LayerCapture]
    fingerprint: str
    params: dict = field(default_factory=dict)


def _check_tensor(t: object, name: str, ndim: int) -> None:
    want = "[T, H, 512]" if ndim == 3 else "[n, 512]"
    if not isinstance(t, torch.Tensor) or not t.is_floating_point():
        got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name} must be a float32 tensor {want}, got {got}")
    if t.ndim != ndim or t.shape[-1] != HEAD_DIM or 0 in t.shape:
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
    """
    path = Path(path)
    if not c.layers:
        raise ValueError(f"{path}: captures have no layers")
    header: dict = {"__metadata__": {"format": FORMAT, "model_id": str(c.model_id),
                                     "source": str(c.source), "params": _canonical(c.params)}}
    blobs: list[bytes] = []
    offset = 0
    for layer in sorted(c.layers):
        cap = c.layers[layer]
        cap.check(f"layers.{layer}")
        for kind, t in (("q", cap.q), ("k", cap.k)):
            blob = t.detach().to("cpu", torch.float32).contiguous().numpy().astype("<f4").tobytes()
            header[f"layers.{layer}.{kind}"] = {"dtype": "F32", "shape": list(t.shape),
                                                "data_offsets": [offset, offset + len(blob)]}
            blobs.append(blob)
            offset += len(blob)
    head = json.dumps(header, separators=(",", ":")).encode("utf-8")
    head += b" " * (-len(head) % 8)  # safetensors pads its header to 8-byte alignment
    atomic_write(path, [len(head).to_bytes(8, "little"), head, *blobs])
    return path


def load_captures(path: str | os.PathLike) -> Captures:
    """Read a capture file written by save_captures (or any safetensors file in that format).

    fingerprint is the sha256 of the file. ValueError naming the file (and the tensor or
    metadata key) for a missing file, a file that is not safetensors, another format, a
    tensor name other than layers.<L>.q / layers.<L>.k, a layer missing q or k, a
    non-float32 tensor, shapes other than [T, H, 512] and [n, 512], or non-finite values.
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
                    raise ValueError(f"{path}: tensor {name!r} is not layers.<L>.q or layers.<L>.k")
                tensors[name] = f.get_tensor(name)
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{path}: not a readable safetensors file: {e}") from None
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path}: metadata format is {meta.get('format')!r}; expected {FORMAT!r}")
    for key in ("model_id", "source", "params"):
        if key not in meta:
            raise ValueError(f"{path}: metadata {key!r} is missing")
    try:
        params = json.loads(meta["params"])
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: metadata 'params' is not JSON: {e.msg}") from None
    if not isinstance(params, dict):
        raise ValueError(f"{path}: metadata 'params' must be a JSON object")

    found = sorted({int(_NAME.match(n).group(1)) for n in names})
    if not found:
        raise ValueError(f"{path}: no layers.<L>.q / layers.<L>.k tensors")
    layers: dict[int, LayerCapture] = {}
    for layer in found:
        pair = {}
        for kind, ndim in (("q", 3), ("k", 2)):
            name = f"layers.{layer}.{kind}"
            if name not in tensors:
                raise ValueError(f"{path}: tensor {name} is missing")
            t = tensors[name]
            if t.dtype != torch.float32:
                raise ValueError(f"{path}: tensor {name} is {t.dtype}; expected float32")
            _check_tensor(t, f"{path}: tensor {name}", ndim)
            pair[kind] = t
        layers[layer] = LayerCapture(q=pair["q"], k=pair["k"])
    return Captures(model_id=meta["model_id"], source=meta["source"], layers=layers,
                    fingerprint=sha256_file(path), params=params)


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
