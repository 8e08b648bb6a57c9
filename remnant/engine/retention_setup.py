"""Which coordinates the engine's layers keep in triton and kernel modes.

A retention map file names them for the CSA layers. Without one, the engine calibrates at
load, training-free: it runs a seeded calibration prompt through its own model in native
mode, captures each CSA layer's queries and C4 latents, and lets a policy
(remnant.calibration.policies) choose. The map used, either way, is reported in
/server_info with its provenance.

HCA and window-only layers that pack a part (retention.window_records=packed,
retention.c128_records=packed) take maps of their own, always calibrated so at load (a
map file holds CSA layers only): their queries against their window latents and, on HCA
layers, their C128 latents, at the CSA layers' one R.
"""

from __future__ import annotations

import hashlib
import json

import torch

from remnant.calibration.captures import Captures, LayerCapture
from remnant.calibration.retention import RetentionMap, profile_values
from remnant.config import RetentionConfig
from remnant.engine.model import C4Format, Model
from remnant.engine.pools import new_sequence, scratch_pools
from remnant.kv.formats import C128_RECORDS, CSA_RATIO, HCA_RATIO, WINDOW_RECORDS
from remnant.kv.modes import mode_of

CALIBRATION_TOKENS = 512
CALIBRATION_SEED = 1234


def calibration_captures(model: Model, model_id: str, tokens: int = CALIBRATION_TOKENS,
                         seed: int = CALIBRATION_SEED, layers: list[int] | None = None,
                         window_keys: bool = True, record_keys: bool = True) -> Captures:
    """Queries and keys of `layers` (default: every CSA layer) on a seeded random prompt
    (native mode), each key as its native FP8 record holds it: a CSA layer's C4 latents;
    an HCA or window-only layer's window latents (window_keys) then its C128 latents
    (record_keys, HCA layers)."""
    from remnant.kv.codec import dequantize, quantize

    layers = model.csa_layers if layers is None else sorted(layers)
    ids = torch.randint(0, model.args.vocab_size, (tokens,), generator=torch.Generator().manual_seed(seed))
    saved, saved_other, saved_map = model.c4_formats, model.other_formats, model.other_map
    model.set_c4_formats({i: C4Format() for i in model.csa_layers})  # (and no folded weights)
    model.set_other_formats({})
    model.capture = {i: [] for i in layers}
    model.capture_windows = {i: [] for i in layers if model.args.compress_ratios[i] != CSA_RATIO}
    try:
        pools = scratch_pools(model, tokens)
        seq = new_sequence(pools, tokens)
        with torch.inference_mode():
            model.forward([seq], [ids.tolist()], pools)
        # Policies run on the CPU, whatever the model's device.
        pages = seq.page_tensor(model.device)
        keys = {}
        for i in layers:
            ratio = model.args.compress_ratios[i]
            parts = []
            if ratio != CSA_RATIO and window_keys:
                parts.append(dequantize(quantize(torch.cat(model.capture_windows[i]).float())).cpu())
            if ratio == CSA_RATIO or (ratio and record_keys):
                target = pools.c4[i] if ratio == CSA_RATIO else pools.c128[i]
                parts.append(dequantize(target.read(pages, torch.arange(tokens // ratio)).cpu()))
            keys[i] = torch.cat(parts)
        queries = {i: torch.cat(model.capture[i]).cpu() for i in layers}
    finally:
        model.capture = model.capture_windows = None
        model.set_c4_formats(saved)
        model.set_other_formats(saved_other)
        model.other_map = saved_map
    params = {"generator": "remnant.engine.retention_setup/1", "model_id": model_id,
              "tokens": tokens, "seed": seed, "weights_seed": model.args.seed}
    if layers != model.csa_layers:  # (the CSA layers' captures keep their fingerprint)
        params.update(layers=layers, window_keys=window_keys, record_keys=record_keys)
    fingerprint = hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()
    return Captures(model_id=model_id, source="engine-calibration",
                    layers={i: LayerCapture(q=queries[i].float(), k=keys[i]) for i in layers},
                    fingerprint=fingerprint, params=params)


def setup_retention(model: Model, mode: str, model_id: str, retention: int | None = None,
                    per_layer: list[int] | None = None, map_path: str | None = None,
                    policy: str = RetentionConfig.policy,
                    window_records: str = RetentionConfig.window_records,
                    c128_records: str = RetentionConfig.c128_records) -> RetentionMap | None:
    """Set the model's formats for `mode`: the CSA layers' (window_records packed_csa or
    packed: each one's window ring packed with its map too) and, where window_records is
    packed or c128_records packed, the HCA and window-only layers' (Model.other_formats,
    their map calibrated here: Model.other_map). Returns the CSA layers' retention map
    (None: native, which stores every record native whatever the options say)."""
    for name, value, allowed in (("window_records", window_records, WINDOW_RECORDS),
                                 ("c128_records", c128_records, C128_RECORDS)):
        if value not in allowed:
            raise ValueError(f"{name}={value!r} is not allowed; allowed: {', '.join(allowed)}")
    rules = mode_of(mode)
    if not rules.keeps_retention:
        model.set_c4_formats({i: C4Format() for i in model.csa_layers})
        model.set_other_formats({})
        return None
    if map_path:
        rmap = RetentionMap.load(map_path)
        rmap.check(model.csa_layers)
        wanted = None
        if per_layer or retention is not None:
            wanted = profile_values(None if per_layer else retention, per_layer or None, len(model.csa_layers))
        got = [rmap.retention(i) for i in model.csa_layers]
        if wanted is not None and wanted != got:
            raise ValueError(f"retention map {map_path} keeps R={got} per CSA layer; the run asks for {wanted}")
    else:
        from remnant.calibration.policies import build_map

        values = profile_values(None if per_layer else retention, per_layer or None, len(model.csa_layers))
        rmap = build_map(calibration_captures(model, model_id), policy, values)
    rules.check_retention(rmap.retention(i) for i in model.csa_layers)
    # Every format made (and every check passed) before the model takes any of them.
    pack_window = window_records != "native"
    c4 = {i: C4Format(mode, rmap.keep_tensor(i), pack_window=pack_window) for i in model.csa_layers}
    other, other_map = _other_layer_formats(model, mode, model_id, rmap, policy, window_records == "packed",
                                            c128_records == "packed")
    model.set_c4_formats(c4)
    model.set_other_formats(other)
    model.other_map = other_map
    return rmap


def _other_layer_formats(model: Model, mode: str, model_id: str, rmap: RetentionMap, policy: str,
                         pack_window: bool, pack_c128: bool) -> tuple[dict[int, C4Format], RetentionMap | None]:
    """The HCA and window-only layers' formats where they pack a part (every such layer for
    packed windows, the HCA layers for packed C128 records) and the map they take: kept
    columns calibrated from the model itself at the CSA layers' one R, on the keys of the
    parts each packs (its window latents, its C128 latents: a 512-token calibration prompt
    gives 4 of those)."""
    ratios = model.args.compress_ratios
    layers = [i for i, r in enumerate(ratios) if r != CSA_RATIO and (pack_window or (pack_c128 and r == HCA_RATIO))]
    if not layers:
        return {}, None
    values = {rmap.retention(i) for i in model.csa_layers}
    if len(values) != 1:
        raise ValueError(f"packed window or C128 records of HCA and window-only layers take one R; the CSA "
                         f"layers keep {sorted(values)}")
    from remnant.calibration.policies import build_map

    captures = calibration_captures(model, model_id, layers=layers, window_keys=pack_window, record_keys=pack_c128)
    other = build_map(captures, policy, [values.pop()] * len(layers))
    return {i: C4Format(mode, other.keep_tensor(i), pack_window=pack_window,
                        pack_records=pack_c128 and ratios[i] == HCA_RATIO) for i in layers}, other
