"""Fidelity of the KV parts beyond C4 records, per layer, on a split by capture source.

The retention profile's options beyond packed C4 records (docs/kv.md, "Capacity beyond
C4") each change what attention or the indexer reads. Measured here on captures that hold
them (remnant.calibration.captures, remnant-capture/2), per layer, the eval capture's
decode queries against its own latents:

- `c4` (CSA layers): packed C4 records, today's metric (fidelity_metrics.measure), for
  reference beside the others.
- `window` (every layer): window records packed (retention.window_records): a CSA layer's
  with its C4 map (packed_csa), an HCA or window-only layer's with a map of its own
  (packed). measure() over the window latents.
- `c128` (HCA layers): C128 records packed with the layer's map (retention.c128_records).
  measure() over the C128 latents.
- `mxfp4_index` (CSA layers): MXFP4 indexer keys (host.index_key_format): the overlap of
  the indexer's top-k from MXFP4 keys with its top-k from FP8 keys, and each against the
  unquantized keys (fidelity_metrics.index_key_overlap).
- `bf16_state` (CSA and HCA layers): the compressor state in bf16
  (host.compressor_state_dtype): the relative error of the compressed latents the same
  inputs give, the attention-output error of native attention over their FP8 records
  against the float32 state's, and on CSA layers the indexer top-k overlap of their FP8
  index keys.
- `all` (every layer): every part at once, in one softmax as the layer reads it: its
  window (the first `window` window latents) and its compressed records (CSA: the top-k the
  indexer picks, with FP8 keys natively and with MXFP4 keys of the bf16-state index keys
  in the combination; HCA: every record), natively against the combination (packed window
  and records from the bf16-state latents). No sink in either.

Maps come from the train capture only (the split is by source, as fidelity_compare's):
the policy chooses a CSA layer's kept coordinates from its queries and C4 latents (one map
for its C4 records and its window); an HCA or window-only layer's from its queries and
its window and C128 latents together, as the engine calibrates a layer that packs both.
Natively, records are FP8 (remnant.kv.quantize), as SGLang stores them. Its command:
`python -m remnant.cli.fidelity parts` (remnant.cli.fidelity).
"""

from __future__ import annotations

from datetime import datetime, timezone

import torch

from remnant.calibration.captures import SYNTHETIC_LIMIT, Captures, LayerCapture, OtherLayerCapture
from remnant.calibration.fidelity_metrics import _dist, index_key_overlap, indexer_scores, measure, top_k_overlap
from remnant.calibration.learned import capture_ref, one_thread
from remnant.calibration.policies import choose
from remnant.kv.attention import attend_native, attend_packed
from remnant.kv.codec import quantize
from remnant.kv.formats import CSA_RATIO, HCA_RATIO
from remnant.kv.index_keys import index_key_format
from remnant.kv.packing import pack

#: The parts a report measures, in report order.
PARTS = ("c4", "window", "c128", "mxfp4_index", "bf16_state", "all")
#: What each part's row measures against native, for the table and the docs.
PART_SETTINGS = {
    "c4": "C4 records packed (modes triton, kernel)",
    "window": "window records packed with the layer's map (retention.window_records: packed_csa on CSA "
              "layers, packed on the others)",
    "c128": "C128 records packed (retention.c128_records=packed)",
    "mxfp4_index": "indexer keys in MXFP4 (host.index_key_format=mxfp4)",
    "bf16_state": "compressor state in bf16 (host.compressor_state_dtype=bfloat16)",
    "all": "every part at once: packed window, packed C4 or C128 records, MXFP4 index keys, bf16 state",
}


def _need(t, file: str, what: str) -> torch.Tensor:
    if t is None:
        raise ValueError(f"{file}: {what} is missing; the fidelity of the parts beyond C4 reads a "
                         "remnant-capture/2 file of the embedded engine (remnant-capture with host=embedded)")
    return t


def check_parts(named: tuple[str, Captures]) -> None:
    """ValueError naming the file and the tensor where a capture lacks what a part needs."""
    name, c = named
    if not c.other_layers:
        raise ValueError(f"{name}: holds no HCA or window-only layer (other.<L>.*); a remnant-capture/1 file holds "
                         "CSA layers' queries and C4 latents only. Record a new capture with remnant-capture")
    for layer, cap in c.layers.items():
        for kind in ("window", "index_q", "index_w", "index_k", "k_bf16", "index_k_bf16"):
            _need(getattr(cap, kind), name, f"layers.{layer}.{kind}")
    for layer, cap in c.other_layers.items():
        if cap.ratio == HCA_RATIO:
            _need(cap.k, name, f"other.{layer}.k (C128 latents: no sequence of 128 tokens was captured)")
            _need(cap.k_bf16, name, f"other.{layer}.k_bf16")


def check_split(train_named: tuple[str, Captures], eval_named: tuple[str, Captures]) -> None:
    """ValueError naming the file and field where the two captures come from different
    models or layers, or share a source or fingerprint (the split is by capture source), or
    either lacks a part."""
    check_parts(train_named)
    check_parts(eval_named)
    (tn, tr), (en, ev) = train_named, eval_named
    if ev.model_id != tr.model_id:
        raise ValueError(f"{en}: model_id is {ev.model_id!r}; the training captures {tn} have {tr.model_id!r}")
    for what, a, b in (("CSA layers", sorted(tr.layers), sorted(ev.layers)),
                       ("other layers", {i: o.ratio for i, o in tr.other_layers.items()},
                        {i: o.ratio for i, o in ev.other_layers.items()})):
        if a != b:
            raise ValueError(f"{en}: {what} are {b}; the training captures {tn} have {a}")
    if tr.fingerprint == ev.fingerprint:
        raise ValueError(f"{en}: the same captures (fingerprint) as --train {tn}")
    if tr.source == ev.source:
        raise ValueError(f"{en}: source is {ev.source!r}, as --train {tn}'s; the split is by capture source")


def maps(train: Captures, policy: str, retention: int, seed: int = 0) -> dict[int, torch.Tensor]:
    """Layer -> kept NoPE indices int64 [R - 64], chosen by `policy` from the train capture:
    a CSA layer's from its queries and C4 latents, another layer's from its queries and its
    window and C128 latents together (the engine's calibration of a layer that packs both)."""
    out = {layer: choose(policy, cap, retention, seed=seed, layer=layer) for layer, cap in train.layers.items()}
    for layer, cap in train.other_layers.items():
        keys = cap.window if cap.k is None else torch.cat([cap.window, cap.k])
        out[layer] = choose(policy, LayerCapture(q=cap.q, k=keys), retention, seed=seed, layer=layer)
    return dict(sorted(out.items()))


def output_error(q: torch.Tensor, window_ref: torch.Tensor, records_ref: torch.Tensor, select_ref: torch.Tensor | None,
                 window_test: torch.Tensor, records_test: torch.Tensor, select_test: torch.Tensor | None,
                 keep: torch.Tensor | None) -> torch.Tensor:
    """Per query token and head, ||o_test - o_ref|| / ||o_ref||, float64 [T * H]: o_ref from
    attend_native over native window records window_ref uint8 [W, 584] and records_ref
    uint8 [n, 584]; o_test over window_test and records_test, native (keep None: attend_native)
    or packed with `keep` (attend_packed, the window packed too). select_*: int64 [T, k]
    records each token reads (-1: none), None: every record. No sink."""
    heads = q.shape[1]
    no_sink = torch.full((heads,), float("-inf"), dtype=torch.float64)
    every_ref = torch.arange(records_ref.shape[0])
    every_test = torch.arange(records_test.shape[0])
    errors = []
    for t, qt in enumerate(q.double()):
        ref = attend_native(qt, window_ref, records_ref, every_ref if select_ref is None else select_ref[t], no_sink)
        idx = every_test if select_test is None else select_test[t]
        if keep is None:
            got = attend_native(qt, window_test, records_test, idx, no_sink)
        else:
            got = attend_packed(qt, window_test, records_test, keep, idx, no_sink, window_packed=True)
        errors.append((got - ref).norm(dim=1) / ref.norm(dim=1).clamp_min(1e-300))
    return torch.cat(errors)


def _rel_rows(test: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Per row ||test - ref|| / ||ref||, float64."""
    return (test.double() - ref.double()).norm(dim=1) / ref.double().norm(dim=1).clamp_min(1e-300)


def _scores(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, chunk: int = 16) -> torch.Tensor:
    """indexer_scores float64 [T, n], `chunk` tokens at a time (bounds the [t, H, n] product)."""
    return torch.cat([indexer_scores(q[t:t + chunk], w[t:t + chunk], keys) for t in range(0, q.shape[0], chunk)])


def _top(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, k: int) -> torch.Tensor:
    """The indexer's top-k record indices per token, int64 [T, min(k, n)], over every key."""
    return _scores(q, w, keys).topk(min(k, keys.shape[0]), dim=1).indices


def _selection_overlap(a: torch.Tensor, b: torch.Tensor, n: int) -> torch.Tensor:
    """Per row |a & b| / k of two top-k index lists int64 [T, k] over n candidates."""
    in_a = torch.zeros(a.shape[0], n, dtype=torch.bool).scatter_(1, a, True)
    return in_a.gather(1, b).double().mean(dim=1)


def _q5(v: torch.Tensor) -> dict:
    v = v.double()
    return {"mean": float(v.mean()), "p50": float(v.quantile(0.5)), "p5": float(v.quantile(0.05)),
            "min": float(v.min())}


def measure_csa(cap: LayerCapture, keep: torch.Tensor, top_k: int, index_top_k: int, window: int) -> list[dict]:
    """The rows of one CSA layer (parts c4, window, mxfp4_index, bf16_state, all)."""
    fp8 = index_key_format("fp8", cap.index_k.shape[1])
    mx = index_key_format("mxfp4", cap.index_k.shape[1])
    records = quantize(cap.k)
    win = quantize(cap.window)
    rows = [{"part": "c4", **measure(cap, records, keep, top_k)},
            {"part": "window", **measure(LayerCapture(q=cap.q, k=cap.window), win, keep, top_k)},
            {"part": "mxfp4_index", "index_overlap": index_key_overlap(cap.index_q, cap.index_w, cap.index_k, index_top_k)}]
    # bf16 state: the same inputs' latents and index keys, stored natively (FP8 records, FP8 keys).
    records_bf16 = quantize(cap.k_bf16)
    fp8_keys = fp8.dequantize(fp8.quantize(cap.index_k))
    fp8_keys_bf16 = fp8.dequantize(fp8.quantize(cap.index_k_bf16))
    overlap = top_k_overlap(_scores(cap.index_q, cap.index_w, fp8_keys), _scores(cap.index_q, cap.index_w, fp8_keys_bf16),
                            index_top_k)
    no_window = records[:0]
    rows.append({"part": "bf16_state", "latent_rel_error": _dist(_rel_rows(cap.k_bf16, cap.k)),
                 "index_key_rel_error": _dist(_rel_rows(cap.index_k_bf16, cap.index_k)),
                 "output_rel_error": _dist(output_error(cap.q, no_window, records, None, no_window, records_bf16, None,
                                                        None)),
                 "index_overlap": {"bf16_vs_float32": _q5(overlap), "top_k": min(index_top_k, cap.k.shape[0])}})
    # Everything at once: the indexer picks with FP8 keys natively, MXFP4 keys of the bf16
    # state's index keys in the combination; both read their picks and the window in one softmax.
    sel_ref = _top(cap.index_q, cap.index_w, fp8_keys, index_top_k)
    sel_all = _top(cap.index_q, cap.index_w, mx.dequantize(mx.quantize(cap.index_k_bf16)), index_top_k)
    w = win[:window]
    err = output_error(cap.q, w, records, sel_ref, pack(w, keep), pack(records_bf16, keep), sel_all, keep)
    rows.append({"part": "all", "output_rel_error": _dist(err),
                 "index_overlap": {"all_vs_native": _q5(_selection_overlap(sel_ref, sel_all, cap.k.shape[0])),
                                   "top_k": sel_ref.shape[1]}, "window": int(w.shape[0])})
    return rows


def measure_other(cap: OtherLayerCapture, keep: torch.Tensor, top_k: int, window: int) -> list[dict]:
    """The rows of an HCA layer (window, c128, bf16_state, all) or a window-only one (window, all)."""
    win = quantize(cap.window)
    rows = [{"part": "window", **measure(LayerCapture(q=cap.q, k=cap.window), win, keep, top_k)}]
    w = win[:window]
    if cap.k is None:
        err = output_error(cap.q, w, win[:0], None, pack(w, keep), pack(win[:0], keep), None, keep)
        return rows + [{"part": "all", "output_rel_error": _dist(err), "window": int(w.shape[0])}]
    records = quantize(cap.k)
    records_bf16 = quantize(cap.k_bf16)
    rows.append({"part": "c128", **measure(LayerCapture(q=cap.q, k=cap.k), records, keep, top_k)})
    no_window = records[:0]
    rows.append({"part": "bf16_state", "latent_rel_error": _dist(_rel_rows(cap.k_bf16, cap.k)),
                 "output_rel_error": _dist(output_error(cap.q, no_window, records, None, no_window, records_bf16, None,
                                                        None))})
    err = output_error(cap.q, w, records, None, pack(w, keep), pack(records_bf16, keep), None, keep)
    rows.append({"part": "all", "output_rel_error": _dist(err), "window": int(w.shape[0])})
    return rows


def evaluate(train: Captures, ev: Captures, policy: str, retention: int, top_k: int = 64, index_top_k: int = 512,
             window: int = 128, seed: int = 0, progress: bool | None = None) -> list[dict]:
    """One row per (layer, part) the layer has, layers ascending, parts in PARTS order:
    {"layer", "ratio", "part", metrics...}. Single-threaded (fidelity_compare says why)."""
    from tqdm import tqdm

    keeps = maps(train, policy, retention, seed)
    layers = sorted([*ev.layers, *ev.other_layers])
    out = []
    with one_thread():
        for layer in tqdm(layers, desc="fidelity parts", unit="layer", disable=None if progress is None else not progress):
            if layer in ev.layers:
                ratio, rows = CSA_RATIO, measure_csa(ev.layers[layer], keeps[layer], top_k, index_top_k, window)
            else:
                cap = ev.other_layers[layer]
                ratio, rows = cap.ratio, measure_other(cap, keeps[layer], top_k, window)
            out += [{"layer": layer, "ratio": ratio, **row} for row in sorted(rows, key=lambda r: PARTS.index(r["part"]))]
    return out


def _ref(name: str, c: Captures) -> dict:
    counts = {"queries": min(x.q.shape[0] for x in [*c.layers.values(), *c.other_layers.values()]),
              "c4_latents": min(x.k.shape[0] for x in c.layers.values()),
              "window_latents": min(x.window.shape[0] for x in [*c.layers.values(), *c.other_layers.values()]),
              "c128_latents": min([x.k.shape[0] for x in c.other_layers.values() if x.k is not None], default=0)}
    return {**capture_ref(c), "file": name, "counts": counts}


def report(train_named: tuple[str, Captures], eval_named: tuple[str, Captures], policy: str = "attention",
           retention: int = 256, top_k: int = 64, index_top_k: int = 512, window: int = 128, seed: int = 0,
           extra_limits: list[str] | None = None, progress: bool | None = None) -> dict:
    """The remnant/fidelity-parts v1 document (remnant.records.kinds.FIDELITY_PARTS)."""
    from remnant.records.kinds import FIDELITY_PARTS
    from remnant.records.provenance import sources

    check_split(train_named, eval_named)
    (tn, tr), (en, ev) = train_named, eval_named
    results = evaluate(tr, ev, policy, retention, top_k, index_top_k, window, seed, progress)
    n_keys = min(x.k.shape[0] for x in ev.layers.values())
    limits = [
        f"captures of model {ev.model_id!r}: maps chosen by the {policy} policy on {tr.source} "
        f"({tr.fingerprint[:12]}); measured on {ev.source} ({ev.fingerprint[:12]}), a source the policy did not read",
        "per layer and part: the eval capture's decode queries against its own latents, captured across its "
        "sequences together; a query's own sequence and position are not kept, so every latent counts as visible",
        "parts c4, window, c128 and bf16_state: every captured latent selected, no sink, no other part in the "
        "softmax",
        f"part all: one softmax over the first {window} window latents and the compressed records (CSA: the "
        f"indexer's top-{index_top_k} of {n_keys} captured keys), no sink",
        "bf16_state: one layer's compressor inputs rounded to bf16 with everything before unchanged; in a served "
        "model the error also carries over from earlier layers",
        "the engine's indexer does not rotate its queries and keys (V4's Hadamard rotation spreads outlier "
        "channels before MXFP4 quantization; docs/kv.md measured it on synthetic data)",
    ]
    if any(c.source.startswith("synthetic") for c in (tr, ev)):
        limits.insert(0, SYNTHETIC_LIMIT)
    limits.extend(extra_limits or [])
    return {
        **FIDELITY_PARTS.header(),
        "created_at": datetime.now(timezone.utc).isoformat(),
        "sources": sources(),
        "model_id": ev.model_id,
        "split": {"by": "capture source", "train": [_ref(tn, tr)], "eval": [_ref(en, ev)]},
        "settings": {"policy": policy, "retention": retention, "top_k": top_k, "index_top_k": index_top_k,
                     "window": window, "seed": seed, "parts": {p: PART_SETTINGS[p] for p in PARTS}},
        "results": results,
        "limits": limits,
    }


def summary(doc: dict) -> dict[str, dict]:
    """Part -> the mean over layers of each headline number: output error (mean of the
    per-layer means), latent error (bf16_state), indexer overlap (mean), and the layers."""
    out: dict[str, dict] = {}
    for row in doc["results"]:
        s = out.setdefault(row["part"], {"layers": [], "output": [], "latent": [], "overlap": []})
        s["layers"].append(row["layer"])
        if "output_rel_error" in row:
            s["output"].append(row["output_rel_error"]["mean"])
        if "latent_rel_error" in row:
            s["latent"].append(row["latent_rel_error"]["mean"])
        ov = row.get("index_overlap")
        if ov:
            key = next(k for k in ("mxfp4_vs_fp8", "bf16_vs_float32", "all_vs_native") if k in ov)
            s["overlap"].append(ov[key]["mean"])
    return {p: {k: (sum(v) / len(v) if v and k != "layers" else (v if k == "layers" else None)) for k, v in s.items()}
            for p, s in sorted(out.items(), key=lambda kv: PARTS.index(kv[0]))}


def table_markdown(doc: dict) -> str:
    """Markdown table: one row per part, its layers, the mean over them of the output error,
    the latent error (bf16 state) and the indexer top-k overlap."""
    lines = ["| part | layers | output rel. error, mean | latent rel. error, mean | indexer top-k overlap, mean |",
             "|---|---|---|---|---|"]
    for part, s in summary(doc).items():
        cells = [f"{s[k]:.4f}" if s[k] is not None else "-" for k in ("output", "latent", "overlap")]
        lines.append(f"| {part} | {','.join(map(str, s['layers']))} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def table_per_layer(doc: dict) -> str:
    """Markdown table: output error (mean) per layer (rows) and part (columns)."""
    layers = sorted({r["layer"] for r in doc["results"]})
    cell = {(r["layer"], r["part"]): r for r in doc["results"]}
    parts = [p for p in PARTS if any(r["part"] == p for r in doc["results"])]
    lines = ["| layer (ratio) | " + " | ".join(parts) + " |", "|---|" + "---|" * len(parts)]
    for layer in layers:
        ratio = next(r["ratio"] for r in doc["results"] if r["layer"] == layer)
        vals = []
        for p in parts:
            r = cell.get((layer, p))
            if r is None:
                vals.append("-")
            elif "output_rel_error" in r:
                vals.append(f"{r['output_rel_error']['mean']:.4f}")
            else:
                vals.append(f"overlap {r['index_overlap']['mxfp4_vs_fp8']['mean']:.4f}")
        lines.append(f"| {layer} ({ratio}) | " + " | ".join(vals) + " |")
    return "\n".join(lines)
