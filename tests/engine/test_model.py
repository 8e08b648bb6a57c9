"""The embedded model: one math for prefill, chunked prefill, decode and batches; the
window, CSA and HCA paths see exactly the tokens DeepSeek-V4's masks let them see."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from remnant.config import ModelConfig
from remnant.engine.model import Model, ModelArgs
from remnant.engine.pools import new_sequence, scratch_pools


def _model(**overrides) -> Model:
    cfg = dataclasses.asdict(ModelConfig())
    cfg.update(overrides)
    return Model(ModelArgs.from_hf_config(cfg))


class Runner:
    """A model with scratch pools: forward(sequences, chunks) as the engine calls it."""

    def __init__(self, m: Model, tokens: int = 1024, sequences: int = 4):
        self.m, self.pools = m, scratch_pools(m, tokens, sequences)
        self.tokens = tokens

    def seq(self):
        return new_sequence(self.pools, self.tokens)

    def forward(self, seqs, chunks):
        return self.m.forward(seqs, chunks, self.pools)


def _ids(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture
def model() -> Runner:
    return Runner(_model())


def test_chunked_prefill_and_decode_match_whole_prefill(model):
    ids = _ids(301)
    whole = model.forward([model.seq()], [ids])
    s = model.seq()
    for i in range(0, 300, 37):  # odd chunk sizes straddle record blocks
        model.forward([s], [ids[i : min(i + 37, 300)]])
    last = model.forward([s], [ids[300:]])
    torch.testing.assert_close(last, whole, rtol=1e-3, atol=1e-3)


def test_batch_equals_separate(model):
    a, b = _ids(130, 1), _ids(517, 2)
    sa, sb = model.seq(), model.seq()
    batched = model.forward([sa, sb], [a, b])
    alone = torch.cat([model.forward([model.seq()], [a]), model.forward([model.seq()], [b])])
    torch.testing.assert_close(batched, alone, rtol=1e-3, atol=1e-3)
    assert (sa.length, sb.length) == (130, 517)


def test_records_land_in_pages(model):
    from remnant.kv import dequantize

    s = model.seq()
    model.forward([s], [_ids(517)])
    pools = model.pools
    pages = s.page_tensor()
    assert pools.c4[1].read(pages, torch.arange(129)).shape == (129, 584)
    assert pools.c128[2].read(pages, torch.arange(4)).shape == (4, 584)
    # The open blocks sit in the request slot's state rows: 517 % 4 = 1 and 517 % 128 = 5.
    assert pools.c4_state[1][pools.state_rows(4, s.slot, 1), 0, :512].abs().sum() > 0
    # Records decode to finite latents (the FP8 bytes were written where they are read).
    assert torch.isfinite(dequantize(pools.c4[3].read(pages, torch.arange(129)))).all()


def _last_logits(m: Model, ids: list[int]) -> torch.Tensor:
    r = Runner(m, tokens=max(len(ids), 256), sequences=1)
    return r.forward([r.seq()], [ids])[0]


@pytest.mark.parametrize(
    ("ratios", "reaches"),
    [([0], False), ([4], True), ([128], True)],
    ids=["window-only", "csa", "hca"],
)
def test_what_a_distant_token_can_reach(ratios, reaches):
    """One layer: token 0 reaches position 300 only through a compressed record."""
    m = _model(num_hidden_layers=1, compress_ratios=ratios, index_topk=512)
    ids = _ids(301)
    other = [(ids[0] + 1) % 256, *ids[1:]]
    moved = (_last_logits(m, ids) - _last_logits(m, other)).abs().max().item()
    assert (moved > 1e-4) == reaches, moved


def test_incomplete_block_is_invisible():
    """A C4 record joins attention only once its 4 tokens are all there."""
    m = _model(num_hidden_layers=1, compress_ratios=[4], window_size=2, index_topk=512)
    ids = _ids(11)
    # Position 10 sees the window 9..10 and complete records 0 (tokens 0-3) and 1 (4-7).
    # Block 2 (8-11) is incomplete, so token 8 (out of the window) must not reach it.
    base = _last_logits(m, ids)
    for pos, reaches in ((2, True), (5, True), (7, True), (8, False), (9, True)):
        changed = list(ids)
        changed[pos] = (changed[pos] + 7) % 256
        moved = (base - _last_logits(m, changed)).abs().max().item()
        assert (moved > 1e-5) == reaches, (pos, moved)


def test_weights_are_seeded():
    a, b, c = _model(seed=3), _model(seed=3), _model(seed=4)
    ids = _ids(20)
    torch.testing.assert_close(_last_logits(a, ids), _last_logits(b, ids), rtol=0, atol=0)
    assert not torch.equal(_last_logits(a, ids), _last_logits(c, ids))


def test_one_input_projection_is_each_of_its_parts():
    """Model.project's one product with w_in gives each projection a separate product would
    (up to summation order), and each layer's projection weights are views of w_in."""
    args = ModelArgs.from_hf_config(dataclasses.asdict(ModelConfig()))
    model = Model(args, decode_path="batched")
    x = torch.randn(3, args.hidden_size, generator=torch.Generator().manual_seed(1))
    for layer in model.layers:
        p = model.project(layer, x)
        for name, got in zip(("wq_a", "wkv", "wc", "wg", "wi_k", "wi_w"), (p.q_a, p.kv, p.c, p.g, p.ik, p.iw)):
            weight = getattr(layer, name, None)
            assert (got is None) == (weight is None), name
            if weight is not None:
                assert weight.untyped_storage().data_ptr() == layer.w_in.untyped_storage().data_ptr(), name
                torch.testing.assert_close(got, x @ weight.contiguous(), rtol=1e-5, atol=1e-5)


def test_scratch_pools_hold_the_window_blocks_asked_for():
    # window_blocks sizes the sliding-window pool to the blocks the sequences use (the decode
    # bench's batch), where swa_ratio 1 holds a block for every window of the pages' tokens:
    # at 128 x 32k tokens that was 169.5 GiB of window records and compressor state.
    m = _model()
    full = scratch_pools(m, 2048, sequences=4)
    lean = scratch_pools(m, 2048, sequences=4, window_blocks=4)
    assert full.swa_blocks.n >= 4 * 2048 // m.args.window_size
    assert 4 <= lean.swa_blocks.n <= 4 + 256 // m.args.window_size + 1
    assert lean.pages.n == full.pages.n and lean.slots.n == 4
    for _ in range(4):  # each sequence gets its pages, a window block and a slot
        new_sequence(lean, 2048)
    assert lean.swa_blocks.free == lean.swa_blocks.n - 4
