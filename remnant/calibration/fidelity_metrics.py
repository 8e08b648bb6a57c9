"""What a fidelity report measures: packed against native decode attention on the same
queries and records, per query token and head (remnant.calibration.fidelity's
single-capture report and remnant.calibration.fidelity_compare's comparison both report
it).

- output_rel_error: ||o_packed - o_native|| / ||o_native|| (mean, p50, p95, max), o from
  remnant.kv.attention's attend_native and attend_packed;
- topk_overlap: |top-k(scores_packed) & top-k(scores_native)| / k, mean over tokens and
  heads;
- softmax_kl: KL(p_native || p_packed) in nats, mean over tokens and heads.
"""

from __future__ import annotations

import torch

from remnant.calibration.captures import LayerCapture
from remnant.kv.attention import SOFTMAX_SCALE, attend_native, attend_packed, packed_keys
from remnant.kv.codec import dequantize
from remnant.kv.formats import HEAD_DIM, NOPE_DIM
from remnant.kv.packing import pack


def _dist(values: torch.Tensor) -> dict:
    v = values.double()
    return {
        "mean": float(v.mean()),
        "p50": float(v.quantile(0.5)),
        "p95": float(v.quantile(0.95)),
        "max": float(v.max()),
    }


def measure(evaluation: LayerCapture, records: torch.Tensor, keep: torch.Tensor, top_k: int) -> dict:
    """Packed vs native on `evaluation` queries over native `records` (uint8 [n, 584])."""
    q = evaluation.q.double()
    n = records.shape[0]
    k = min(top_k, n)
    heads = q.shape[1]
    every = torch.arange(n)
    no_window = records[:0]
    no_sink = torch.full((heads,), float("-inf"), dtype=torch.float64)
    packed = pack(records, keep)
    native_keys = dequantize(records).double()
    cols = torch.cat([keep, torch.arange(NOPE_DIM, HEAD_DIM)])
    kept_keys = packed_keys(packed, keep).double()
    errors, overlaps, kls = [], [], []
    for qt in q:  # one decode token: [H, 512]
        o_native = attend_native(qt, no_window, records, every, no_sink)
        o_packed = attend_packed(qt, no_window, packed, keep, every, no_sink)
        errors.append((o_packed - o_native).norm(dim=1) / o_native.norm(dim=1).clamp_min(1e-300))
        s_native = qt @ native_keys.T * SOFTMAX_SCALE
        s_packed = qt[:, cols] @ kept_keys.T * SOFTMAX_SCALE
        top_n = s_native.topk(k, dim=1).indices
        top_p = s_packed.topk(k, dim=1).indices
        hit = torch.zeros(heads, n, dtype=torch.bool).scatter_(1, top_n, True).gather(1, top_p)
        overlaps.append(hit.double().mean(dim=1))
        log_pn = torch.log_softmax(s_native, dim=1)
        log_pp = torch.log_softmax(s_packed, dim=1)
        kls.append((log_pn.exp() * (log_pn - log_pp)).sum(dim=1))
    return {
        "output_rel_error": _dist(torch.cat(errors)),
        "topk_overlap": float(torch.cat(overlaps).mean()),
        "softmax_kl": float(torch.cat(kls).mean()),
        "queries": int(q.shape[0]),
        "heads": heads,
        "records": n,
    }
