"""Which coordinates the engine's CSA layers keep in triton and kernel modes.

A retention map file names them. Without one, the engine calibrates at load, training-
free: it runs a seeded calibration prompt through its own model in native mode, captures
each CSA layer's queries and C4 latents, and lets a policy (remnant.calibration.policies) choose.
The map used, either way, is reported in /server_info with its provenance.
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
from remnant.kv.formats import CSA_RATIO, WINDOW_RECORDS
from remnant.kv.modes import mode_of

CALIBRATION_TOKENS = 512
CALIBRATION_SEED = 1234


def calibration_captures(model: Model, model_id: str, tokens: int = CALIBRATION_TOKENS,
                         seed: int = CALIBRATION_SEED) -> Captures:
    """Queries and C4 latents of every CSA layer on a seeded random prompt (native mode)."""
    ids = torch.randint(0, model.args.vocab_size, (tokens,), generator=torch.Generator().manual_seed(seed))
    saved = model.c4_formats
    model.set_c4_formats({i: C4Format() for i in model.csa_layers})  # (and no folded weights)
    model.capture = {i: [] for i in model.csa_layers}
    try:
        pools = scratch_pools(model, tokens)
        seq = new_sequence(pools, tokens)
        with torch.inference_mode():
            model.forward([seq], [ids.tolist()], pools)
        # Policies run on the CPU, whatever the model's device.
        queries = {i: torch.cat(model.capture[i]).cpu() for i in model.csa_layers}
        records = {i: pools.c4[i].read(seq.page_tensor(model.device), torch.arange(tokens // CSA_RATIO)).cpu()
                   for i in model.csa_layers}
    finally:
        model.capture = None
        model.set_c4_formats(saved)
    from remnant.kv.codec import dequantize

    params = {"generator": "remnant.engine.retention_setup/1", "model_id": model_id,
              "tokens": tokens, "seed": seed, "weights_seed": model.args.seed}
    fingerprint = hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()
    layers = {i: LayerCapture(q=queries[i].float(), k=dequantize(records[i]))
              for i in model.csa_layers}
    return Captures(model_id=model_id, source="engine-calibration", layers=layers,
                    fingerprint=fingerprint, params=params)


def setup_retention(model: Model, mode: str, model_id: str, retention: int | None = None,
                    per_layer: list[int] | None = None, map_path: str | None = None,
                    policy: str = RetentionConfig.policy,
                    window_records: str = RetentionConfig.window_records) -> RetentionMap | None:
    """Set the model's C4 formats for `mode` (window_records packed_csa: each CSA layer's
    window ring packed with its map too); returns the retention map used (None: native,
    which stores every record native whatever window_records says)."""
    if window_records not in WINDOW_RECORDS:
        raise ValueError(f"window_records={window_records!r} is not allowed; allowed: {', '.join(WINDOW_RECORDS)}")
    rules = mode_of(mode)
    if not rules.keeps_retention:
        model.set_c4_formats({i: C4Format() for i in model.csa_layers})
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
    pack_window = window_records == "packed_csa"
    model.set_c4_formats({i: C4Format(mode, rmap.keep_tensor(i), pack_window=pack_window) for i in model.csa_layers})
    return rmap
