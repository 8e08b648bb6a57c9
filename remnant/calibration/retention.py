"""Retention maps and retention profiles (docs/kv.md).

A retention map names, per CSA layer, the sorted NoPE coordinates kept at that layer's
retention R (N = R - 64 of 0..447; RoPE 448..511 is always kept). It is a JSON record,
`"schema": "remnant/retention-map"` (schemas/retention-map/), carrying its own provenance:
the policy and its parameters, the calibration captures' fingerprint, the model id, when
and by which code it was built. Maps of the training-free policies are written as v1; maps
of the learned policy (remnant.calibration.learned, offline) as v2, which is v1 plus the
policy name "learned" and its scorer's provenance (remnant.records.kinds says why). Both
versions load.

A retention profile gives R per CSA layer: uniform or one value per layer.

torch is imported only where a tensor is made, so config validation can import this module.
"""

from __future__ import annotations

import datetime as _dt
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from remnant.kv.formats import NOPE_DIM, RETENTION_VALUES, ROPE_DIM

#: Training-free policies that choose kept coordinates (remnant.calibration.policies
#: implements them).
POLICIES = ("magnitude", "attention", "prefix", "random")
#: The offline learned policy (remnant.calibration.learned): a map can name it, a run never
#: calibrates with it at load, so it is not one of POLICIES.
LEARNED = "learned"
#: Every policy a retention map may name.
MAP_POLICIES = POLICIES + (LEARNED,)

if TYPE_CHECKING:
    import torch

_ALLOWED = ", ".join(map(str, RETENTION_VALUES))


@dataclass
class LayerKeep:
    """Kept NoPE coordinates of one CSA layer.

    layer: the model's layer index of this CSA layer. retention: R, coordinates kept of 512.
    keep: the R - 64 kept NoPE indices, sorted ascending, each in [0, 448).
    """

    layer: int
    retention: int
    keep: list[int]


@dataclass
class RetentionMap:
    """Per CSA layer kept NoPE coordinates, with the provenance of how they were chosen.

    calibration: {"fingerprint": 64-hex sha256 of the capture file (or of a synthetic
    generator's canonical JSON params), "source": str, "queries": int, "records": int}.
    created_at / sources: filled with the current time and
    remnant.records.provenance.sources() by to_dict() when left None.
    """

    model_id: str
    policy: str
    policy_params: dict
    calibration: dict
    layers: list[LayerKeep]
    created_at: str | None = None
    sources: dict | None = field(default=None, repr=False)

    def _entry(self, layer: int) -> LayerKeep:
        for entry in self.layers:
            if entry.layer == layer:
                return entry
        raise KeyError(f"layer {layer} is not in the retention map; its CSA layers are {self.csa_layers}")

    def keep_tensor(self, layer: int) -> "torch.Tensor":
        """Kept NoPE indices of `layer` as int64 [N], N = R - 64 (the `keep` of pack/unpack)."""
        import torch

        return torch.tensor(self._entry(layer).keep, dtype=torch.int64)

    def retention(self, layer: int) -> int:
        """Retention R of `layer`."""
        return self._entry(layer).retention

    @property
    def csa_layers(self) -> list[int]:
        """The map's layer indices, ascending."""
        return sorted(entry.layer for entry in self.layers)

    def check(self, csa_layers: list[int]) -> None:
        """ValueError unless the map covers exactly the model's CSA layers `csa_layers`."""
        mine, theirs = self.csa_layers, sorted(csa_layers)
        if mine != theirs:
            raise ValueError(
                f"retention map has {len(mine)} CSA layers {mine}; the model has {len(theirs)}: {theirs}")

    def to_dict(self) -> dict:
        """The map as a remnant/retention-map document: v1, or v2 for the learned policy."""
        from remnant.records.kinds import RETENTION_MAP, RETENTION_MAP_TRAINING_FREE
        from remnant.records.provenance import sources as code_sources

        return {
            **(RETENTION_MAP if self.policy == LEARNED else RETENTION_MAP_TRAINING_FREE).header(),
            "model_id": self.model_id,
            "policy": {"name": self.policy, "params": dict(self.policy_params)},
            "calibration": dict(self.calibration),
            "created_at": self.created_at if self.created_at is not None else _now(),
            "sources": dict(self.sources) if self.sources is not None else code_sources(),
            "layers": [{"layer": e.layer, "retention": e.retention, "keep": list(e.keep)}
                       for e in self.layers],
        }

    @classmethod
    def from_dict(cls, d: dict, source: str = "<document>") -> "RetentionMap":
        """Validate a remnant/retention-map document and build the map.

        Raises RecordError (a ValueError) naming `source` and the field for schema errors,
        ValueError naming `source` and the layer for keeps that are unsorted, repeated, out
        of range or of the wrong length for their retention, and for repeated layers.
        """
        from remnant.records.schema import RecordError, validate

        try:
            validate(d, source=source)
        except RecordError as e:
            raise _with_layer(e, d) from None
        layers = [LayerKeep(int(e["layer"]), int(e["retention"]), list(e["keep"])) for e in d["layers"]]
        seen: set[int] = set()
        for i, entry in enumerate(layers):
            if entry.layer in seen:
                raise ValueError(f"{source}: layers[{i}]: layer {entry.layer} is listed twice")
            seen.add(entry.layer)
            _check_layer_keep(entry, f"{source}: layers[{i}] (layer {entry.layer})")
        return cls(model_id=d["model_id"], policy=d["policy"]["name"],
                   policy_params=dict(d["policy"]["params"]), calibration=dict(d["calibration"]),
                   layers=layers, created_at=d["created_at"], sources=dict(d["sources"]))

    def save(self, path: str | os.PathLike) -> Path:
        """Write the map as schema-validated JSON (atomically); returns the path.

        Checks each layer's keep first, so an invalid map is never written.
        """
        from remnant.records.schema import write_validated

        for i, entry in enumerate(self.layers):
            _check_layer_keep(entry, f"{path}: layers[{i}] (layer {entry.layer})")
        return write_validated(path, self.to_dict())

    @classmethod
    def load(cls, path: str | os.PathLike) -> "RetentionMap":
        """Read and check a retention map file (see from_dict for the errors raised).

        A missing or unreadable file, or malformed JSON, is a RecordError naming the file.
        """
        from remnant.records.schema import read_json

        return cls.from_dict(read_json(path, "retention map"), source=str(path))


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="milliseconds")


def _check_layer_keep(entry: LayerKeep, name: str) -> None:
    """check_keep semantics plus N == retention - 64; ValueError prefixed with `name`."""
    import torch

    from remnant.kv.packing import check_keep

    if entry.retention not in RETENTION_VALUES:
        raise ValueError(f"{name}: retention={entry.retention} is not allowed; allowed: {_ALLOWED}")
    want = entry.retention - ROPE_DIM
    if len(entry.keep) != want:
        raise ValueError(f"{name}: keep has {len(entry.keep)} indices; retention {entry.retention} "
                         f"keeps N = R - 64 = {want} NoPE coordinates")
    if any(isinstance(i, bool) or not isinstance(i, int) for i in entry.keep):
        raise ValueError(f"{name}: keep must hold integer NoPE indices in [0, {NOPE_DIM})")
    check_keep(torch.tensor(entry.keep, dtype=torch.int64), name=f"{name}: keep")


def _with_layer(err, doc):
    """A schema error under layers[i] also names the model layer of that entry; one under
    its keep says what is wrong in check_keep's words rather than by echoing the list."""
    from remnant.records.schema import RecordError

    m = re.match(r"^layers\[([0-9]+)\]", err.field)
    if m is None:
        return err
    try:
        entry = doc["layers"][int(m.group(1))]
        layer = entry["layer"]
    except (LookupError, TypeError):
        return err
    if isinstance(layer, bool) or not isinstance(layer, int):
        return err
    reason = f"{err.reason} (layer {layer})"
    if err.field.startswith(f"{m.group(0)}.keep"):
        try:
            _check_layer_keep(LayerKeep(layer, entry["retention"], list(entry["keep"])), f"layer {layer}")
        except (ValueError, TypeError, KeyError) as e:
            reason = str(e)
    return RecordError(err.source, err.field, reason, errors=err.errors)


def profile_values(retention: int | None, per_layer: list[int] | None, n_csa_layers: int) -> list[int]:
    """Retention R of each CSA layer, in layer order, from a uniform `retention` or a
    `per_layer` list (exactly one of them). Allowed values: 64..448 step 64; 512 (keep
    everything) is no retention profile: use mode native instead.

    ValueError names the field (`retention`, `per_layer[i]`, `per_layer`) and what is allowed.
    """
    if n_csa_layers < 1:
        raise ValueError(f"n_csa_layers={n_csa_layers}: the model has no CSA layer to retain")
    if (retention is None) == (per_layer is None):
        raise ValueError("give exactly one of retention (uniform R) or per_layer (one R per CSA layer)"
                         + ("; got both" if retention is not None else "; got neither"))
    if retention is not None:
        _check_profile_value(retention, "retention")
        return [retention] * n_csa_layers
    values = list(per_layer)
    if len(values) != n_csa_layers:
        raise ValueError(f"per_layer has {len(values)} values; the model has {n_csa_layers} CSA layers")
    for i, value in enumerate(values):
        _check_profile_value(value, f"per_layer[{i}]")
    return values


def _check_profile_value(value: object, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value not in RETENTION_VALUES:
        raise ValueError(f"{name}={value!r} is not allowed; allowed: {_ALLOWED}"
                         + (" (512 keeps everything: use mode native, not a retention profile)"
                            if value == 512 else ""))
