"""A small DeepSeek-V4-shaped model: the attention the engine serves, with random weights.

Faithful where Remnant acts: one shared K=V head of 512 (448 NoPE + 64 RoPE) against
`num_attention_heads` query heads, a `window_size`-token sliding window on every layer,
per-layer compress ratios (0: window only; 4: CSA, C4 records chosen by an indexer's
top-k; 128: HCA, every C128 record), an attention sink per head, and C4/C128 records
stored as native 584-byte FP8 records (remnant.kv). The rest (MoE, hyper-connections,
grouped output projection) is replaced by a dense SwiGLU block: text output is
meaningless, bytes and attention shapes are real.

Positions: token t sees window tokens t-window+1..t, and compressed record j (tokens
j*r..j*r+r-1) once its block is complete (j*r + r - 1 <= t).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from remnant.kv import HEAD_DIM, NATIVE_RECORD_BYTES, NOPE_DIM, ROPE_DIM
from remnant.kv.attention import packed_keys
from remnant.kv.codec import dequantize, quantize
from remnant.kv.packing import check_keep, pack, unpack

CSA_RATIO = 4
HCA_RATIO = 128


@dataclass
class ModelArgs:
    """Architecture, with DeepSeek-V4 config.json names (see remnant.config.ModelConfig)."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int
    intermediate_size: int
    compress_ratios: list[int]
    window_size: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    max_position_embeddings: int
    rope_theta: float
    compress_rope_theta: float
    seed: int
    rms_norm_eps: float = 1e-6

    @classmethod
    def from_hf_config(cls, cfg: dict) -> "ModelArgs":
        names = cls.__dataclass_fields__
        missing = [n for n in names if n not in cfg and n != "rms_norm_eps"]
        if missing:
            raise ValueError(f"config.json lacks {', '.join(missing)}")
        return cls(**{n: cfg[n] for n in names if n in cfg})


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate the last ROPE_DIM coordinates of x [T, 512] or [T, H, 512] by positions [T]."""
    half = ROPE_DIM // 2
    inv = theta ** (-torch.arange(half, dtype=torch.float32) / half)
    ang = positions.float()[:, None] * inv[None, :]  # [T, half]
    cos, sin = ang.cos(), ang.sin()
    if x.ndim == 3:  # [T, H, D]
        cos, sin = cos[:, None, :], sin[:, None, :]
    nope, r = x[..., :NOPE_DIM], x[..., NOPE_DIM:]
    r1, r2 = r[..., :half], r[..., half:]
    return torch.cat([nope, r1 * cos - r2 * sin, r1 * sin + r2 * cos], dim=-1)


MODES = ("native", "triton", "kernel")


class C4Format:
    """How one CSA layer stores and reads its C4 records (DESIGN section 4).

    native: 584-byte records, read whole. triton: packed R + 72-byte records (packed at
    the KV write), reconstructed to native for attention. kernel: packed records read
    directly: only kept coordinates enter scores and output.
    """

    def __init__(self, mode: str = "native", keep: torch.Tensor | None = None):
        if mode not in MODES:
            raise ValueError(f"mode={mode} is not a mode; allowed: {', '.join(MODES)}")
        if (mode == "native") != (keep is None):
            raise ValueError(f"mode={mode} {'takes no' if mode == 'native' else 'needs a'} retention keep list")
        if keep is not None:
            check_keep(keep)
        self.mode, self.keep = mode, keep
        self.cols = None if keep is None else torch.cat([keep, torch.arange(NOPE_DIM, HEAD_DIM)])

    @property
    def retention(self) -> int:
        return HEAD_DIM if self.keep is None else self.keep.numel() + ROPE_DIM

    @property
    def record_bytes(self) -> int:
        return NATIVE_RECORD_BYTES if self.keep is None else self.keep.numel() + 136

    def write(self, native: torch.Tensor) -> torch.Tensor:
        """Native records uint8 [n, 584] -> as stored, uint8 [n, record_bytes]."""
        return native if self.keep is None else pack(native, self.keep)

    def read(self, stored: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Stored records -> (keys float32 [n, D], output columns [D] or None for all 512)."""
        if self.mode == "native":
            return dequantize(stored), None
        if self.mode == "triton":
            return dequantize(unpack(stored, self.keep)), None
        return packed_keys(stored, self.keep), self.cols


class Layer:
    """Weights of one decoder layer (attention + dense SwiGLU)."""

    def __init__(self, args: ModelArgs, ratio: int, gen: torch.Generator):
        h, H = args.hidden_size, args.num_attention_heads

        def w(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=gen) / math.sqrt(shape[0])

        self.ratio = ratio
        self.attn_norm = torch.ones(h)
        self.wq_a = w(h, args.q_lora_rank)
        self.q_norm = torch.ones(args.q_lora_rank)
        self.wq_b = w(args.q_lora_rank, H * HEAD_DIM)
        self.wkv = w(h, HEAD_DIM)
        self.kv_norm = torch.ones(HEAD_DIM)
        self.sink = torch.randn(H, generator=gen)  # attention-sink logit per head
        self.wo = w(H * HEAD_DIM, h) / math.sqrt(H)
        self.ffn_norm = torch.ones(h)
        self.w_gate = w(h, args.intermediate_size)
        self.w_up = w(h, args.intermediate_size)
        self.w_down = w(args.intermediate_size, h)
        if ratio:
            # Compressor: a softmax gate over the block's tokens, per coordinate.
            self.wc = w(h, HEAD_DIM)
            self.wg = w(h, HEAD_DIM)
            self.gate_bias = torch.randn(ratio, HEAD_DIM, generator=gen) * 0.1
        if ratio == CSA_RATIO:
            self.wi_q = w(args.q_lora_rank, args.index_n_heads * args.index_head_dim)
            self.wi_k = w(h, args.index_head_dim)
            self.wi_w = w(h, args.index_n_heads)


class Model:
    """Random seeded weights for `args`; forward helpers used by the engine."""

    def __init__(self, args: ModelArgs, c4_formats: dict[int, C4Format] | None = None):
        for i, r in enumerate(args.compress_ratios):
            if r not in (0, CSA_RATIO, HCA_RATIO):
                raise ValueError(f"compress_ratios[{i}]={r}; allowed: 0, 4, 128")
        self.args = args
        self.csa_layers = [i for i, r in enumerate(args.compress_ratios) if r == CSA_RATIO]
        self.c4_formats = {i: C4Format() for i in self.csa_layers}
        #: layer -> list of query tensors [T, H, 512] while calibrating (None otherwise)
        self.capture: dict[int, list[torch.Tensor]] | None = None
        if c4_formats is not None:
            self.set_c4_formats(c4_formats)
        gen = torch.Generator().manual_seed(args.seed)
        self.embed = torch.randn(args.vocab_size, args.hidden_size, generator=gen)
        self.layers = [Layer(args, r, gen) for r in args.compress_ratios]
        self.norm = torch.ones(args.hidden_size)
        self.lm_head = torch.randn(args.hidden_size, args.vocab_size, generator=gen) / math.sqrt(
            args.hidden_size
        )
        self.scale = 1.0 / math.sqrt(HEAD_DIM)

    def set_c4_formats(self, formats: dict[int, C4Format]) -> None:
        """One format per CSA layer (new sequences only: stored records keep their format)."""
        if sorted(formats) != self.csa_layers:
            raise ValueError(f"C4 formats given for layers {sorted(formats)}; the model's CSA layers are {self.csa_layers}")
        self.c4_formats = dict(formats)

    def record_bytes(self) -> list[int]:
        """Stored bytes of one compressed record per layer (0 for window-only layers)."""
        return [
            self.c4_formats[i].record_bytes if r == CSA_RATIO else (NATIVE_RECORD_BYTES if r else 0)
            for i, r in enumerate(self.args.compress_ratios)
        ]

    # Per-token projections, batched over any token set ------------------------------

    def queries(self, layer: Layer, x: torch.Tensor, pos: torch.Tensor):
        """x [T, hidden] normed -> q [T, H, 512] with RoPE, and q_lora [T, q_lora_rank]."""
        a = self.args
        q_lora = rms_norm(x @ layer.wq_a, layer.q_norm, a.rms_norm_eps)
        q = (q_lora @ layer.wq_b).view(-1, a.num_attention_heads, HEAD_DIM)
        q = rms_norm(q, torch.ones(HEAD_DIM), a.rms_norm_eps)
        return rope(q, pos, a.rope_theta), q_lora

    def window_latents(self, layer: Layer, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] normed -> K=V latents [T, 512], as stored (through the FP8 record)."""
        kv = rms_norm(x @ layer.wkv, layer.kv_norm, self.args.rms_norm_eps)
        return dequantize(quantize(rope(kv, pos, self.args.rope_theta)))

    def ffn(self, layer: Layer, h: torch.Tensor) -> torch.Tensor:
        x = rms_norm(h, layer.ffn_norm, self.args.rms_norm_eps)
        return h + (F.silu(x @ layer.w_gate) * (x @ layer.w_up)) @ layer.w_down

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return rms_norm(h, self.norm, self.args.rms_norm_eps) @ self.lm_head

    def compress(
        self, layer: Layer, c: torch.Tensor, g: torch.Tensor, block_index: torch.Tensor
    ) -> torch.Tensor:
        """Compress blocks of `ratio` tokens into native records.

        c, g: [n_blocks, ratio, 512] content and gate logits of complete blocks.
        block_index: [n_blocks] index of each block in the sequence (for RoPE).
        Returns uint8 [n_blocks, 584].
        """
        weights = torch.softmax(g + layer.gate_bias, dim=1)
        latent = rms_norm((weights * c).sum(1), layer.kv_norm, self.args.rms_norm_eps)
        pos = block_index * layer.ratio
        return quantize(rope(latent, pos, self.args.compress_rope_theta))

    def attend(
        self,
        layer: Layer,
        q: torch.Tensor,
        key_sets: list[tuple[torch.Tensor, torch.Tensor | None]],
        masks: list[torch.Tensor],
    ) -> torch.Tensor:
        """Softmax attention of q [T, H, 512] over key sets with V = K and a per-head sink.

        key_sets[i]: (keys [S_i, D_i], cols): keys in the output coordinates `cols` [D_i]
        (None: all 512 in order), as packed records give only their kept coordinates;
        masks[i]: bool [T, S_i] (True = visible). Returns [T, H, 512]: coordinates a key
        set lacks get nothing from it, in scores and in output.
        """
        logits, parts = [], []
        for (k, cols), m in zip(key_sets, masks):
            if k.shape[0] == 0:
                continue
            qk = q if cols is None else q[..., cols]
            s = torch.einsum("thd,sd->hts", qk, k) * self.scale
            logits.append(s.masked_fill(~m[None], float("-inf")))
            parts.append((k, cols))
        T, H = q.shape[0], q.shape[1]
        sink = layer.sink[:, None, None].expand(H, T, 1)
        p = torch.softmax(torch.cat([sink, *logits], dim=-1), dim=-1)[..., 1:]  # the sink gives no value
        out = torch.zeros(T, H, HEAD_DIM, dtype=q.dtype)
        start = 0
        for k, cols in parts:
            o = torch.einsum("hts,sd->thd", p[..., start : start + k.shape[0]], k)
            start += k.shape[0]
            if cols is None:
                out += o
            else:
                out[..., cols] += o
        return out

    def output(self, layer: Layer, h: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        return h + o.reshape(o.shape[0], -1) @ layer.wo

    # Indexer (CSA layers) -------------------------------------------------------------

    def index_keys(self, layer: Layer, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] normed -> per-token indexer key contributions [T, index_head_dim]."""
        return x @ layer.wi_k

    def index_scores(
        self, layer: Layer, x: torch.Tensor, q_lora: torch.Tensor, keys: torch.Tensor
    ) -> torch.Tensor:
        """Indexer scores [T, n_records]: sum_h w_h relu(q_h . k_j)."""
        a = self.args
        qi = (q_lora @ layer.wi_q).view(-1, a.index_n_heads, a.index_head_dim)
        wi = x @ layer.wi_w / math.sqrt(a.index_n_heads)
        return torch.einsum("th,thj->tj", wi, torch.relu(torch.einsum("thd,jd->thj", qi, keys)))

    # One engine step: extend several sequences by their new tokens ------------------

    def forward(self, states: list, chunks: list[list[int]]) -> torch.Tensor:
        """Extend each sequence by its chunk of new tokens (prefill chunks and decodes mixed).

        states: SequenceState per sequence, updated in place.
        chunks: new token ids per sequence (non-empty).
        Returns float32 [B, vocab] logits at the last new token of each sequence.
        """
        sizes = [len(c) for c in chunks]
        ids = torch.tensor([t for c in chunks for t in c], dtype=torch.long)
        pos = torch.cat(
            [torch.arange(s.length, s.length + n, dtype=torch.long) for s, n in zip(states, sizes)]
        )
        h = self.embed[ids]
        for li, layer in enumerate(self.layers):
            x = rms_norm(h, layer.attn_norm, self.args.rms_norm_eps)
            q, q_lora = self.queries(layer, x, pos)
            kv = self.window_latents(layer, x, pos)
            c = x @ layer.wc if layer.ratio else None
            g = x @ layer.wg if layer.ratio else None
            ik = self.index_keys(layer, x) if layer.ratio == CSA_RATIO else None
            outs, start = [], 0
            for state, n in zip(states, sizes):
                sl = slice(start, start + n)
                start += n
                outs.append(
                    self._attend_sequence(
                        li,
                        layer,
                        state.layers[li],
                        x[sl],
                        q[sl],
                        q_lora[sl],
                        kv[sl],
                        pos[sl],
                        None if c is None else c[sl],
                        None if g is None else g[sl],
                        None if ik is None else ik[sl],
                    )
                )
            h = self.ffn(layer, self.output(layer, h, torch.cat(outs)))
        for state, chunk in zip(states, chunks):
            state.length += len(chunk)
            state.token_ids.extend(chunk)
        last = torch.tensor(sizes).cumsum(0) - 1
        return self.logits(h[last])

    def _attend_sequence(self, li, layer, ls, x, q, q_lora, kv, pos, c, g, ik) -> torch.Tensor:
        a = self.args
        keys = torch.cat([ls.window, kv])
        kpos = torch.cat([ls.window_pos, pos])
        win_mask = (kpos[None, :] <= pos[:, None]) & (kpos[None, :] > pos[:, None] - a.window_size)
        key_sets, masks = [(keys, None)], [win_mask]
        ls.window, ls.window_pos = keys[-a.window_size :], kpos[-a.window_size :]

        if layer.ratio:
            self._compress_new_blocks(li, layer, ls, c, g, ik)
            n = ls.records.shape[0]
            if self.capture is not None and layer.ratio == CSA_RATIO:
                self.capture[li].append(q.detach().clone())
            if n:
                rec_end = (torch.arange(n) + 1) * layer.ratio - 1
                visible = rec_end[None, :] <= pos[:, None]  # [T, n]
                if layer.ratio == CSA_RATIO:
                    scores = self.index_scores(layer, x, q_lora, ls.index_keys)
                    scores = scores.masked_fill(~visible, float("-inf"))
                    k = min(a.index_topk, n)
                    top = scores.topk(k, dim=-1).indices
                    chosen = torch.zeros_like(visible).scatter_(1, top, True) & visible
                else:
                    chosen = visible
                used = chosen.any(0).nonzero().squeeze(1)
                if used.numel():
                    # Only the selected records are read back from their stored bytes.
                    if layer.ratio == CSA_RATIO:
                        key_sets.append(self.c4_formats[li].read(ls.records[used]))
                    else:
                        key_sets.append((dequantize(ls.records[used]), None))
                    masks.append(chosen[:, used])
        return self.attend(layer, q, key_sets, masks)

    def _compress_new_blocks(self, li, layer, ls, c, g, ik) -> None:
        r = layer.ratio
        pc, pg = torch.cat([ls.pending_c, c]), torch.cat([ls.pending_g, g])
        pik = torch.cat([ls.pending_ik, ik]) if ik is not None else None
        full = pc.shape[0] // r
        if full:
            first = ls.records.shape[0]
            block_index = torch.arange(first, first + full)
            new = self.compress(
                layer,
                pc[: full * r].view(full, r, -1),
                pg[: full * r].view(full, r, -1),
                block_index,
            )
            if layer.ratio == CSA_RATIO:
                new = self.c4_formats[li].write(new)  # packed at the KV write
            ls.records = torch.cat([ls.records, new])
            if pik is not None:
                ls.index_keys = torch.cat([ls.index_keys, pik[: full * r].view(full, r, -1).mean(1)])
        ls.pending_c, ls.pending_g = pc[full * r :], pg[full * r :]
        if pik is not None:
            ls.pending_ik = pik[full * r :]
