"""Training-free retention policies: which NoPE coordinates a CSA layer keeps.

Each policy scores the 448 NoPE coordinates of one layer from its calibration capture and
keeps the N = R - 64 best (RoPE 448..511 is always kept, so it is never a candidate).
Ties go to the lower index, so the choice is deterministic. Learned scoring is an offline
research extension in remnant.calibration.learned (it reuses `top`), not one of POLICIES.
"""

from __future__ import annotations

import math

import torch

from remnant.calibration.captures import Captures, LayerCapture
from remnant.calibration.retention import POLICIES, LayerKeep, RetentionMap
from remnant.kv.formats import HEAD_DIM, NOPE_DIM, RETENTION_VALUES, ROPE_DIM

# Bound on the float64 [T-chunk, H, n] score block of the attention policy (elements).
_ATTENTION_BLOCK = 1 << 24


def choose(policy: str, capture: LayerCapture, retention: int, seed: int = 0,
           layer: int = 0) -> torch.Tensor:
    """Kept NoPE indices of one CSA layer: int64 [N], sorted ascending, N = retention - 64.

    policy: one of POLICIES. capture: the layer's queries q [T, H, 512] and latents
    k [n, 512] (prefix and random ignore it). retention: R in 64..448 step 64.
    seed, layer: the random policy draws with torch.Generator seeded with seed + layer.
    """
    if policy not in POLICIES:
        raise ValueError(f"policy={policy!r} is not allowed; allowed: {', '.join(POLICIES)}")
    if isinstance(retention, bool) or retention not in RETENTION_VALUES:
        raise ValueError(f"retention={retention!r} is not allowed; allowed: "
                         + ", ".join(map(str, RETENTION_VALUES)))
    n_keep = retention - ROPE_DIM
    if policy == "prefix":
        return torch.arange(n_keep, dtype=torch.int64)
    if policy == "random":
        g = torch.Generator().manual_seed(seed + layer)
        return torch.randperm(NOPE_DIM, generator=g)[:n_keep].sort().values
    capture.check(f"layer {layer} capture")
    score = magnitude_score(capture) if policy == "magnitude" else attention_score(capture)
    return top(score, n_keep)


def top(score: torch.Tensor, n_keep: int) -> torch.Tensor:
    """Indices of the n_keep largest of score [448], ties to the lower index; sorted int64."""
    order = torch.sort(score, descending=True, stable=True).indices
    return order[:n_keep].sort().values.to(torch.int64)


def magnitude_score(capture: LayerCapture) -> torch.Tensor:
    """E[k_i^2] over the capture's records, float64 [448] (NoPE coordinates)."""
    return capture.k[:, :NOPE_DIM].double().pow(2).mean(0)


def attention_score(capture: LayerCapture) -> torch.Tensor:
    """ThinK-style query-aware score of each NoPE coordinate i, float64 [448].

    With s = 1/sqrt(512), per query t and head h over the capture's n records
    (float64; the sink and the indexer's top-k selection are not modelled):
        p_j = softmax_j(s * q.k_j),   o = sum_j p_j k_j,   spread = sum_j p_j ||k_j - o||^2
        score_i = s^2 E_t,h[q_i^2] E_j[k_i^2] E_t,h[spread]  +  E_t,h[o_i^2].
    Logit term: dropping coordinate i moves every logit by -s q_i k_ji; to first order
    the output then moves by the p-covariance of that logit shift with k_j, bounded by
    (logit perturbation variance, about s^2 E[q_i^2] E[k_i^2]) times the value spread.
    Value term: V = K, so dropping i also zeroes output coordinate i, losing o_i^2.
    """
    q, k = capture.q.double(), capture.k.double()
    t_count, heads, _ = q.shape
    n = k.shape[0]
    s = 1.0 / math.sqrt(HEAD_DIM)
    k_sq = k.pow(2).sum(-1)  # ||k_j||^2 [n]
    spread_sum = 0.0
    o_sq_sum = torch.zeros(HEAD_DIM, dtype=torch.float64)
    chunk = max(1, _ATTENTION_BLOCK // (heads * n))
    for start in range(0, t_count, chunk):
        p = torch.softmax(s * torch.einsum("thd,nd->thn", q[start:start + chunk], k), dim=-1)
        o = p @ k  # [t, H, 512]
        # sum_j p_j ||k_j - o||^2 = sum_j p_j ||k_j||^2 - ||o||^2 (sum_j p_j = 1).
        spread = (p @ k_sq - o.pow(2).sum(-1)).clamp_min(0.0)
        spread_sum += float(spread.sum())
        o_sq_sum += o.pow(2).sum((0, 1))
    count = t_count * heads
    logit = s * s * q.pow(2).mean((0, 1)) * k.pow(2).mean(0) * (spread_sum / count)
    value = o_sq_sum / count
    return (logit + value)[:NOPE_DIM]


def build_map(captures: Captures, policy: str, retention_values: list[int], seed: int = 0) -> RetentionMap:
    """Retention map of every captured CSA layer, one retention per layer in ascending
    layer order (see remnant.calibration.retention.profile_values for a uniform profile).

    policy_params records {"seed": seed} for random, {} for the other policies. calibration
    records the captures' fingerprint and source, and the fewest query tokens and records
    over layers.
    """
    if policy not in POLICIES:
        raise ValueError(f"policy={policy!r} is not allowed; allowed: {', '.join(POLICIES)}")
    layers = sorted(captures.layers)
    if len(retention_values) != len(layers):
        raise ValueError(f"retention_values has {len(retention_values)} values; the captures have "
                         f"{len(layers)} CSA layers {layers}")
    entries = []
    for layer, retention in zip(layers, retention_values):
        keep = choose(policy, captures.layers[layer], retention, seed=seed, layer=layer)
        entries.append(LayerKeep(layer=layer, retention=retention, keep=keep.tolist()))
    calibration = {
        "fingerprint": captures.fingerprint,
        "source": captures.source,
        "queries": min(int(c.q.shape[0]) for c in captures.layers.values()),
        "records": min(int(c.k.shape[0]) for c in captures.layers.values()),
    }
    return RetentionMap(model_id=captures.model_id, policy=policy,
                        policy_params={"seed": seed} if policy == "random" else {},
                        calibration=calibration, layers=entries)
