"""The batched prefill step: chunks of several prompt tokens for N sequences through every
layer at once, attending through the same sparse attention as a decode step.

A prefill token attends as a decode token does: to the window (its own and the previous
window - 1 positions) and to records (on CSA layers the indexer's top-k of the C4 records
visible to it, on HCA layers every visible C128 record). So each of the T new tokens is a
row of the decode step's attention (remnant.engine.decode_step: FlashMLA, the Triton or
SM90 packed kernels per mode, or the torch softmax), as vLLM runs sparse prefill through
its FP8 decode kernel. One thing differs: a chunk may be longer than the window, so its
tokens' window records cannot all sit in the sequence's ring at once. They go, with the
previous window - 1 records read from the ring, into a scratch ring (native pages in
SGLang's layout, in the ring's own record form), which the attention reads in the ring's
place; then the chunk's last `window` records go into the ring.

Everything whose size depends on the sequences (window spans, blocks completed, records
visible) is known on the host from their lengths and page tables: the plan (PrefillPlan)
is built there and copied once, so the step has no host synchronisation. The indexer
scores each sequence's tokens against that sequence's index keys (a matrix product per
sequence, in tiles of tokens so that 128k-token prompts fit); everything else runs over
all T tokens together.

The per-sequence reference (Model._extend with decode_path=reference) is the ground truth
this step is tested against (tests/engine/test_prefill_step.py).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, fields

import torch

from remnant.engine.capacity import C4_RING, C128_RING
from remnant.engine.capture_hooks import record_blocks, record_tokens
from remnant.engine.decode_step import attend_batched, attend_kernels
from remnant.engine.ops import SCRATCH_PER_PAGE
from remnant.kernels.dispatch import store
from remnant.kv import CSA_RATIO, HEAD_DIM
from remnant.kv.layout import PageLayout

#: Elements of the largest float32 intermediate a tile may make (the indexer's [tokens,
#: heads, records] relu products, the torch attention's [tokens, heads, keys] scores):
#: 2^26 x 4 bytes = 256 MiB, so that a 128k-token prompt's chunk fits beside the weights
#: and pools.
TILE_ELEMENTS = 1 << 26


@dataclass
class RatioPlan:
    """Where a chunk's compressor work goes for one compression ratio r (host-built, on the
    device). Blocks are listed sequence by sequence, in block order.

    gather: int64 [blocks, r] rows of cat(state[state_rows], new tokens) making each block
    completed by the chunk; block_index: int64 [blocks] each block's record index in its
    sequence; record_locs: int64 [blocks] where its record goes; tail_tokens, tail_rows:
    new tokens left in an open block and the state rows they go to; visible_locs: int64
    [N, n] every record of each sequence visible by the end of the chunk (-1 padding);
    counts: records per sequence (host ints)."""

    state_rows: torch.Tensor
    gather: torch.Tensor
    block_index: torch.Tensor
    record_locs: torch.Tensor
    tail_tokens: torch.Tensor
    tail_rows: torch.Tensor
    visible_locs: torch.Tensor
    counts: list[int]

    def to(self, device: torch.device) -> "RatioPlan":
        return RatioPlan(**{f.name: getattr(self, f.name) if f.name == "counts" else getattr(self, f.name).to(device)
                            for f in fields(self)})


@dataclass
class PrefillPlan:
    """What a prefill step reads besides the pools, built on the host from the sequences'
    lengths and pages, on the model's device.

    Tokens are flat, sequence by sequence (`starts`, `sizes` host ints). The scratch ring
    holds, per sequence, the records of positions first..length + size - 1 (first =
    max(0, length - (window - 1))): `prev_slots` are the ring slots read into scratch rows
    `prev_rows`, the new tokens' records go to `new_rows`; `window_locs` [T, window] are
    scratch rows of each token's window (-1 before position 0); `tail_tokens` and
    `tail_slots` put each chunk's last `window` records into its ring."""

    ids: torch.Tensor  # int64 [T]
    pos: torch.Tensor  # int64 [T]
    row: torch.Tensor  # int64 [T] sequence of each token
    starts: list[int]
    sizes: list[int]
    lengths: list[int]
    window: int
    bases: list[int]  # each sequence's first scratch row...
    firsts: list[int]  # ...holds the record of this position
    scratch_records: int
    prev_slots: torch.Tensor
    prev_rows: torch.Tensor
    new_rows: torch.Tensor
    window_locs: torch.Tensor
    tail_tokens: torch.Tensor
    tail_slots: torch.Tensor
    ratios: dict[int, RatioPlan]

    @classmethod
    def of(cls, seqs: list, chunks: list[list[int]], pools, window: int, ratios: set[int],
           device: torch.device) -> "PrefillPlan":
        sizes = [len(c) for c in chunks]
        lengths = [s.length for s in seqs]
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        pos = torch.cat([torch.arange(L, L + n) for L, n in zip(lengths, sizes)])
        row = torch.cat([torch.full((n,), i) for i, n in enumerate(sizes)])
        prev_slots, prev_rows, new_rows, window_locs, tail_tokens, tail_slots = [], [], [], [], [], []
        bases, firsts = [], []
        base = 0
        for s, L, n, start in zip(seqs, lengths, sizes, starts):
            first = max(0, L - (window - 1))
            bases.append(base)
            firsts.append(first)
            prev = torch.arange(first, L)
            prev_slots.append(pools.swa_slots(s.swa_block, prev))
            prev_rows.append(base + prev - first)
            new_rows.append(base + torch.arange(L, L + n) - first)
            p = torch.arange(L, L + n)[:, None] - (window - 1) + torch.arange(window)  # [n, window]
            window_locs.append(torch.where(p >= 0, base + p - first, -1))
            tail = torch.arange(max(L, L + n - window), L + n)
            tail_tokens.append(start + tail - L)
            tail_slots.append(pools.swa_slots(s.swa_block, tail))
            base += L + n - first
        per_ratio = {r: _ratio_plan(seqs, lengths, sizes, starts, pools, r) for r in ratios}

        def put(tensors: list[torch.Tensor]) -> torch.Tensor:
            return torch.cat(tensors).long().to(device)

        return cls(torch.tensor([t for c in chunks for t in c], dtype=torch.long, device=device),
                   pos.to(device), row.to(device), starts, sizes, lengths, window, bases, firsts, base,
                   put(prev_slots), put(prev_rows), put(new_rows), put(window_locs), put(tail_tokens),
                   put(tail_slots), {r: plan.to(device) for r, plan in per_ratio.items()})

    def span(self, t: int, e: int) -> tuple[int, int]:
        """Scratch rows [lo, hi) holding the windows of tokens t..e-1 (from the host's
        lengths: rows follow tokens, and a token's window ends at its own row)."""
        def rows(token: int) -> tuple[int, int]:
            i = bisect.bisect_right(self.starts, token) - 1
            p = self.lengths[i] + token - self.starts[i]
            return (self.bases[i] + max(0, p - self.window + 1) - self.firsts[i],
                    self.bases[i] + p - self.firsts[i])

        return rows(t)[0], rows(e - 1)[1] + 1


def _ratio_plan(seqs: list, lengths: list[int], sizes: list[int], starts: list[int], pools, r: int) -> RatioPlan:
    """The compressor's and the records' plan for ratio r (RatioPlan), on the host."""
    ring = C4_RING if r == CSA_RATIO else C128_RING
    per = pools.page_size // r  # records per page, as decode_step.RatioSlots counts them
    state_rows, gather, block_index, record_locs, tail_tokens, tail_rows, visible, counts = [], [], [], [], [], [], [], []
    n_state = sum(L % r for L in lengths)  # rows of the gather table before the new tokens
    state_at = 0
    for s, L, n, start in zip(seqs, lengths, sizes, starts):
        open_ = L % r
        state_rows.append(s.slot * ring + torch.arange(open_))
        full = (open_ + n) // r
        first = L // r
        # Position p of a block comes from the state (p < L: the open block's earlier tokens,
        # whose row is p % r) or from new token start + p - L.
        p = (first + torch.arange(full))[:, None] * r + torch.arange(r)  # [full, r]
        gather.append(torch.where(p < L, state_at + p % r, n_state + start + p - L))
        state_at += open_
        count = (L + n) // r  # the chunk's blocks are the last of these
        j = torch.arange(count)
        pages = torch.tensor(s.pages, dtype=torch.long)
        visible.append(pages[j // per] * per + j % per)
        counts.append(count)
        block_index.append(j[first:])
        record_locs.append(visible[-1][first:])
        tail = torch.arange(max(L, (first + full) * r), L + n)
        tail_tokens.append(start + tail - L)
        tail_rows.append(s.slot * ring + tail % r)
    width = max(counts, default=0)
    visible_locs = torch.full((len(seqs), width), -1, dtype=torch.long)
    for i, locs in enumerate(visible):
        visible_locs[i, : locs.numel()] = locs

    def cat(parts: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(parts).long()

    return RatioPlan(cat(state_rows), cat(gather).view(-1, r), cat(block_index), cat(record_locs), cat(tail_tokens),
                     cat(tail_rows), visible_locs, counts)


def prefill_step(model, pools, plan: PrefillPlan, attention: str) -> torch.Tensor:
    """The chunks of `plan` through every layer of `model` (remnant.engine.model.Model),
    writing their KV into `pools`; attention "kernels" or "torch" (as decode_step).
    Returns float32 [N, vocab] logits at each chunk's last token. Sequences' lengths are
    the caller's to advance."""
    h = model.embed[plan.ids]
    if model.prefill_reads is not None:
        model.prefill_reads.steps += 1
    # One scratch ring per window record size (packed windows are smaller), reused by
    # every layer of that size.
    scratches = {}
    pages = max(-(-plan.scratch_records // SCRATCH_PER_PAGE), 1)
    for li, layer in enumerate(model.layers):
        retention = model.layer_format(li).ring_retention
        if retention not in scratches:
            layout = PageLayout.sglang(SCRATCH_PER_PAGE, retention)
            scratches[retention] = (torch.zeros(pages, layout.page_stride, dtype=torch.uint8, device=h.device), layout)
        h = _layer(model, li, layer, pools, plan, h, scratches[retention], attention)
    last = torch.tensor([a + n - 1 for a, n in zip(plan.starts, plan.sizes)], device=h.device)
    return model.logits(h[last]).float()


def _layer(model, li: int, layer, pools, plan: PrefillPlan, h: torch.Tensor, scratch: tuple, attention: str):
    """One layer of the step: h [T, hidden] -> h [T, hidden]."""
    x = model.ops.rms_norm(h, layer.attn_norm, model.args.rms_norm_eps)
    folded = model.folded_weights.get(li)
    p = model.project(layer, x)
    q, q_lora = model.queries(layer, p, plan.pos, folded)
    # The window: the previous records from the ring and the chunk's own, in the ring's
    # record form, into the scratch ring; then the chunk's last `window` into the ring.
    kv = model.window_latents(layer, p, plan.pos).float()
    if model.recorder is not None:  # a capture: copies only (remnant.engine.capture_hooks)
        record_tokens(model, li, layer, q, p.iw, q_lora, kv, decode=False)
    records = model.layer_format(li).ring_records(kv)
    pages, layout = scratch
    layout.write(pages, plan.prev_rows, pools.swa.read(li, plan.prev_slots))
    layout.write(pages, plan.new_rows, records)
    pools.swa.write(li, plan.tail_slots, records[plan.tail_tokens])
    chosen, rp = None, None
    if layer.ratio:
        rp = plan.ratios[layer.ratio]
        _compress(model, li, layer, pools, rp, p)
        if layer.ratio == CSA_RATIO:
            chosen = _select(model, li, pools, plan, rp, p.iw, q_lora, layer, kernels=attention == "kernels")
        else:
            chosen = _visible(plan, rp, layer.ratio)
    if model.prefill_reads is not None:  # the engine bench's count (remnant.engine.prefill_reads)
        model.prefill_reads.count("window", plan.window_locs)
        if chosen is not None:
            model.prefill_reads.count("c4" if layer.ratio == CSA_RATIO else "c128", _record_locs(plan, rp, chosen))
    if attention == "kernels":
        locs = None if chosen is None else _record_locs(plan, rp, chosen)
        o = attend_kernels(model, li, layer, pools, q, plan.window_locs, locs, ring=scratch, distinct=True)
    else:
        o = _attend_torch(model, li, layer, pools, plan, q, chosen, rp, scratch)
    return model.ffn(layer, model.output(layer, h, o.to(h.dtype), folded))


def _record_locs(plan: PrefillPlan, rp: RatioPlan, chosen: torch.Tensor) -> torch.Tensor:
    """Pool locations int64 [T, K] of the records each token chose (-1: none)."""
    return torch.where(chosen >= 0, rp.visible_locs[plan.row[:, None], chosen.clamp_min(0)], -1)


def _compress(model, li: int, layer, pools, rp: RatioPlan, p) -> None:
    """Blocks the chunk completes become records (and, on CSA layers, index keys), as the
    reference's _compress_new_blocks makes them; tokens left in open blocks go to the
    fp32 state rows."""
    r = layer.ratio
    csa = r == CSA_RATIO
    state = pools.c4_state[li] if csa else pools.c128_state[li]
    # The open blocks' rows and the chunk's own tokens, both as the state holds them (its
    # dtype: float32, or bfloat16 with compressor_state_dtype), computed on in float32.
    c, g = p.c.to(state.dtype), p.g.to(state.dtype)
    if rp.gather.shape[0]:
        pc = torch.cat([state[rp.state_rows, 0, :HEAD_DIM], c])[rp.gather].float()
        pg = torch.cat([state[rp.state_rows, 1, :HEAD_DIM], g])[rp.gather].float()
        latents = model.compress(layer, pc, pg, rp.block_index).float()
        target = pools.c4[li] if csa else pools.c128[li]
        store(latents, target.buf, target.layout, rp.record_locs, model.layer_format(li).record_columns)
    ik = None
    if csa:
        d = model.args.index_head_dim
        index_state = pools.c4_index_state[li]
        ik = p.ik.to(index_state.dtype)
        if rp.gather.shape[0]:
            ik_rows = torch.cat([index_state[rp.state_rows, 0, :d], ik])[rp.gather].float()
            keys = ik_rows.mean(1)
            indexer = pools.indexer[li]
            indexer.layout.write(indexer.buf, rp.record_locs, model.quantize_index_keys(keys))
        index_state[rp.tail_rows, 0, :d] = ik[rp.tail_tokens]
    if model.recorder is not None and rp.gather.shape[0]:  # a capture: copies only
        record_blocks(model, li, layer, pc, pg, rp.block_index, latents, state.dtype, ik_rows if csa else None)
    state[rp.tail_rows, 0, :HEAD_DIM] = c[rp.tail_tokens]
    state[rp.tail_rows, 1, :HEAD_DIM] = g[rp.tail_tokens]


def _visible(plan: PrefillPlan, rp: RatioPlan, ratio: int) -> torch.Tensor:
    """Record indices int64 [T, n] each token reads on an HCA layer: every record of its
    sequence whose block is complete (j < (pos + 1) // ratio <= the sequence's count), -1
    past them."""
    j = torch.arange(rp.visible_locs.shape[1], device=plan.pos.device)
    return torch.where(j[None, :] < ((plan.pos + 1) // ratio)[:, None], j, -1)


def _select(model, li: int, pools, plan: PrefillPlan, rp: RatioPlan, iw: torch.Tensor, q_lora: torch.Tensor,
            layer, kernels: bool = False) -> torch.Tensor:
    """Record indices int64 [T, K] (in each token's sequence) of the C4 records it reads
    (-1: none): the indexer's top-k over the records visible to it, scored against its
    own sequence's index keys. `kernels`: scored by remnant.kernels.indexer (FP8 keys read
    in place, float32 accumulation), else dequantized once per sequence and scored in torch
    (float32, as the per-sequence reference)."""
    k = min(model.args.index_topk, rp.visible_locs.shape[1])
    out = torch.full((iw.shape[0], k), -1, dtype=torch.long, device=iw.device)
    indexer = pools.indexer[li]
    heads = model.args.index_n_heads
    fp8_q = model.index_scores_config is not None and model.index_scores_config.fp8_q
    for i, (a, n, count) in enumerate(zip(plan.starts, plan.sizes, rp.counts)):
        if not count:
            continue
        locs = rp.visible_locs[i, :count]
        if kernels:
            from remnant.kernels.indexer import index_scores_shared

            qi, wi = model.index_queries(layer, iw[a: a + n], q_lora[a: a + n])
            # Scores and the top-k's int64 keys are [tile, count]: 3 x 4 bytes an element.
            tile = max(1, TILE_ELEMENTS // count)
        else:
            keys = model.index_key_format.dequantize(indexer.layout.read(indexer.buf, locs))
            tile = max(1, TILE_ELEMENTS // (heads * count))
        for t in range(a, a + n, tile):
            e = min(t + tile, a + n)
            visible_count = torch.clamp((plan.pos[t:e] + 1) // CSA_RATIO, max=count)
            if kernels:
                scores = index_scores_shared(qi[t - a: e - a].contiguous(), wi[t - a: e - a], indexer.buf,
                                             indexer.layout, locs, visible_count, key_format=model.index_key_format,
                                             fp8_q=fp8_q)
            else:
                scores = model.index_scores(layer, iw[t:e], q_lora[t:e], keys)
                visible = torch.arange(count, device=iw.device)[None, :] < visible_count[:, None]
                scores = scores.masked_fill(~visible, float("-inf"))
            values, top = model.ops.index_top_k(scores, min(k, count))
            out[t:e, : top.shape[1]] = torch.where(values > float("-inf"), top, -1)
    return out


def _attend_torch(model, li: int, layer, pools, plan: PrefillPlan, q: torch.Tensor, chosen: torch.Tensor | None,
                  rp: RatioPlan | None, scratch: tuple) -> torch.Tensor:
    """decode_step.attend_batched over each token's window and chosen records, in tiles of
    one sequence's tokens; float32 [T, H, 512] in natural column order. Unlike a decode
    step's, a prefill step's tokens read the same keys many times over, so the keys are
    dequantized once, into tables, and a tile attends to them as shared keys, masked (a
    matrix product, no per-token gather): its window span of the scratch ring (a token's
    window is the rows up to its own, and rows follow tokens) and its sequence's records,
    each visible to the tokens that chose it."""
    fmt = model.layer_format(li)
    pages, layout = scratch
    window, window_cols = fmt.ring_keys(layout.read(pages, torch.arange(plan.scratch_records, device=q.device)))
    records = cols = None
    width = rp.visible_locs.shape[1] if chosen is not None else 0
    if chosen is not None:
        target = pools.c4[li] if layer.ratio == CSA_RATIO else pools.c128[li]
        stored = target.layout.read(target.buf, rp.visible_locs.clamp_min(0).flatten())
        records, cols = model.layer_format(li).read(stored)
    own = plan.window_locs[:, -1]  # each token's own record: the last row of its window
    first = own - (plan.window_locs >= 0).sum(1) + 1
    heads = q.shape[1]
    parts = []
    for i, (a, size) in enumerate(zip(plan.starts, plan.sizes)):
        count = rp.counts[i] if chosen is not None else 0
        # A tile's scores are [tokens, heads, its span (< tokens + window) + records].
        tile = max(1, TILE_ELEMENTS // (heads * (2 * plan.window + count)))
        tile = min(tile, max(1, int((TILE_ELEMENTS // heads) ** 0.5)))
        for t in range(a, a + size, tile):
            e = min(t + tile, a + size)
            # Host-known bounds of the span: the plan's rows, from its lengths (no sync).
            lo, hi = plan.span(t, e)
            span = torch.arange(lo, hi, device=q.device)
            visible = (span[None, :] >= first[t:e, None]) & (span[None, :] <= own[t:e, None])
            key_sets = [(window[lo:hi], window_cols, visible)]
            if count:
                picked = chosen[t:e]
                mask = torch.zeros(e - t, count + 1, dtype=torch.bool, device=q.device)
                mask.scatter_(1, torch.where(picked >= 0, picked, count), True)  # -1 -> a spare column
                base = i * width
                key_sets.append((records[base: base + count], cols, mask[:, :count]))
            parts.append(attend_batched(q[t:e], layer.sink, key_sets, model.scale))
    return torch.cat(parts)
