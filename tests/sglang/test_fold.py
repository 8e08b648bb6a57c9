"""Kernel mode's fold inside SGLang: folded wq_b / wo_a give the same q (permuted) and the
same layer output; the folded decode call equals the natural one permuted; the window
hooks against the real sglang 0.5.18 (needs_sglang, in a probe process)."""

import pytest
import torch

from remnant.kernels.decode.plan import choose
from remnant.kv.attention import SOFTMAX_SCALE
from remnant.kv.layout import KeptColumns
from remnant.kernels.dispatch import store
from remnant.sglang.buffers import decode_c4_packed, make_packed_buffers, native_layout, store_window_kept_first
from remnant.sglang.fold import (BLOCK, CheckpointFold, dequantize_block_fp8, fold_block_fp8, fold_plain,
                                 head_permutation, rms_norm_rope_reference)
from tests.sglang.env import needs_sglang, probe

H, G, R_O, Q_LORA = 8, 2, 128, 256  # heads, wo groups, o_lora_rank, q_lora_rank (small V4 shapes)


def keep_of(seed: int = 0) -> torch.Tensor:
    return torch.randperm(448, generator=torch.Generator().manual_seed(seed))[:192].sort().values


def freqs(max_pos: int = 64) -> torch.Tensor:
    """V4's RoPE table shape: complex [max_pos, 32]."""
    inv = 1.0 / (10000 ** (torch.arange(0, 64, 2).float() / 64))
    return torch.polar(torch.ones(max_pos, 32), torch.outer(torch.arange(max_pos).float(), inv))


def test_head_permutation_is_order_per_head():
    order = KeptColumns.of(keep_of(), torch.device("cpu")).order
    perm = head_permutation(order, 3)
    assert torch.equal(perm[512:1024] - 512, order.long()) and torch.equal(perm.sort().values, torch.arange(1536))
    assert torch.equal(order[448:].long(), torch.arange(448, 512))  # RoPE columns stay in place
    with pytest.raises(ValueError, match="order must be a permutation of range"):
        head_permutation(torch.zeros(512, dtype=torch.long), 2)


def test_folded_weights_give_the_same_q_and_layer_output():
    """MQALayer's math (SGLang's non-FP8 wo_a branch): q = rope(norm(q_lora @ wq_b^T)) per
    head; o -> inverse RoPE on 448..511 -> einsum("tgd,grd->tgr", o, wo_a) -> wo_b. SGLang's
    fused_q_norm_rope and fused_rope_inplace are CUDA JIT kernels: the float reference
    (rms_norm_rope_reference) stands in for them on the CPU."""
    g = torch.Generator().manual_seed(0)
    cols = KeptColumns.of(keep_of(1), torch.device("cpu"))
    order = cols.order.long()
    wq_b = (torch.randn(H * 512, Q_LORA, generator=g) / 16).to(torch.bfloat16)
    wo_a = (torch.randn(G * R_O, H // G * 512, generator=g) / 40).to(torch.bfloat16)
    wo_b = (torch.randn(1024, G * R_O, generator=g) / 16).to(torch.bfloat16)
    q_lora = torch.randn(5, Q_LORA, generator=g).to(torch.bfloat16)
    pos = torch.tensor([0, 3, 9, 17, 40])
    table = freqs()

    def q_of(w):
        return rms_norm_rope_reference((q_lora @ w.T).view(5, H, 512), None, 1e-6, table, pos).to(torch.bfloat16)

    def out_of(o, w):
        o = o.float().clone()
        o[..., 448:] = rms_norm_rope_reference(o, None, 0.0, table.conj(), pos)[..., 448:] * \
            o.pow(2).mean(-1, keepdim=True).sqrt()  # inverse RoPE only (undo the norm)
        o = torch.einsum("tgd,grd->tgr", o.to(torch.bfloat16).view(5, G, -1), w.view(G, R_O, -1))
        return o.flatten(1) @ wo_b.T

    q_nat = q_of(wq_b)
    q_fold = q_of(fold_plain(wq_b, order, 0))
    torch.testing.assert_close(q_fold.float(), q_nat[..., order].float(), rtol=1.6e-2, atol=1e-2)
    o = torch.randn(5, H, 512, generator=g).to(torch.bfloat16)
    out_nat = out_of(o, wo_a)
    out_fold = out_of(o[..., order], fold_plain(wo_a, order, 1))
    torch.testing.assert_close(out_fold.float(), out_nat.float(), rtol=1.6e-2, atol=2e-2 * out_nat.abs().max().item())


def _fp8_weight(rows: int, cols: int, seed: int, pow2: bool = True):
    g = torch.Generator().manual_seed(seed)
    codes = (torch.randn(rows, cols, generator=g) * 60).clamp(-448, 448).to(torch.float8_e4m3fn)
    exps = torch.randint(-10, -7, (rows // BLOCK, cols // BLOCK), generator=g).float()
    scale = 2.0 ** exps if pow2 else torch.rand(rows // BLOCK, cols // BLOCK, generator=g) * 1e-3 + 1e-4
    return codes, scale


@pytest.mark.parametrize("dim", [0, 1])
def test_fp8_fold_keeps_values_with_power_of_two_scales(dim):
    order = KeptColumns.of(keep_of(2), torch.device("cpu")).order.long()
    codes, scale = _fp8_weight(4 * 512 if dim == 0 else 256, 256 if dim == 0 else 4 * 512, seed=dim)
    folded, new_scale = fold_block_fp8(codes, scale, order, dim)
    assert folded.dtype == torch.float8_e4m3fn and folded.shape == codes.shape
    assert new_scale.shape == scale.shape and torch.equal(torch.log2(new_scale), torch.log2(new_scale).round())
    perm = head_permutation(order, 4)
    want = dequantize_block_fp8(codes, scale).index_select(dim, perm)
    got = dequantize_block_fp8(folded, new_scale)
    # Exact but for codes pushed below e4m3's normal range: half a subnormal step (2^-10) there.
    step = new_scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1) * 2.0 ** -10
    assert bool(((got - want).abs() <= step).all())
    assert (got == want).float().mean() > 0.99


def test_fp8_fold_with_other_scales_is_within_fp8_rounding():
    order = KeptColumns.of(keep_of(3), torch.device("cpu")).order.long()
    codes, scale = _fp8_weight(2 * 512, 256, seed=5, pow2=False)
    folded, new_scale = fold_block_fp8(codes, scale, order, 0)
    want = dequantize_block_fp8(codes, scale).index_select(0, head_permutation(order, 2))
    got = dequantize_block_fp8(folded, new_scale)
    torch.testing.assert_close(got, want, rtol=2 ** -3, atol=new_scale.max().item() * 2 ** -9)


def test_checkpoint_fold_streams_csa_layers_only():
    orders = {2: KeptColumns.of(keep_of(4), torch.device("cpu")).order}
    order = orders[2].long()
    wq = torch.randn(2 * 512, 128).to(torch.bfloat16)
    codes, scale = _fp8_weight(256, 2 * 512, seed=7)
    other = torch.randn(2 * 512, 128).to(torch.bfloat16)
    fold = CheckpointFold(orders)
    out = dict(fold([
        ("layers.2.attn.wq_b.weight", wq),
        ("layers.2.attn.wo_a.scale", scale),  # the scale first: held until its weight
        ("layers.1.attn.wq_b.weight", other),  # not a CSA layer
        ("layers.2.attn.wo_a.weight", codes),
        ("mtp.0.attn.wq_b.weight", other),  # the draft layer is not folded
        ("layers.2.attn.wkv.weight", other),
    ]))
    assert torch.equal(out["layers.2.attn.wq_b.weight"], wq.index_select(0, head_permutation(order, 2)))
    assert out["layers.1.attn.wq_b.weight"] is other and out["mtp.0.attn.wq_b.weight"] is other
    assert out["layers.2.attn.wkv.weight"] is other
    want_codes, want_scale = fold_block_fp8(codes, scale, order, 1)
    assert torch.equal(out["layers.2.attn.wo_a.weight"].view(torch.uint8), want_codes.view(torch.uint8))
    assert torch.equal(out["layers.2.attn.wo_a.scale"], want_scale)
    assert fold.layers() == [2]
    hf = dict(CheckpointFold(orders)([("model.layers.2.self_attn.wq_b.weight", wq)]))  # SGLang's own names
    assert torch.equal(hf["model.layers.2.self_attn.wq_b.weight"], out["layers.2.attn.wq_b.weight"])
    with pytest.raises(ValueError, match="layer 2's wo_a: the checkpoint gave layers.2.attn.wo_a.weight but no FP8 scale"):
        list(CheckpointFold(orders)([("layers.2.attn.wo_a.weight", codes)]))


def _decode_inputs(seed: int = 0):
    keep = keep_of(seed)
    cols = KeptColumns.of(keep, torch.device("cpu"))
    (buf,), (layout,) = make_packed_buffers(400, 64, [256])
    g = torch.Generator().manual_seed(seed)
    store(torch.randn(100, 512, generator=g) * 3, buf, layout, torch.arange(1, 101), cols)
    swa = torch.zeros(2, native_layout(128).page_stride, dtype=torch.uint8)
    store_window_kept_first(torch.randn(130, 512, generator=g) * 3, swa.view(torch.float8_e4m3fn), 128,
                            torch.arange(130), cols)
    c4_idx = torch.randint(1, 101, (3, 64), generator=g, dtype=torch.int32)
    swa_idx = torch.arange(128, dtype=torch.int32).repeat(3, 1)
    q = torch.randn(3, 64, 512, generator=g).to(torch.bfloat16)
    return q, buf, layout, cols, c4_idx, torch.tensor([64, 10, 40]), swa, swa_idx, torch.tensor([128, 5, 77]), \
        torch.randn(64, generator=g)


def test_folded_decode_equals_natural_decode_permuted():
    q, buf, layout, cols, c4_idx, c4_len, swa, swa_idx, swa_len, sink = _decode_inputs()
    natural = decode_c4_packed(q, buf, layout, cols, c4_idx, c4_len, swa, 128, swa_idx, swa_len, sink, SOFTMAX_SCALE,
                               window_columns="kept_first")
    order = cols.order.long()
    folded = decode_c4_packed(q[..., order], buf, layout, cols, c4_idx, c4_len, swa, 128, swa_idx, swa_len, sink,
                              SOFTMAX_SCALE, columns="kept_first", window_columns="kept_first")
    assert folded.dtype == torch.bfloat16 and folded.shape == q.shape
    assert torch.equal(folded, natural[..., order])


def test_the_folded_call_is_the_sm90_kernels():
    """The plan sends the folded call (64 heads, bf16 q, kept-first q/out and window) to the
    SM90 kernel wherever it runs; here (no GPU) only the device stops it, while the
    natural call is refused by the kernel's own rule."""
    kw = dict(n_kept=192, q_dtype=torch.bfloat16, layouts=(make_packed_buffers(10, 64, [256])[1][0], native_layout(128)))
    folded = choose(torch.device("cpu"), 64, True, columns="kept_first", window_columns="kept_first", **kw)
    natural = choose(torch.device("cpu"), 64, True, window_columns="kept_first", **kw)
    assert folded.kernel == natural.kernel == "triton"
    assert "folded call only" not in folded.reason and folded.reason.startswith("the SM90 Gluon kernel cannot take it")
    assert "it runs the folded call only" in natural.reason


@needs_sglang
def test_kernel_mode_window_hooks_on_sglangs_pool():
    got = probe("window", REMNANT_MODE="kernel")
    assert got["csa_kept_first_max_err"] < 0.07, got  # FP8 e4m3 rounding of one latent (3 mantissa bits)
    assert got["native_window_layer_untouched"], got
    assert got["refused"] == ["set_swa_key_buffer_radix", "get_swa_raw_buffer"], got
    assert got["prefill_folded_equal"] and got["prefill_natural_equal"], got
