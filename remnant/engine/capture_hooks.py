"""What a capture server's layers hand its recorder (remnant.calibration.capture_recorder),
from the batched decode and prefill steps and the per-sequence reference alike.

Each function only copies: it reads tensors the step computed (and, for the bf16-state
twins, runs the compressor once more on a bf16 rounding of the same inputs), writes
nothing the step reads, and returns nothing. Callers test `model.recorder is not None`
first, so a server without a capture pays no call.
"""

from __future__ import annotations

import torch

from remnant.kv.formats import CSA_RATIO


def record_tokens(model, li: int, layer, q: torch.Tensor, iw: torch.Tensor | None, q_lora: torch.Tensor | None,
                  kv: torch.Tensor, decode: bool) -> None:
    """A step's tokens on layer li: their window latents kv [T, 512] (every token: each is a
    window record for the next window - 1 tokens) and, for decode tokens (`decode`), their
    queries q [T, H, 512] (the model's column order) with, on CSA layers, the indexer's
    queries and head weights of the same tokens (from iw and q_lora)."""
    rec = model.recorder
    if rec.wants(li, "window"):
        rec.add_window(li, kv)
    if decode and rec.wants(li, "queries"):
        index_q = index_w = None
        if layer.ratio == CSA_RATIO:
            index_q, index_w = model.index_queries(layer, iw, q_lora)
        rec.add_queries(li, model.natural_q(li, q), index_q, index_w)  # policies read natural q


def record_blocks(model, li: int, layer, c: torch.Tensor, g: torch.Tensor, index: torch.Tensor,
                  latents: torch.Tensor, state_dtype: torch.dtype, ik: torch.Tensor | None = None) -> None:
    """Blocks just compressed on layer li: the compressor's inputs c, g [n, ratio, 512] as its
    state held them (float32 values), their block indices [n] and latents [n, 512]; on CSA
    layers ik [n, ratio, d], the index-key inputs, whose mean is the block's index key. With
    a float32 state, also the latents and index keys the same inputs give held in bf16 (as
    host.compressor_state_dtype=bfloat16 holds them); with a bf16 state the recorded ones
    already are, and no twin is recorded."""
    rec = model.recorder
    if not rec.wants(li, "latents") or not latents.shape[0]:
        return
    twin = state_dtype == torch.float32
    k_bf16 = index_k = index_k_bf16 = None
    if twin:
        k_bf16 = model.compress(layer, c.bfloat16().float(), g.bfloat16().float(), index).float()
    if ik is not None:
        index_k = ik.float().mean(1)
        if twin:
            index_k_bf16 = ik.bfloat16().float().mean(1)
    rec.add_latents(li, latents, k_bf16, index_k, index_k_bf16)
