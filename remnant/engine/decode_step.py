"""The batched decode step: one new token for each of B sequences through every layer, as
tensors, with no per-sequence Python loop and no host synchronisation.

Per layer, as SGLang's DeepSeek-V4 decode runs it: queries, the window store (the new
token's record into its sequence's ring), the compressors (C4 and C128 state rows, a
record written when the token completes its block), the indexer (scores over every C4
index key the page table reaches, masked to the visible ones, and a top-k on the GPU),
then attention per mode, the output projection and the feed-forward block. Everything
whose size depends on the data is a mask over a size fixed by the batch's shapes (B rows,
P pages per sequence), so a step of given shapes is one CUDA graph (remnant.engine.graphs):

- a write that must not happen (a block not yet complete, a padding row) goes to the
  pools' padding page, block or state slot (KVPools.pad_*), as SGLang's padded decode
  batches write to its reserved slot 0;
- records nobody may read are -1 in the location lists the attention takes.

Attention runs through `remnant.kernels` (attention="kernels": FlashMLA or Remnant's
Triton native kernel over native records, reconstruct + FlashMLA in triton mode, the
packed decode in kernel mode, as `Model.native_decode` and `Model.packed_decode` name) or
through `attend_batched` below (attention="torch": the same softmax over gathered records,
the CPU default). The per-sequence reference path (Model.forward with
decode_path=reference) is the ground truth both are tested against.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from remnant.engine.capacity import C4_RING, C128_RING
from remnant.engine.capture_hooks import record_blocks, record_tokens
from remnant.engine.ops import SCRATCH_PER_PAGE, compress_decode, decode_config, index_key_decode
from remnant.kernels.dispatch import reconstruct, store, store_kept_first
from remnant.kv import CSA_RATIO, HEAD_DIM
from remnant.kv.layout import PageLayout


@dataclass
class DecodeBatch:
    """What a decode step reads besides the pools, on the model's device.

    Rows past `real` are padding rows: position 0 in the pools' padding block and slot, a
    page table of padding pages, so all they write lands in the padding and they see no
    record (CUDA graphs replay a fixed batch size)."""

    ids: torch.Tensor  # int64 [B] the new tokens
    pos: torch.Tensor  # int64 [B] their positions (each sequence's length before the step)
    page_table: torch.Tensor  # int64 [B, P] full pages of each sequence, padded with pools.pad_page
    swa_block: torch.Tensor  # int64 [B] each sequence's window ring
    slot: torch.Tensor  # int64 [B] each sequence's compressor state slot
    real: int  # rows that are sequences

    @classmethod
    def of(cls, seqs: list, tokens: "list[int] | torch.Tensor", pools, device: torch.device, rows: int | None = None,
           pages: int | None = None) -> "DecodeBatch":
        """The batch of `seqs` (remnant.engine.sequence.Sequence) each extended by its token,
        padded to `rows` rows and `pages` page-table columns (None: no padding). Built on
        the host and copied once (no sync inside the step). tokens: host ints, or int64
        [len(seqs)] on the device (a step launched before the host read them: padded there)."""
        rows = len(seqs) if rows is None else rows
        pages = max((len(s.pages) for s in seqs), default=1) if pages is None else pages
        if rows < len(seqs) or any(len(s.pages) > pages for s in seqs):
            raise ValueError(f"a batch of {len(seqs)} sequences of up to {max(len(s.pages) for s in seqs)} pages "
                             f"does not fit {rows} rows of {pages} pages")
        pad = rows - len(seqs)
        # In numpy: a torch slice assignment a row (some 130 select, copy and slice
        # operations at batch 128, 0.4 ms of host time in the profile of
        # benchmarks/engine-h100-align-slots/engine-bench-b128-4k.log) before the launch.
        table = np.full((rows, pages), pools.pad_page, dtype=np.int64)
        for i, s in enumerate(seqs):
            table[i, : len(s.pages)] = s.pages
        table = torch.from_numpy(table)
        on_device = isinstance(tokens, torch.Tensor)
        host = torch.tensor([([0] * len(seqs) if on_device else list(tokens)) + [0] * pad,
                             [s.length for s in seqs] + [0] * pad,
                             [s.swa_block for s in seqs] + [pools.pad_block] * pad,
                             [s.slot for s in seqs] + [pools.pad_slot] * pad], dtype=torch.long)
        if device.type == "cuda":  # pinned, so the copies queue behind the stream's work without a sync
            host, table = host.pin_memory(), table.pin_memory()
        host, table = host.to(device, non_blocking=True), table.to(device, non_blocking=True)
        ids = torch.nn.functional.pad(tokens.to(device=device, dtype=torch.long), (0, pad)) if on_device else host[0]
        return cls(ids, host[1], table, host[2], host[3], len(seqs))

    def copy_into(self, other: "DecodeBatch") -> None:
        """Write this batch into `other`'s tensors of the same shapes (a captured graph's
        inputs)."""
        for name in ("ids", "pos", "page_table", "swa_block", "slot"):
            getattr(other, name).copy_(getattr(self, name))
        other.real = self.real


def window_locations(batch: DecodeBatch, window: int) -> torch.Tensor:
    """Ring slots of each token's window, int64 [B, window]: positions pos-window+1..pos in
    order (the new token last), -1 before position 0."""
    positions = batch.pos[:, None] - (window - 1) + torch.arange(window, device=batch.pos.device)
    return torch.where(positions >= 0, batch.swa_block[:, None] * window + positions % window, -1)


def attend_batched(q: torch.Tensor, sink: torch.Tensor, key_sets: list, scale: float) -> torch.Tensor:
    """Softmax attention of B tokens' q [B, H, 512] over key sets with V = K and a per-head
    sink, in float32. key_sets[i]: (keys float [B, S_i, D_i] (each token's own) or [S_i,
    D_i] (shared by the B tokens), cols [D_i] or None (all 512 in order), visible bool [B,
    S_i]). Returns float32 [B, H, 512]; coordinates a key set lacks get nothing from it
    (remnant.engine.model.Model.attend, batched)."""
    q = q.float()
    logits = []
    for keys, cols, visible in key_sets:
        qk = q if cols is None else q[..., cols]
        s = torch.einsum("bhd,bsd->bhs" if keys.dim() == 3 else "bhd,sd->bhs", qk, keys.float()) * scale
        logits.append(s.masked_fill(~visible[:, None, :], float("-inf")))
    B, H = q.shape[0], q.shape[1]
    sink_logit = sink.float()[None, :, None].expand(B, H, 1)
    p = torch.softmax(torch.cat([sink_logit, *logits], dim=-1), dim=-1)[..., 1:]  # the sink gives no value
    out = torch.zeros(B, H, HEAD_DIM, dtype=torch.float32, device=q.device)
    start = 0
    for keys, cols, _ in key_sets:
        size = keys.shape[-2]
        part = torch.einsum("bhs,bsd->bhd" if keys.dim() == 3 else "bhs,sd->bhd", p[..., start : start + size],
                            keys.float())
        start += size
        if cols is None:
            out += part
        else:
            out[..., cols] += part
    return out


def decode_step(model, pools, batch: DecodeBatch, attention: str) -> torch.Tensor:
    """One decode token per row of `batch` through every layer of `model`
    (remnant.engine.model.Model), writing their KV into `pools`; attention "kernels" or
    "torch" (the module docstring). Returns float32 [B, vocab] logits. Sequences' lengths
    are the caller's to advance."""
    a = model.args
    # int32 once here (the kernels' index type), not a cast in each layer's kernels.
    window_locs = window_locations(batch, a.window_size).to(torch.int32)
    # Where each sequence's compressed records and compressor state sit: the same for every
    # layer of a ratio, so found once per step.
    slots = {r: RatioSlots.of(batch, pools, r, model.ops.ratio_slots) for r in set(a.compress_ratios) if r}
    # Each token's own ring slot, where every layer stores its window record.
    own_locs = window_locs[:, -1].contiguous()
    h = model.embed[batch.ids]
    for li, layer in enumerate(model.layers):
        h = _layer(model, li, layer, pools, batch, h, window_locs, own_locs, slots.get(layer.ratio), attention)
    return model.logits(h).float()


@dataclass
class RatioSlots:
    """A decode step's positions in the records and compressor state of one ratio, shared
    by every layer of that ratio."""

    locs: torch.Tensor  # int32 [B, P * per_page] every record slot the page table reaches
    visible: torch.Tensor  # bool [B, P * per_page] which of them the token may read
    visible_locs: torch.Tensor  # int32 [B, P * per_page] locs where visible, else -1 (what HCA layers read)
    counts: torch.Tensor  # int32 [B] how many are visible (they come first)
    state_row: torch.Tensor  # int64 [B] the token's compressor state row
    block_rows: torch.Tensor  # int64 [B, ratio] its open block's state rows, in order
    index: torch.Tensor  # int64 [B] the record index of its block (pos // ratio)
    write_locs: torch.Tensor  # int32 [B] where its block's record goes: the padding page unless complete
    complete: torch.Tensor  # bool [B] whether its token completes its block

    @classmethod
    def of(cls, batch: DecodeBatch, pools, ratio: int, fn) -> "RatioSlots":
        """`fn`: StepOps.ratio_slots (remnant.engine.ops.ratio_slots, the reference, or one
        launch on cuda). Locations and counts are int32, the kernels' index type,
        made here once a step rather than by each layer's kernels."""
        ring = C4_RING if ratio == CSA_RATIO else C128_RING
        return cls(*fn(batch.pos, batch.page_table, batch.slot, pools.page_size, ratio, ring, pools.pad_page))


def _layer(model, li: int, layer, pools, batch: DecodeBatch, h: torch.Tensor, window_locs: torch.Tensor,
           own_locs: torch.Tensor, slots: RatioSlots | None, attention: str) -> torch.Tensor:
    """One layer of the step: h [B, hidden] -> h [B, hidden]."""
    x = model.ops.rms_norm(h, layer.attn_norm, model.args.rms_norm_eps)
    folded = model.folded_weights.get(li)
    p = model.project(layer, x)
    q, q_lora = model.queries(layer, p, batch.pos, folded)
    # In the compute dtype: the stores round to bf16 (SGLang's K) whatever they are given,
    # so a float32 copy would be two casts a layer for the same bytes.
    kv = model.window_latents(layer, p, batch.pos)
    ring = model.layer_format(li)
    ring_pages, ring_layout = pools.swa.pages(li), pools.swa.layouts[li]
    if ring.window_kept_first:
        store_kept_first(kv, ring_pages, ring_layout, own_locs, ring.columns)
    else:  # native records, or packed ones as the layer's C4 records are
        store(kv, ring_pages, ring_layout, own_locs, ring.columns if ring.window_form == "packed" else None)
    if model.recorder is not None:  # a capture: copies only (remnant.engine.capture_hooks)
        n = batch.real
        iw = None if p.iw is None else p.iw[:n]  # (the indexer's: CSA layers only)
        record_tokens(model, li, layer, q[:n], iw, q_lora[:n], kv[:n].float(), decode=True)
    locs = None
    if layer.ratio:
        _compress(model, li, layer, pools, batch, p, slots)
        locs = _select(model, li, layer, pools, p.iw, q_lora, slots, kernels=attention == "kernels")
    if attention == "kernels":
        o = attend_kernels(model, li, layer, pools, q, window_locs, locs)
    else:
        o = attend_torch(model, li, layer, pools, q, window_locs, locs)
    return model.ffn(layer, model.output(layer, h, o.to(h.dtype), folded))


def _compress(model, li: int, layer, pools, batch: DecodeBatch, p, slots: RatioSlots) -> None:
    """The token joins its compressor's open block (state rows in the pools' state dtype);
    where it completes the block, the block becomes a record (and, on CSA layers, an index
    key) at record index pos // ratio; elsewhere those writes go to the padding page.
    model.ops' compress_decode and index_key_decode (two launches and one in a compiled step);
    a capture runs the plain ones around the model's compress_latents and index-key codec,
    as before they were fused, and records the float32 latents."""
    a = model.args
    csa = layer.ratio == CSA_RATIO
    state = pools.c4_state[li] if csa else pools.c128_state[li]
    args = (p.c, p.g, state, slots.state_row, slots.block_rows, layer.gate_bias, layer.kv_norm, slots.index,
            layer.ratio, a.rms_norm_eps, a.compress_rope_theta)
    # Only a completing token's block is read (its record is the one written).
    if model.recorder is None:
        latents = model.ops.compress_decode(*args, complete=slots.complete)
    else:
        latents = compress_decode(*args, compress=model.ops.compress_latents, complete=slots.complete)
    target = pools.c4[li] if csa else pools.c128[li]
    store(latents, target.buf, target.layout, slots.write_locs, model.layer_format(li).record_columns)
    if csa:
        index_state, indexer = pools.c4_index_state[li], pools.indexer[li]
        key_args = (p.ik, index_state, slots.state_row, slots.block_rows, indexer.buf, indexer.layout,
                    slots.write_locs)
        if model.index_key_format.name == "fp8" and model.recorder is None:
            model.ops.index_key_decode(*key_args)
        else:  # the MXFP4 codec (or a capture), through the plain update
            index_key_decode(*key_args, quantize=model.quantize_index_keys)
    if model.recorder is not None:
        # A capture runs eagerly (never in a graph): selecting the completed rows syncs.
        done = (batch.pos % layer.ratio == layer.ratio - 1)[: batch.real]
        block = state[slots.block_rows[: batch.real][done], :, :HEAD_DIM].float()
        ik = None
        if csa:
            ik = pools.c4_index_state[li][slots.block_rows[: batch.real][done], 0, : a.index_head_dim].float()
        record_blocks(model, li, layer, block[:, :, 0], block[:, :, 1], slots.index[: batch.real][done],
                      latents[: batch.real][done], state.dtype, ik)


def _select(model, li: int, layer, pools, iw: torch.Tensor, q_lora: torch.Tensor, slots: RatioSlots,
            kernels: bool = False) -> torch.Tensor:
    """Locations int32 [B, K] of the records each token reads (-1: none), of those the page
    table reaches (slots.locs): on CSA layers the indexer's top-k over every visible
    C4 index key, on HCA layers every visible C128 record. `kernels`: scores from
    remnant.kernels.indexer (the FP8 keys read in place), else gathered and scored in torch."""
    all_locs = slots.locs
    if layer.ratio != CSA_RATIO:
        return slots.visible_locs
    indexer = pools.indexer[li]
    if kernels:
        from remnant.kernels.indexer import index_scores

        # The head weights as projected: the kernel scales them (no cast or scale launch).
        scores = index_scores(model.index_q(layer, q_lora), iw, indexer.buf, indexer.layout, all_locs, slots.counts,
                              key_format=model.index_key_format, w_scale=model.index_weight_scale,
                              config=model.index_scores_config)
    else:
        keys = model.index_key_format.dequantize(indexer.layout.read(indexer.buf, all_locs).flatten(0, 1))
        scores = model.index_scores_batched(layer, iw, q_lora, keys.view(*all_locs.shape, -1).to(model.dtype))
        scores = scores.masked_fill(~slots.visible, float("-inf"))
    # Scores past a row's count are -inf (both paths): the kernel's top-k reads only up to it.
    return model.ops.index_top_locations(scores, min(model.args.index_topk, all_locs.shape[1]), all_locs,
                                         slots.counts)


def _ring(pools, li: int, ring: tuple | None) -> tuple:
    """(pages, layout) of the window records the attention reads: layer li's ring, or the
    scratch ring a prefill step fills (remnant.engine.prefill_step)."""
    return (pools.swa.pages(li), pools.swa.layouts[li]) if ring is None else ring


def attend_torch(model, li: int, layer, pools, q: torch.Tensor, window_locs: torch.Tensor,
                 locs: torch.Tensor | None, ring: tuple | None = None) -> torch.Tensor:
    """attend_batched over the gathered window and selected records; float32 [B, H, 512] in
    natural column order (the torch path folds no weights). ring: (pages, layout) the
    window locations point into (None: layer li's ring)."""
    B, W = window_locs.shape
    fmt = model.layer_format(li)
    ring_pages, ring_layout = _ring(pools, li, ring)
    window = ring_layout.read(ring_pages, window_locs.clamp_min(0))
    window_keys, window_cols = fmt.ring_keys(window.flatten(0, 1))
    key_sets = [(window_keys.view(B, W, -1), window_cols, window_locs >= 0)]
    if locs is not None and locs.shape[1]:
        target = pools.c4[li] if layer.ratio == CSA_RATIO else pools.c128[li]
        stored = target.layout.read(target.buf, locs.clamp_min(0)).flatten(0, 1)
        keys, cols = model.layer_format(li).read(stored)
        key_sets.append((keys.view(B, locs.shape[1], -1), cols, locs >= 0))
    return attend_batched(q, layer.sink, key_sets, model.scale)


def attend_kernels(model, li: int, layer, pools, q: torch.Tensor, window_locs: torch.Tensor,
                   locs: torch.Tensor | None, ring: tuple | None = None, distinct: bool = False) -> torch.Tensor:
    """Attention through remnant.kernels: [B, H, 512] in q's column order (kept-first on
    layers with folded_weights). ring: as attend_torch. distinct: triton mode rebuilds each
    packed record once, not once per entry (_rebuilt; prefill steps)."""
    from remnant.kernels.decode import DecodeConfig, decode

    ring_pages, ring_layout, window_locs, window_form = _window_for_kernels(model, li, _ring(pools, li, ring),
                                                                            window_locs, distinct)
    if locs is None:
        # Window-only layer: an empty record set (the ring stands in for its pages, which the
        # kernel never reads), packed where the ring is.
        c4, c4_layout = ring_pages, ring_layout
        columns = model.layer_format(li).columns if window_form == "packed" else model.native_columns
        locs = torch.empty(q.shape[0], 0, dtype=torch.long, device=q.device)
    else:
        c4, c4_layout, locs, columns = _records_for_kernels(model, li, layer, pools, locs, distinct)
        if window_form == "packed" and not columns.packed:
            # A packed window beside native records (an HCA layer that packs only its
            # window): the kernel reads one packed record set and one native one in a single
            # softmax, whichever it calls the window, so the two trade places.
            c4, c4_layout, locs, ring_pages, ring_layout, window_locs = (
                ring_pages, ring_layout, window_locs, c4, c4_layout, locs)
            columns, window_form = model.layer_format(li).columns, "natural"
    folded = li in model.folded_weights
    config = decode_config(q.shape[1])
    if not columns.packed and window_form == "natural" and not folded:
        # Native records in natural order: the kernel the model chose for them (FlashMLA's
        # where it runs), so that what /server_info reports is what ran.
        config = replace(config or DecodeConfig(), kernel=model.native_decode)
    return decode(q, c4, c4_layout, locs, ring_pages, ring_layout, window_locs, layer.sink, columns, model.scale,
                  columns="kept_first" if folded else "natural",
                  window_columns=window_form, config=config)


def _window_for_kernels(model, li: int, ring: tuple, window_locs: torch.Tensor, distinct: bool = False):
    """The window records as the decode kernels take them: (pages, layout, locations [B, W]
    with -1, window_columns). A packed ring in triton mode is rebuilt into native scratch
    records first, as its C4 records are (_rebuilt); kernel mode reads it packed."""
    fmt = model.layer_format(li)
    pages, layout = ring
    if fmt.window_form != "packed" or not fmt.rules.reconstructs:
        return pages, layout, window_locs, fmt.window_form
    return (*_rebuilt(pages, layout, window_locs, fmt.columns, distinct), "natural")


def _records_for_kernels(model, li: int, layer, pools, locs: torch.Tensor, distinct: bool = False):
    """The selected records as the decode kernels take them: (pages, layout, locations [B, K]
    with -1, kept columns). Triton mode rebuilds them into native scratch records first
    (_rebuilt)."""
    target = pools.c4[li] if layer.ratio == CSA_RATIO else pools.c128[li]
    fmt = model.layer_format(li)
    if not fmt.records_packed:
        return target.buf, target.layout, locs, model.native_columns
    if fmt.rules.direct_decode:
        return target.buf, target.layout, locs, fmt.columns
    return (*_rebuilt(target.buf, target.layout, locs, fmt.columns, distinct), model.native_columns)


def _rebuilt(pages: torch.Tensor, layout: PageLayout, locs: torch.Tensor, columns, distinct: bool):
    """Native scratch copies of the packed records at `locs` [B, K] (-1: none): (scratch
    pages, their layout, locations [B, K] in them with -1). A decode step rebuilds one
    record per entry, B x K whether selected or not (unselected entries read record 0 and
    are never attended): a size fixed by the shapes, as a CUDA graph needs. `distinct` (a
    prefill step, never in a graph: torch.unique reads its size back) rebuilds each record
    once, where a chunk's tokens share their windows and an HCA layer's records (T x n
    entries of n records: 300 MB a layer at 128k context)."""
    if distinct:
        wanted = locs >= 0
        unique, inverse = torch.unique(locs[wanted], return_inverse=True)
        scratch, scratch_layout = _scratch_pages(unique.numel(), locs.device)
        if unique.numel():
            reconstruct(pages, layout, unique, columns, scratch, scratch_layout,
                        torch.arange(unique.numel(), device=locs.device))
        return scratch, scratch_layout, torch.full_like(locs, -1).masked_scatter_(wanted, inverse.to(locs.dtype))
    scratch, scratch_layout = _scratch_pages(locs.numel(), locs.device)
    rows = torch.arange(locs.numel(), device=locs.device, dtype=locs.dtype)  # int32 in a decode step
    reconstruct(pages, layout, locs.clamp_min(0).flatten(), columns, scratch, scratch_layout, rows)
    return scratch, scratch_layout, torch.where(locs >= 0, rows.view_as(locs), -1)


def _scratch_pages(count: int, device: torch.device) -> tuple[torch.Tensor, PageLayout]:
    """Native scratch pages for `count` records, and their layout."""
    layout = PageLayout.sglang(SCRATCH_PER_PAGE)
    return torch.empty(max(-(-count // SCRATCH_PER_PAGE), 1), layout.page_stride, dtype=torch.uint8,
                       device=device), layout
