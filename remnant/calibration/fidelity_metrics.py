"""What a fidelity report measures: packed against native decode attention on the same
queries and records, per query token and head (remnant.calibration.fidelity's
single-capture report and remnant.calibration.fidelity_compare's comparison both report
it).

- output_rel_error: ||o_packed - o_native|| / ||o_native|| (mean, p50, p95, max), o from
  remnant.kv.attention's attend_native and attend_packed;
- topk_overlap: |top-k(scores_packed) & top-k(scores_native)| / k, mean over tokens and
  heads;
- softmax_kl: KL(p_native || p_packed) in nats, mean over tokens and heads.

The indexer's key formats are measured here too: `top_k_overlap` (how much of one top-k
selection another keeps) and `index_key_overlap` (the lightning indexer's top-k from keys
stored as MXFP4 against the same from FP8 keys, and each against unquantized keys).
The embedded engine's remnant-capture/2 files hold the indexer's queries, weights and keys
(remnant.calibration.fidelity_parts runs index_key_overlap on them);
`synthetic_indexer_inputs` gives heavy-tailed stand-ins where no capture has them.
"""

from __future__ import annotations

import torch

from remnant.calibration.captures import LayerCapture
from remnant.kv.attention import SOFTMAX_SCALE, attend_native, attend_packed, packed_keys
from remnant.kv.codec import dequantize
from remnant.kv.formats import HEAD_DIM, NOPE_DIM
from remnant.kv.index_keys import index_key_format
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


def top_k_overlap(scores_a: torch.Tensor, scores_b: torch.Tensor, k: int) -> torch.Tensor:
    """Per row, the fraction of b's top-k that is also in a's: |top-k(a) & top-k(b)| / k.

    scores_a, scores_b: float [..., n], two scorings of the same n candidates; k is clamped
    to n (k = n gives 1). Returns float64 [...]. Ties are broken as torch.topk breaks them,
    and -inf entries are ordinary candidates (mask rows to their visible columns first)."""
    if scores_a.shape != scores_b.shape or scores_a.ndim < 1:
        raise ValueError(f"scores_a and scores_b must have one shape [..., n], got {tuple(scores_a.shape)} and "
                         f"{tuple(scores_b.shape)}")
    if k < 1:
        raise ValueError(f"k={k} must be at least 1")
    n = scores_a.shape[-1]
    k = min(k, n)
    if n == 0:
        return torch.ones(scores_a.shape[:-1], dtype=torch.float64)
    top_a = scores_a.topk(k, dim=-1).indices
    top_b = scores_b.topk(k, dim=-1).indices
    in_a = torch.zeros(scores_a.shape, dtype=torch.bool, device=scores_a.device).scatter_(-1, top_a, True)
    return in_a.gather(-1, top_b).double().mean(dim=-1)


def indexer_scores(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """The lightning indexer's scores in float64: sum_h w[t, h] relu(q[t, h] . keys[j]).
    q float [T, H, d], w float [T, H], keys float [n, d] -> float64 [T, n] (what
    remnant.kernels.indexer.index_scores_reference computes from pages)."""
    return torch.einsum("th,thn->tn", w.double(), torch.relu(torch.einsum("thd,nd->thn", q.double(), keys.double())))


def index_key_overlap(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, top_k: int = 512,
                      formats: tuple[str, str] = ("fp8", "mxfp4"), chunk: int = 16) -> dict:
    """How the indexer's top-k changes when its keys are stored in formats[1] rather than
    formats[0] (remnant.kv.index_keys), and each against unquantized keys.

    q float [T, H, d] indexer queries (as the indexer multiplies them: after RoPE and any
    rotation), w float [T, H] head weights, keys float [n, d] the keys before quantization.
    Every token sees all n keys. Returns {"<b>_vs_<a>", "<a>_vs_exact", "<b>_vs_exact":
    {"mean", "p50", "p5", "min"} of the per-token overlap (top_k_overlap), "tokens", "keys",
    "top_k", "formats"}; T is scored `chunk` tokens at a time."""
    if q.ndim != 3 or w.shape != q.shape[:2] or keys.ndim != 2 or keys.shape[1] != q.shape[2]:
        raise ValueError(f"q must be [T, H, d], w [T, H] and keys [n, d], got q {tuple(q.shape)}, w "
                         f"{tuple(w.shape)}, keys {tuple(keys.shape)}")
    a, b = (index_key_format(name, keys.shape[1]) for name in formats)
    stored = {f.name: f.dequantize(f.quantize(keys)) for f in (a, b)}
    pairs = {f"{b.name}_vs_{a.name}": (stored[a.name], stored[b.name]),
             f"{a.name}_vs_exact": (keys, stored[a.name]), f"{b.name}_vs_exact": (keys, stored[b.name])}
    overlaps = {name: [] for name in pairs}
    for t in range(0, q.shape[0], chunk):
        qt, wt = q[t : t + chunk], w[t : t + chunk]
        scores = {}
        for name, (ref, got) in pairs.items():
            for kk in (ref, got):
                if id(kk) not in scores:
                    scores[id(kk)] = indexer_scores(qt, wt, kk)
            overlaps[name].append(top_k_overlap(scores[id(ref)], scores[id(got)], top_k))
    out = {}
    for name, parts in overlaps.items():
        v = torch.cat(parts)
        out[name] = {"mean": float(v.mean()), "p50": float(v.quantile(0.5)), "p5": float(v.quantile(0.05)),
                     "min": float(v.min())}
    return {**out, "tokens": int(q.shape[0]), "keys": int(keys.shape[0]), "top_k": min(top_k, keys.shape[0]),
            "formats": [a.name, b.name]}


def hadamard(d: int) -> torch.Tensor:
    """The orthonormal Sylvester Hadamard matrix float64 [d, d] (d a power of two): the
    rotation DeepSeek-V4's indexer applies to its queries and keys before quantizing them
    (SGLang's fused kernels: butterflies scaled by 1 / sqrt(d)); scores are unchanged."""
    if d < 1 or d & (d - 1):
        raise ValueError(f"d={d} must be a power of two")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / d**0.5


def synthetic_indexer_inputs(seed: int = 0, tokens: int = 32, keys: int = 8192, heads: int = 64, dim: int = 128,
                             rotate: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Heavy-tailed stand-ins for indexer queries float32 [tokens, heads, dim], weights
    float32 [tokens, heads] and keys float32 [keys, dim]; a limit on anything measured
    with them: not DeepSeek-V4's indexer.

    Coordinates are Student-t with 3 degrees of freedom, times per-channel scales shared
    by keys and queries (log-normal, sigma 1: a few channels carry most of the energy, as
    activation outliers do), keys times a per-key log-normal norm (sigma 0.5); weights
    standard normal. rotate: both then go through `hadamard(dim)`, as V4's indexer rotates
    them before quantizing (which spreads the outlier channels over all coordinates)."""
    g = torch.Generator().manual_seed(seed)

    def student_t(*shape):
        # torch's StudentT takes no generator: a normal over the root of a chi-square / 3.
        return torch.randn(*shape, generator=g) / (torch.randn(*shape, 3, generator=g).pow(2).sum(-1) / 3).sqrt()

    channel = torch.exp(torch.randn(dim, generator=g))
    k = student_t(keys, dim) * channel * torch.exp(0.5 * torch.randn(keys, 1, generator=g))
    q = student_t(tokens, heads, dim) * channel
    w = torch.randn(tokens, heads, generator=g)
    if rotate:
        h = hadamard(dim)
        k, q = (k.double() @ h), (q.double() @ h)
    return q.float(), w.float(), k.float()
