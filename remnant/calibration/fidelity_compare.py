"""Fidelity comparison of every policy across retentions on a split by capture source.

Every policy reads only the --train captures: the learned scorer is trained on them
(remnant.calibration.learned, saved next to the report as NAME.scorer.json) and the
training-free policies (magnitude, attention, prefix, random) are calibrated on their
queries and records (several --train files: each layer's queries and records
concatenated). Each policy's map is then measured on the --eval capture, a source no
policy saw: all its query tokens over its own records, per layer and R, with
remnant.calibration.fidelity_metrics.measure (FP8 native records; no window, no sink,
every record selected). --synthetic splits one synthetic capture set
(remnant.calibration.captures.synthetic_captures) into two sources: the first half of its
query tokens and records for training, the second half for evaluation.

`compare` writes NAME.json (schema remnant/fidelity v2: the split by fingerprint and
source, settings, results per (layer, R, policy), the plots with their sha256, limits),
NAME.scorer.json (remnant/learned-scorer), NAME.error-vs-r.png (mean output error over
layers vs R, one line per policy) and NAME.heatmap.png (per policy a layers x R map of
the mean output error, plus learned minus the best training-free policy). Its command:
remnant.cli.fidelity (`compare`).
"""

from __future__ import annotations

import hashlib
import json
from datetime import datetime, timezone
from pathlib import Path

import torch

from remnant.calibration.captures import SYNTHETIC_LIMIT, Captures, LayerCapture, synthetic_captures
from remnant.calibration.fidelity_metrics import measure
from remnant.calibration.learned import (Hyperparameters, LearnedScorer, capture_ref, check_training_set,
                                         one_thread, train)
from remnant.calibration.policies import choose
from remnant.calibration.retention import LEARNED, POLICIES
from remnant.kv.codec import quantize

#: The policies a comparison measures, in report order.
COMPARE_POLICIES = POLICIES + (LEARNED,)


def synthetic_split(seed: int = 0, layers=(2, 4), heads: int = 64, queries: int = 64,
                    records: int = 1024) -> tuple[Captures, Captures]:
    """Two capture sets from one synthetic generator (synthetic_captures with these
    arguments): the first half of each layer's query tokens and records as source
    "synthetic-train", the second half as "synthetic-eval". They share the channel
    structure (the same planted channels) but no query and no record. Fingerprints: sha256
    of the generator's canonical params plus the half's name."""
    whole = synthetic_captures(layers=layers, heads=heads, queries=queries, records=records, seed=seed)
    t, n = queries // 2, records // 2
    if t < 1 or n < 1:
        raise ValueError(f"queries={queries} and records={records} must be >= 2 to split them in two")
    out = []
    for part, qs, ks in (("train", slice(0, t), slice(0, n)), ("eval", slice(t, None), slice(n, None))):
        params = {**whole.params, "split": part}
        fp = hashlib.sha256(json.dumps(params, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
        out.append(Captures(model_id=whole.model_id, source=f"synthetic-{part}", fingerprint=fp, params=params,
                            layers={layer: LayerCapture(c.q[qs], c.k[ks]) for layer, c in whole.layers.items()}))
    return out[0], out[1]


def check_split(train_named: list[tuple[str, Captures]], eval_named: tuple[str, Captures]) -> list[int]:
    """The CSA layers of a valid split; ValueError naming the file and field where the eval
    captures come from another model or hold other layers than the training captures, or
    share a source or fingerprint with one of them (the split is by capture source)."""
    layers = check_training_set(train_named)
    name, ev = eval_named
    first_name, first = train_named[0]
    if ev.model_id != first.model_id:
        raise ValueError(f"{name}: model_id is {ev.model_id!r}; the training captures {first_name} have "
                         f"{first.model_id!r}")
    if sorted(ev.layers) != layers:
        raise ValueError(f"{name}: layers are {sorted(ev.layers)}; the training captures {first_name} have {layers}")
    for train_name, c in train_named:
        if c.fingerprint == ev.fingerprint:
            raise ValueError(f"{name}: the same captures (fingerprint) as --train {train_name}")
        if c.source == ev.source:
            raise ValueError(f"{name}: source is {ev.source!r}, as --train {train_name}'s; the split is by "
                             "capture source, so --eval must come from a source no policy trains on")
    return layers


def _concat(caps: list[LayerCapture]) -> LayerCapture:
    if len(caps) == 1:
        return caps[0]
    return LayerCapture(q=torch.cat([c.q for c in caps]), k=torch.cat([c.k for c in caps]))


def evaluate_split(train_named: list[tuple[str, Captures]], eval_named: tuple[str, Captures],
                   scorer: LearnedScorer, policies: list[str], retention_values: list[int], top_k: int = 64,
                   seed: int = 0, progress: bool | None = None) -> list[dict]:
    """One result per (layer, R, policy), in that order: measure() of each policy's kept
    coordinates (chosen from the training captures) on the eval captures. Cells whose kept
    coordinates equal an earlier cell's of the same layer (every policy at R = 64) reuse its
    measurement, which is the same computation."""
    from tqdm import tqdm

    layers = check_split(train_named, eval_named)
    scorer.check(eval_named[1], eval_named[0])
    ev = eval_named[1]
    cells = [(layer, r, p) for layer in layers for r in retention_values for p in policies]
    results, calib, measured = [], {}, {}
    with one_thread():
        for cell in tqdm(cells, desc="fidelity compare", unit="cell",
                         disable=None if progress is None else not progress):
            results.append(_cell(cell, train_named, ev, scorer, seed, top_k, calib, measured))
    return results


def _cell(cell, train_named, ev, scorer, seed, top_k, calib: dict, measured: dict) -> dict:
    """One (layer, R, policy) result. calib caches the layer's training capture and its eval
    records; measured caches results by kept coordinates (both are cleared per layer)."""
    layer, retention, policy = cell
    if calib.get("layer") != layer:
        calib.clear()
        measured.clear()
        calib.update(layer=layer, capture=_concat([c.layers[layer] for _, c in train_named]),
                     records=quantize(ev.layers[layer].k))
    if policy == LEARNED:
        keep = scorer.keep(layer, retention)
    else:
        keep = choose(policy, calib["capture"], retention, seed=seed, layer=layer)
    key = tuple(keep.tolist())
    if key not in measured:
        measured[key] = measure(ev.layers[layer], calib["records"], keep, top_k)
    return {"layer": layer, "retention": retention, "policy": policy, **measured[key]}


def _ref(name: str, c: Captures) -> dict:
    return {**capture_ref(c), "file": name, "params": c.params}


def document(train_named, eval_named, scorer: LearnedScorer, scorer_file: str, results: list[dict],
             policies: list[str], retention_values: list[int], top_k: int, seed: int,
             plots: list[dict], extra_limits: list[str]) -> dict:
    """The remnant/fidelity v2 document (remnant.records.kinds.FIDELITY)."""
    from remnant.records.kinds import FIDELITY
    from remnant.records.provenance import sources

    train_sources = ", ".join(f"{c.source} ({c.fingerprint[:12]})" for _, c in train_named)
    ev = eval_named[1]
    hp = scorer.to_dict()["hyperparameters"]
    limits = [
        f"captures of model {ev.model_id!r}: trained and calibrated on {train_sources}; measured on "
        f"{ev.source} ({ev.fingerprint[:12]}), a capture source no policy read",
        "split by capture source, not by token: the learned scorer's training and the training-free "
        "policies' calibration read only the --train captures",
        "decode attention over the eval capture's records only: no sliding window, no sink, every record "
        "selected (not the indexer's top-k)",
        f"one learned scorer: {hp['steps']} steps per layer, seed {scorer.seed}, init {hp['init']}; one "
        "training run, no spread over seeds",
    ]
    if len(train_named) > 1:
        limits.append("several --train files: the training-free policies read each layer's queries and "
                      "records concatenated")
    if any(c.source.startswith("synthetic") for _, c in [*train_named, eval_named]):
        limits.insert(0, SYNTHETIC_LIMIT)
    limits.extend(extra_limits)
    return {
        **FIDELITY.header(),
        "created_at": datetime.now(timezone.utc).isoformat(),
        "sources": sources(),
        "model_id": ev.model_id,
        "split": {"by": "capture source",
                  "train": [_ref(n, c) for n, c in train_named],
                  "eval": [_ref(*eval_named)]},
        "scorer": {"file": scorer_file, "fingerprint": scorer.fingerprint, "method": scorer.to_dict()["method"],
                   "hyperparameters": hp, "seed": scorer.seed},
        "settings": {"policies": policies, "retention_values": retention_values, "top_k": top_k, "seed": seed},
        "results": results,
        "plots": plots,
        "limits": limits,
    }


def mean_error(doc: dict) -> dict[tuple[int, str], float]:
    """(R, policy) -> mean output_rel_error averaged over layers."""
    out: dict[tuple[int, str], list[float]] = {}
    for x in doc["results"]:
        out.setdefault((x["retention"], x["policy"]), []).append(x["output_rel_error"]["mean"])
    return {k: sum(v) / len(v) for k, v in out.items()}


def table_markdown(doc: dict) -> str:
    """Markdown table of the mean output error per R (rows) and policy (columns), averaged over
    layers; the best policy of each row in bold."""
    policies = doc["settings"]["policies"]
    err = mean_error(doc)
    lines = ["| R | " + " | ".join(policies) + " |", "|---|" + "---|" * len(policies)]
    for r in doc["settings"]["retention_values"]:
        best = min(err[r, p] for p in policies)
        cells = [f"**{err[r, p]:.4f}**" if err[r, p] == best and len(policies) > 1 else f"{err[r, p]:.4f}"
                 for p in policies]
        lines.append(f"| {r} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(doc: dict, stem: Path) -> list[Path]:
    """Write stem.error-vs-r.png and stem.heatmap.png; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import LogNorm, TwoSlopeNorm

    policies = doc["settings"]["policies"]
    rs = doc["settings"]["retention_values"]
    layers = sorted({x["layer"] for x in doc["results"]})
    cell = {(x["layer"], x["retention"], x["policy"]): x["output_rel_error"]["mean"] for x in doc["results"]}
    err = mean_error(doc)
    split = doc["split"]
    title = (f"train {'+'.join(c['source'] for c in split['train'])} -> eval "
             f"{split['eval'][0]['source']} ({doc['model_id']})")
    meta = {"Software": None}  # no matplotlib version in the file: same plot, same bytes

    curve = stem.parent / f"{stem.name}.error-vs-r.png"
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for p in policies:
        ax.plot(rs, [err[r, p] for r in rs], marker="o", label=p, linewidth=2 if p == LEARNED else 1.2)
    ax.set_xlabel("retention R (coordinates kept of 512)")
    ax.set_ylabel(f"output relative error (mean over {len(layers)} layers)")
    ax.set_yscale("log")
    ax.set_xticks(rs)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(curve, dpi=110, metadata=meta)
    plt.close(fig)

    heat = stem.parent / f"{stem.name}.heatmap.png"
    grids = {p: np.array([[cell[layer, r, p] for r in rs] for layer in layers]) for p in policies}
    panels = list(policies)
    free = [p for p in policies if p != LEARNED]
    diff = None
    if LEARNED in policies and free:
        diff = grids[LEARNED] - np.min(np.stack([grids[p] for p in free]), axis=0)
        panels.append("learned - best training-free")
    cols = 2 if len(panels) > 1 else 1
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.5 * cols, rows * (0.9 + 0.42 * len(layers)) + 0.6),
                             squeeze=False, layout="constrained")
    positive = np.concatenate([g[g > 0] for g in grids.values()] + [np.array([1.0])])
    norm = LogNorm(vmin=max(positive.min(), 1e-6), vmax=max(positive.max(), 1e-5))
    flat = list(axes.flat)
    for ax, name in zip(flat, panels):
        if name in grids:
            values = grids[name]
            im = ax.imshow(np.clip(values, norm.vmin, None), aspect="auto", cmap="viridis", norm=norm)
            shade = norm(np.clip(values, norm.vmin, None))
        else:
            values = diff
            bound = float(np.abs(diff).max()) or 1e-12
            im = ax.imshow(diff, aspect="auto", cmap="RdBu_r", norm=TwoSlopeNorm(0.0, -bound, bound))
            shade = np.full(diff.shape, 0.5)
        for i in range(len(layers)):
            for j in range(len(rs)):
                # viridis is bright at the top: dark text there, light text below
                color = "black" if name not in grids or shade[i, j] > 0.6 else "white"
                ax.text(j, i, f"{values[i, j]:.3g}", ha="center", va="center", fontsize=6.5, color=color)
        ax.set_yticks(range(len(layers)), [f"layer {layer}" for layer in layers], fontsize=7)
        ax.set_xticks(range(len(rs)), [str(r) for r in rs], fontsize=7)
        ax.set_xlabel("retention R", fontsize=7)
        ax.set_title(name if name in grids else f"{name} (< 0: learned better)", fontsize=8)
        fig.colorbar(im, ax=ax, fraction=0.05, pad=0.02)
    for ax in flat[len(panels):]:
        ax.set_visible(False)
    fig.suptitle(f"output relative error per layer and R (eval source); {title}", fontsize=9)
    fig.savefig(heat, dpi=110, metadata=meta)
    plt.close(fig)
    return [curve, heat]


def compare(train_named: list[tuple[str, Captures]], eval_named: tuple[str, Captures], policies: list[str],
            retention_values: list[int], top_k: int, seed: int, hp: Hyperparameters, limits: list[str],
            out: Path) -> tuple[dict, Path]:
    """The comparison end to end: train the scorer on `train_named` (saved beside `out` as
    NAME.scorer.json), measure every policy on `eval_named`, draw the plots beside `out`
    and write the report (remnant/fidelity v2) to `out`, a .json path. Returns the
    document and the path written. A ValueError or OSError leaves no scorer or plot
    without the report that names them."""
    from remnant.records.provenance import sha256_file
    from remnant.records.schema import validate, write_validated

    made: list[Path] = []
    try:
        check_split(train_named, eval_named)
        stem = out.with_suffix("")
        scorer_path = out.parent / f"{stem.name}.scorer.json"
        scorer = train(train_named, hp, seed=seed)
        scorer.save(scorer_path)  # first: the report names the scorer file's sha256
        made.append(scorer_path)
        results = evaluate_split(train_named, eval_named, scorer, policies, retention_values, top_k, seed)
        doc = document(train_named, eval_named, scorer, scorer_path.name, results, policies, retention_values,
                       top_k, seed, [], limits)
        validate(doc, source=str(out))  # before the plots: a bad report makes no files
        paths = plot(doc, stem)
        made += paths
        doc["plots"] = [{"file": x.name, "sha256": sha256_file(x)} for x in paths]
        return doc, write_validated(out, doc)
    except (ValueError, OSError):
        for leftover in made:
            leftover.unlink(missing_ok=True)
        raise
