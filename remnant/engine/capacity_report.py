"""Capacity report: native vs packed KV capacity at one byte budget, per request length
(the command: remnant.cli.capacity_report).

For the model's geometry (a conf/model preset, or --model-config FILE) it sizes the pools
as SGLang 0.5.18 does (remnant.engine.capacity) for native records and for packed records
at the retention given, and reports tokens, concurrent requests per request length and
what bounds them, the bytes of each component, and the analytic ratio they must match
(schema remnant/capacity). Since v2 it also lists every standard combination of stored
parts (remnant.engine.capacity.STANDARD_COMBINATIONS: packed C4, window and C128 records,
MXFP4 indexer keys, bf16 compressor state) with its bytes per full token per component,
its full tokens at the budget and its ratio to native; since v3 with the CSA layers'
windows apart (csa_swa) and each combination's swa_packed_layers, all served by the engine.
"""

from __future__ import annotations

import dataclasses
from datetime import datetime, timezone
from importlib import resources
from pathlib import Path

from remnant.engine.capacity import (
    STANDARD_COMBINATIONS,
    Combination,
    PoolGeometry,
    combination_geometry,
    pool_bytes,
    request_capacity,
    size_pools,
)
from remnant.kv.formats import CSA_RATIO, HCA_RATIO, KERNEL_RETENTION, NATIVE_RECORD_BYTES, packed_record_bytes


def load_model_preset(name: str | None = None, path: Path | None = None) -> dict:
    """A conf/model preset as a plain dict (its Hydra `defaults` entry dropped)."""
    import yaml

    from remnant.config import ModelConfig

    if path is None:
        entry = resources.files("remnant.conf").joinpath("model", f"{name}.yaml")
        if not entry.is_file():
            known = sorted(p.name[:-5] for p in resources.files("remnant.conf").joinpath("model").iterdir()
                           if p.name.endswith(".yaml"))
            raise ValueError(f"--model {name} is not a model preset; allowed: {', '.join(known)}")
        text = entry.read_text()
    else:
        text = Path(path).read_text()
    raw = {k: v for k, v in (yaml.safe_load(text) or {}).items() if k != "defaults"}
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(set(raw) - fields)
    if unknown:
        raise ValueError(f"model config has unknown field {unknown[0]}; fields: {', '.join(sorted(fields))}")
    return dataclasses.asdict(ModelConfig(**raw))


def combinations(native: PoolGeometry, budget_bytes: int, retention: int = KERNEL_RETENTION,
                 chosen: tuple[Combination, ...] = STANDARD_COMBINATIONS) -> list[dict]:
    """Each combination (at `retention` for its packed parts) sized at the budget: its part
    sizes, bytes per full token per component, full tokens and ratios to native.

    native: the model's geometry at the server's settings (its own parts are not used).
    """
    base = size_pools(combination_geometry(native, Combination(packed=())), budget_bytes)
    base_bpt = sum(base.bytes_per_full_token.values())
    rows = []
    for given in chosen:
        combo = dataclasses.replace(given, retention=retention)
        g = combination_geometry(native, combo)
        s = size_pools(g, budget_bytes)
        bpt = sum(s.bytes_per_full_token.values())
        packed_windows = [b for b in g.window_record_bytes() if b != NATIVE_RECORD_BYTES]
        rows.append({
            "name": combo.name,
            "packed": list(combo.packed),
            "retention": combo.retention,
            "index_keys": combo.index_keys,
            "state_dtype": combo.state_dtype,
            "served": combo.served,
            # The window records' packed size and how many layers pack them (csa_swa: the CSA
            # layers; swa: all), or 584 and 0.
            "part_bytes": {"swa_record": packed_windows[0] if packed_windows else NATIVE_RECORD_BYTES,
                           "swa_packed_layers": len(packed_windows),
                           "c4_record": g.c4_record_bytes[0] if g.n_c4 else None,
                           "c128_record": g.c128_record_bytes, "index_key": g.indexer_key_bytes(),
                           "state_dtype": g.state_dtype_bytes},
            "bytes_per_token": s.bytes_per_full_token,
            "bytes_per_token_total": bpt,
            "fixed_bytes": s.fixed_bytes,
            "max_total_num_tokens": s.full_tokens,
            "capacity_ratio": base_bpt / bpt,
            "token_ratio": s.full_tokens / base.full_tokens if base.full_tokens else None,
        })
    return rows


def report(model: dict, budget_bytes: int, lengths: list[int], retention: list[int],
           page_size: int = 256, swa_ratio: float = 0.1, max_running_requests: int = 64,
           combination_retention: int = KERNEL_RETENTION) -> dict:
    """The remnant/capacity v3 document. retention: R per CSA layer for the packed side;
    combination_retention: R of every packed part in the standard combinations."""
    ratios = model["compress_ratios"]
    n_csa = sum(1 for r in ratios if r == CSA_RATIO)
    if len(retention) == 1:
        retention = retention * n_csa
    if len(retention) != n_csa:
        raise ValueError(f"--retention has {len(retention)} values; the model has {n_csa} CSA layers")
    common = dict(window_size=model["window_size"], index_head_dim=model["index_head_dim"],
                  page_size=page_size, swa_ratio=swa_ratio, max_running_requests=max_running_requests)
    sides = {
        "native": PoolGeometry(ratios, [NATIVE_RECORD_BYTES] * n_csa, **common),
        "packed": PoolGeometry(ratios, [packed_record_bytes(r) for r in retention], **common),
    }
    modes, sizes = [], {}
    for name, geometry in sides.items():
        s = size_pools(geometry, budget_bytes)
        sizes[name] = s
        modes.append({
            "mode": name,
            "c4_record_bytes": geometry.c4_record_bytes,
            "bytes_per_token": s.bytes_per_full_token,
            "bytes_per_token_total": sum(s.bytes_per_full_token.values()),
            "fixed_bytes": s.fixed_bytes,
            "max_total_num_tokens": s.full_tokens,
            "swa_tokens": s.swa_tokens,
            "c4_records": s.c4_records,
            "pool_bytes": pool_bytes(geometry, s),
        })
    bpt = {m["mode"]: m["bytes_per_token_total"] for m in modes}
    per_length = []
    for length in lengths:
        row = {"request_tokens": length}
        for name, geometry in sides.items():
            row[name] = request_capacity(geometry, sizes[name], length)
        row["requests_ratio"] = row["packed"]["requests"] / row["native"]["requests"] if row["native"]["requests"] else None
        per_length.append(row)
    from remnant.records.kinds import CAPACITY
    from remnant.records.provenance import sources

    c4_native = modes[0]["bytes_per_token"]["c4"]
    combos = combinations(sides["native"], budget_bytes, combination_retention)
    return {
        **CAPACITY.header(),
        "created_at": datetime.now(timezone.utc).isoformat(),
        "sources": sources(),
        "model": {"name": model["name"], "compress_ratios": ratios, "window_size": model["window_size"],
                  "index_head_dim": model["index_head_dim"], "csa_layers": n_csa,
                  "hca_layers": sum(1 for r in ratios if r == HCA_RATIO)},
        "settings": {"budget_bytes": budget_bytes, "page_size": page_size, "swa_ratio": swa_ratio,
                     "max_running_requests": max_running_requests, "retention": retention,
                     "combination_retention": combination_retention},
        "formula": {
            "expression": "capacity_ratio = bytes_per_token(native) / bytes_per_token(packed); "
                          "packing changes only the c4 term: sum over CSA layers of record_bytes / 4",
            "native_bytes_per_token": bpt["native"],
            "packed_bytes_per_token": bpt["packed"],
            "capacity_ratio": bpt["native"] / bpt["packed"],
            "c4_share_native": c4_native / bpt["native"],
        },
        "token_ratio": sizes["packed"].full_tokens / sizes["native"].full_tokens if sizes["native"].full_tokens else None,
        "modes": modes,
        "lengths": per_length,
        "combinations": combos,
        "notes": [
            "Record compression is not total memory savings: the C4 records are "
            f"{c4_native / bpt['native']:.1%} of the per-token KV bytes natively; the SWA window, C128 "
            "records, indexer keys and compressor state are unchanged, so packing R=256 "
            f"(584 -> 328 B per record, 43.84% smaller) gives {bpt['native'] / bpt['packed']:.4f}x tokens.",
            "Fixed per-request-slot state (the C128 compressor rows, for max_running_requests + 1 "
            "slots) comes off the budget before tokens are sized, equally in both modes.",
            "Concurrent requests: each holds ceil(L / page_size) full pages and a window in the SWA "
            "pool; for long L the full tokens bound it and the requests ratio follows the token ratio "
            "(up to the floor of whole requests); for short L the SWA pool or the request slots bound "
            "it, and the SWA pool grows with the token capacity too.",
            "Combinations: the engine serves each one that packs the C4 records (the SGLang plugin: C4 "
            "alone): window records packed with retention.window_records (packed_csa: the CSA layers', "
            "packed: every layer's), C128 records with retention.c128_records, index keys in FP8 or MXFP4 "
            "and the compressor state in float32 or bfloat16 with host.index_key_format and "
            "host.compressor_state_dtype. SGLang 0.5.18 itself "
            "counts 132 B per indexer key even with --enable-deepseek-v4-fp4-indexer (its pool then stores 68 B), "
            "and counts the state dtype SGLANG_DSV4_COMPRESS_STATE_DTYPE sets (bf16 also halves the fixed "
            "C128 state, so token_ratio exceeds capacity_ratio there).",
        ],
        "limits": [
            "analytic sizing with SGLang 0.5.18's DeepSeek-V4 formula, not a measurement on GPUs",
            "the budget is an assumption: SGLang sizes pools from the GPU memory left after weights",
        ],
    }
