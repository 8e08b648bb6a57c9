"""Fidelity of packed attention against native, per CSA layer, retention R and policy.

For each layer of a capture file, the policy chooses kept coordinates from calibration
queries (the first half of the capture's query tokens) and the layer's records; the report
measures on the held-out queries (the second half), over the same records, all of them
selected, no window and no sink (the window and sink are identical in every mode, so
leaving them out isolates what packing changes). What it measures per query token and
head, the output error, the top-k overlap (k = top_k records) and the softmax KL, is
remnant.calibration.fidelity_metrics'. Latents are FP8-quantized first, so "native" is
what SGLang stores, not the float latent.

That single-capture report (`report`, schema remnant/fidelity v1) splits one capture by
token and compares the training-free policies. The comparison across every policy, the
learned one included, on a split by capture source is remnant.calibration.fidelity_compare
(schema remnant/fidelity v2). Both versions are written today: two layouts of one kind,
not an old and a new one (remnant.records.kinds, FIDELITY_SINGLE_CAPTURE and FIDELITY,
says why). Their command: remnant.cli.fidelity.
"""

from __future__ import annotations

from datetime import datetime, timezone

from remnant.calibration.captures import SYNTHETIC_LIMIT, Captures, LayerCapture
from remnant.calibration.fidelity_metrics import measure
from remnant.calibration.policies import choose
from remnant.kv.codec import quantize


def split(capture: LayerCapture) -> tuple[LayerCapture, LayerCapture]:
    """Calibration (first half of query tokens) and evaluation (second half) captures."""
    t = capture.q.shape[0]
    if t < 2:
        raise ValueError(f"a capture needs >= 2 query tokens to hold some out for evaluation, got {t}")
    half = t // 2
    return LayerCapture(capture.q[:half], capture.k), LayerCapture(capture.q[half:], capture.k)


def evaluate(captures: Captures, policies: list[str], retention_values: list[int], top_k: int = 64,
             seed: int = 0, progress: bool | None = None) -> list[dict]:
    """One result per (layer, R, policy), in that order."""
    from tqdm import tqdm

    results = []
    cells = [(layer, r, p) for layer in sorted(captures.layers) for r in retention_values for p in policies]
    prepared: dict[int, tuple] = {}
    for layer, retention, policy in tqdm(cells, desc="fidelity", unit="cell", disable=None if progress is None else not progress):
        if layer not in prepared:
            calibration, evaluation = split(captures.layers[layer])
            prepared[layer] = (calibration, evaluation, quantize(captures.layers[layer].k))
        calibration, evaluation, records = prepared[layer]
        keep = choose(policy, calibration, retention, seed=seed, layer=layer)
        results.append({"layer": layer, "retention": retention, "policy": policy,
                        **measure(evaluation, records, keep, top_k)})
    return results


def report(captures: Captures, policies: list[str], retention_values: list[int], top_k: int = 64,
           seed: int = 0, progress: bool | None = None) -> dict:
    """The remnant/fidelity v1 document for `captures` (remnant.records.kinds.FIDELITY_SINGLE_CAPTURE)."""
    from remnant.records.kinds import FIDELITY_SINGLE_CAPTURE
    from remnant.records.provenance import sources

    limits = [
        "decode attention over the capture's records only: no sliding window, no sink, every record selected",
        "policies calibrated on the first half of each layer's query tokens, measured on the second half",
    ]
    if captures.source == "synthetic":
        limits.insert(0, SYNTHETIC_LIMIT)
    return {
        **FIDELITY_SINGLE_CAPTURE.header(),
        "created_at": datetime.now(timezone.utc).isoformat(),
        "sources": sources(),
        "captures": {"model_id": captures.model_id, "source": captures.source,
                     "fingerprint": captures.fingerprint, "params": captures.params},
        "settings": {"policies": policies, "retention_values": retention_values, "top_k": top_k, "seed": seed},
        "results": evaluate(captures, policies, retention_values, top_k, seed, progress),
        "limits": limits,
    }


def table(doc: dict) -> str:
    """Mean output error per R (rows) and policy (columns), averaged over layers."""
    policies = doc["settings"]["policies"]
    lines = ["R     " + "".join(f"{p:>12}" for p in policies)]
    for r in doc["settings"]["retention_values"]:
        cells = []
        for p in policies:
            vals = [x["output_rel_error"]["mean"] for x in doc["results"] if x["retention"] == r and x["policy"] == p]
            cells.append(f"{sum(vals) / len(vals):>12.4f}")
        lines.append(f"{r:<6}" + "".join(cells))
    return "\n".join(lines)
