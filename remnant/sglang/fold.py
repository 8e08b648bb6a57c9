"""Kernel mode's column fold inside SGLang: the kept-first order (KeptColumns.order) folded
into each CSA layer's q projection (wq_b) and output projection (wo_a) as SGLang loads
the checkpoint, as remnant.engine.model.FoldedWeights does for the embedded engine.

Why: Remnant's SM90 decode kernel takes only the folded call, q and out in kept-first
column order (kept NoPE columns in map order, the dropped ones, then RoPE 448..511, which
stay in place). Folded weights give that q for free: SGLang's per-head RMSNorm of q does
not depend on column order and its RoPE acts on columns 448..511 only, so
rope(norm(x @ wq_b_folded)) is rope(norm(x @ wq_b))[..., order] up to summation order;
and o_kept_first @ wo_a_folded is o @ wo_a.

SGLang 0.5.18's DeepSeek-V4 checkpoint holds both projections in FP8 e4m3 with 128 x 128
block scales (`.scale`, or `.weight_scale_inv` once renamed). A row (wq_b) or column (wo_a)
moved to another 128-block must take that block's scale: the folded block's scale is the
largest of its source blocks' scales and each code is re-expressed at it. Where scales
are powers of two (UE8M0) that only shifts exponents, exact unless a code falls below
e4m3's normal range (it then rounds to the subnormal grid, an error below half a
subnormal step at the new scale); other scales round codes to FP8 again (fold_block_fp8's
reference measures either).

Torch only: this module imports no sglang.
"""

from __future__ import annotations

import re
from typing import Iterable, Iterator, Mapping

import torch

from remnant.kv.formats import HEAD_DIM

#: Checkpoint tensors the fold rewrites: DeepSeek's own names (layers.{i}.attn.wq_b.weight,
#: .scale) or SGLang's HF names (model.layers.{i}.self_attn.wq_b.weight, .weight_scale_inv),
#: as DeepseekV4ForCausalLM.remap_weight_name_to_dpsk_hf_format maps them. The MTP layer's
#: tensors (mtp.*) are not matched: the draft model is not folded.
_NAME = re.compile(r"^(?:model\.)?layers\.(\d+)\.(?:self_)?attn\.(wq_b|wo_a)\.(weight|scale|weight_scale_inv)$")
BLOCK = 128  # FP8 block size of DeepSeek-V4's checkpoint (weight_block_size [128, 128])


def head_permutation(order: torch.Tensor, heads: int) -> torch.Tensor:
    """int64 [heads * 512]: `order` applied within each head's 512 columns."""
    order = order.long().cpu()
    if order.shape != (HEAD_DIM,) or not torch.equal(order.sort().values, torch.arange(HEAD_DIM)):
        raise ValueError(f"order must be a permutation of range({HEAD_DIM}), got shape {tuple(order.shape)}")
    return (torch.arange(heads)[:, None] * HEAD_DIM + order[None, :]).reshape(-1)


def _per_dim(weight: torch.Tensor, dim: int, name: str) -> int:
    if weight.ndim != 2 or weight.shape[dim] % HEAD_DIM:
        raise ValueError(f"{name} must be 2-D with a multiple of {HEAD_DIM} along dim {dim} (heads x 512), "
                         f"got {tuple(weight.shape)}")
    return weight.shape[dim] // HEAD_DIM


def fold_plain(weight: torch.Tensor, order: torch.Tensor, dim: int, name: str = "weight") -> torch.Tensor:
    """An unquantized (bf16/float) weight with `order` applied per head along `dim`:
    dim 0 for wq_b ([H * 512, q_lora_rank], output rows), dim 1 for wo_a ([G * R,
    H / G * 512], input columns)."""
    perm = head_permutation(order, _per_dim(weight, dim, name)).to(weight.device)
    return weight.index_select(dim, perm).contiguous()


def _block_of(perm: torch.Tensor) -> torch.Tensor:
    return perm // BLOCK


def fold_block_fp8(weight: torch.Tensor, scale: torch.Tensor, order: torch.Tensor, dim: int,
                   name: str = "weight") -> tuple[torch.Tensor, torch.Tensor]:
    """An FP8 e4m3 weight with 128 x 128 block scales (weight = code * scale of its block),
    `order` applied per head along `dim` (as fold_plain). Returns (codes, float32 scales) of
    the folded weight in the same format: each folded block takes the largest scale of the
    source blocks its rows (dim 0) or columns (dim 1) come from, and every code is
    re-expressed at it (exact for power-of-two scales but for codes that fall below e4m3's
    normal range; see the module doc)."""
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"{name} must be float8_e4m3fn codes, got {weight.dtype}")
    rows, cols = weight.shape
    if scale.shape != (-(-rows // BLOCK), -(-cols // BLOCK)):
        raise ValueError(f"{name} scale must be [{-(-rows // BLOCK)}, {-(-cols // BLOCK)}] (128 x 128 blocks of "
                         f"{tuple(weight.shape)}), got {tuple(scale.shape)}")
    if weight.shape[dim] % BLOCK:
        raise ValueError(f"{name} has {weight.shape[dim]} along dim {dim}, not a multiple of {BLOCK}")
    perm = head_permutation(order, _per_dim(weight, dim, name)).to(weight.device)
    scale = scale.float()
    src_block = _block_of(perm)  # [n]: the source block of each folded row / column
    n_blocks = weight.shape[dim] // BLOCK
    # Per folded block, the largest scale among its sources, for each block of the other dim.
    moved = scale.index_select(dim, src_block)  # per folded row/column, its source block's scales
    shape = (n_blocks, BLOCK, scale.shape[1]) if dim == 0 else (scale.shape[0], n_blocks, BLOCK)
    new_scale = moved.reshape(shape).amax(dim=dim + 1)
    # Each code times (its old scale / its new scale), at full precision, then to FP8.
    codes = weight.index_select(dim, perm).float()
    old = moved.repeat_interleave(BLOCK, dim=1 - dim)[:rows, :cols]
    new = new_scale.repeat_interleave(BLOCK, dim=0).repeat_interleave(BLOCK, dim=1)[:rows, :cols]
    folded = (codes * (old / new)).to(torch.float8_e4m3fn)
    return folded.contiguous(), new_scale


def dequantize_block_fp8(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 values of an FP8 weight with 128 x 128 block scales (the plain reference)."""
    rows, cols = weight.shape
    full = scale.float().repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:rows, :cols]
    return weight.float() * full


class CheckpointFold:
    """Folds the CSA layers' wq_b and wo_a in a checkpoint's (name, tensor) stream.

    orders: model layer index -> int [512] kept-first order (KeptColumns.order) for every
    CSA layer of the model. An FP8 weight is held until its scale arrives (or the scale
    until its weight), as SGLang's own _dequant_fp8_wo_a_streaming pairs them; `__call__`
    raises, naming the tensor, where one of a pair never comes.
    """

    def __init__(self, orders: Mapping[int, torch.Tensor]):
        self.orders = {int(i): o for i, o in orders.items()}
        self.folded: list[str] = []

    def layers(self) -> list[int]:
        """Model layers whose wq_b and wo_a weights have both been folded so far."""
        done: dict[int, set[str]] = {}
        for name in self.folded:
            m = _NAME.match(name)
            if m.group(3) == "weight":
                done.setdefault(int(m.group(1)), set()).add(m.group(2))
        return sorted(i for i, projs in done.items() if projs == {"wq_b", "wo_a"})

    def __call__(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        pending: dict[tuple[int, str], dict[str, tuple[str, torch.Tensor]]] = {}
        for name, tensor in weights:
            m = _NAME.match(name)
            if m is None or int(m.group(1)) not in self.orders:
                yield name, tensor
                continue
            layer, proj, kind = int(m.group(1)), m.group(2), m.group(3)
            dim = 0 if proj == "wq_b" else 1
            if kind == "weight" and tensor.dtype != torch.float8_e4m3fn:
                self.folded.append(name)
                yield name, fold_plain(tensor, self.orders[layer], dim, name)
                continue
            bucket = pending.setdefault((layer, proj), {})
            bucket["weight" if kind == "weight" else "scale"] = (name, tensor)
            if len(bucket) < 2:
                continue
            del pending[(layer, proj)]
            (w_name, w), (s_name, s) = bucket["weight"], bucket["scale"]
            codes, scales = fold_block_fp8(w, s, self.orders[layer], dim, w_name)
            self.folded += [w_name, s_name]
            yield w_name, codes
            yield s_name, scales.to(s.dtype)
        for (layer, proj), bucket in pending.items():
            missing = "scale" if "weight" in bucket else "weight"
            have = next(iter(bucket.values()))[0]
            raise ValueError(f"remnant: layer {layer}'s {proj}: the checkpoint gave {have} but no FP8 {missing}; "
                             f"kernel mode folds an FP8 {proj} with its block scales together")


# ---------------------------------------------------------------------------------------
# Plain references of what SGLang computes around the fold (tests and CPU checks)


def rms_norm_rope_reference(x: torch.Tensor, weight: torch.Tensor | None, eps: float, freqs_cis: torch.Tensor,
                            positions: torch.Tensor) -> torch.Tensor:
    """SGLang's fused (q or kv) norm + RoPE in float32: x [..., 512] RMS-normalized over the
    last dim (times `weight` where given), then the last 64 columns rotated as 32
    interleaved pairs by freqs_cis [max_pos, 32] (complex) at `positions` [T] (x's first
    dim). Returns float32."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    rope = freqs_cis[positions.long()]
    rope = rope.reshape(rope.shape[0], *([1] * (y.ndim - 2)), rope.shape[-1])
    tail = torch.view_as_complex(y[..., -2 * freqs_cis.shape[-1]:].reshape(*y.shape[:-1], -1, 2).contiguous())
    y[..., -2 * freqs_cis.shape[-1]:] = torch.view_as_real(tail * rope).reshape(*y.shape[:-1], -1)
    return y


__all__ = [
    "BLOCK",
    "CheckpointFold",
    "dequantize_block_fp8",
    "fold_block_fp8",
    "fold_plain",
    "head_permutation",
    "rms_norm_rope_reference",
]
