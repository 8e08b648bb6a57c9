"""A small DeepSeek-V4-shaped model: the attention the engine serves, with random weights.

Faithful where Remnant acts: one shared K=V head of 512 (448 NoPE + 64 RoPE) against
`num_attention_heads` query heads, a `window_size`-token sliding window on every layer,
per-layer compress ratios (0: window only; 4: CSA, C4 records chosen by an indexer's
top-k; 128: HCA, every C128 record), an attention sink per head, and window, C4 and C128
records stored as 584-byte FP8 records (remnant.kv), or packed ones where a packed mode
packs them (C4Format). Feed-forward: a dense SwiGLU, or a routed MoE with a grouped
low-rank output projection at V4-Flash's shapes (no hyper-connections): text output is
meaningless, bytes and attention shapes are real.

Positions: token t sees window tokens t-window+1..t, and compressed record j (tokens
j*r..j*r+r-1) once its block is complete (j*r + r - 1 <= t).

Devices and decode paths: weights come from the seeded generator on the CPU, then move to
`device` (cpu or cuda), so both devices hold the same model. Prefill chunks attend through
the torch reference below. With decode_path=kernels, single-token chunks (decode steps)
attend through remnant.kernels instead: the Triton decode over the pools' pages (after the
Triton reconstruct in triton mode), and their records are written through
remnant.kernels.dispatch.store: the Triton store on CUDA, its torch reference on the CPU (Triton's
interpreter rounds some FP8 casts wrongly, triton-lang/triton issue 8322, so its records
would not be the engine's).

Kernel mode with decode_path=kernels: the packed decode kernel takes q and gives out in
kept-first column order (KeptColumns.order; RoPE stays at 448..511), so the model keeps
each such layer's wq_b and wo with that permutation folded into the projections
(Model.folded_weights): q comes out kept-first for every token of the step, decode runs
with columns="kept_first", and wo reads kept-first o. That saves decode the two Triton
passes permuting q and out (benchmarks/kernels/NOTES.md, "Third round", has their cost). Tokens attending through the torch
reference put q back in natural order and their output in kept-first order.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from remnant.config import BlockShapes
from remnant.engine.args import DECODE_PATHS, ENGINE_DEVICES, ENGINE_DTYPES, NATIVE_DECODES, kernels_need_interpreter
from remnant.kv import CSA_RATIO, HCA_RATIO, HEAD_DIM, NATIVE_RECORD_BYTES, NOPE_DIM, ROPE_DIM
from remnant.kv.attention import packed_keys
from remnant.kv.codec import dequantize, quantize
from remnant.kv.packing import check_keep, pack, unpack
from remnant.kernels.dispatch import store
from remnant.kv.layout import KeptColumns, PageLayout
from remnant.kv.modes import mode_of
from remnant.kv.paged import dequantize_kept_first, quantize_kept_first
from remnant.engine.ops import decode_config
from remnant.engine.step_ops import PLAIN_OPS, compiled_ops
from remnant.kv.index_keys import IndexKeyFormat

#: A sequence's token_ids entry for a decode token still on the device (Model.forward).
UNREAD_TOKEN = -1



@dataclass
class ModelArgs(BlockShapes):
    """Architecture, with DeepSeek-V4 config.json names (see remnant.config.ModelConfig); the
    output projection and feed-forward shapes come from BlockShapes."""

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
        fields = cls.__dataclass_fields__
        missing = [n for n, f in fields.items() if n not in cfg and f.default is dataclasses.MISSING]
        if missing:
            raise ValueError(f"config.json lacks {', '.join(missing)}")
        return cls(**{n: cfg[n] for n in fields if n in cfg})


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """The compute dtype: auto -> bfloat16 on CUDA (as SGLang serves V4), float32 on the CPU."""
    if dtype not in ENGINE_DTYPES:
        raise ValueError(f"dtype={dtype} is not allowed; allowed: {', '.join(ENGINE_DTYPES)}")
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, dtype)


def resolve_device(device: str) -> torch.device:
    """`device` (cpu or cuda) as a torch.device; a clear error when CUDA is not there."""
    if device not in ENGINE_DEVICES:
        raise ValueError(f"device={device} is not allowed; allowed: {', '.join(ENGINE_DEVICES)}")
    if device == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError(f"device=cuda needs a CUDA GPU, but torch.cuda.is_available() is false "
                         f"(torch {torch.__version__}); use device=cpu")
    # An explicit index, so tensors' devices compare equal to it (cuda != cuda:0).
    return torch.device("cuda", torch.cuda.current_device())


def resolve_native_decode(native_decode: str, device: torch.device, decode_path: str,
                          heads: int) -> tuple[str, str | None]:
    """The kernel that decode steps run over native records (native and triton modes' CSA
    layers, every window-only and HCA layer): ("flashmla", None), FlashMLA's V4 decode as
    SGLang runs it; or ("triton", why not FlashMLA), Remnant's Triton native kernel; or
    ("reference" or "torch", why) where decode steps attend in torch (decode_path reference
    or batched). native_decode: auto, flashmla (an error where it cannot run) or triton;
    see remnant.kernels.decode.choose."""
    if native_decode not in NATIVE_DECODES:
        raise ValueError(f"native_decode={native_decode} is not allowed; allowed: {', '.join(NATIVE_DECODES)}")
    if decode_path in TORCH_DECODE_PATHS:
        if native_decode == "flashmla":
            raise ValueError(f"native_decode=flashmla needs decode_path=kernels (or auto on cuda); "
                             f"decode_path={decode_path} attends in torch")
        return TORCH_DECODE_PATHS[decode_path]
    from remnant.kernels.decode import DecodeConfig, choose

    # The engine's native records sit in SGLang's split pages (C4, C128, the SWA pool and
    # triton mode's scratch), which FlashMLA reads.
    return choose(device, heads, False, layouts=(PageLayout.sglang(64),),
                  config=DecodeConfig(kernel=None if native_decode == "auto" else native_decode), field="native_decode")


def resolve_packed_decode(device: torch.device, decode_path: str, heads: int, n_kept: int | None,
                          dtype: torch.dtype, window_columns: str = "kept_first") -> tuple[str | None, str | None]:
    """The kernel that kernel mode's decode steps run over packed records (the folded call:
    q and out in kept-first order, the window ring in `window_columns` form: kept-first
    records, or packed ones): ("sm90", None), the SM90 Gluon kernel; ("triton", why not
    it); ("reference", why) on the torch reference path; (None, None) where no layer holds
    packed records (n_kept None)."""
    if n_kept is None:
        return None, None
    if decode_path in TORCH_DECODE_PATHS:
        return TORCH_DECODE_PATHS[decode_path]
    from remnant.kernels.decode import DecodeConfig, choose

    return choose(device, heads, True, n_kept=n_kept, columns="kept_first", window_columns=window_columns,
                  q_dtype=dtype, config=decode_config(heads) or DecodeConfig())


#: What decode steps run instead of a kernel on the paths that attend in torch: (name, why).
TORCH_DECODE_PATHS = {
    "reference": ("reference", "decode steps attend through the per-sequence torch reference (decode_path=reference)"),
    "batched": ("torch", "decode steps attend in torch, batched (decode_path=batched, the CPU's default)"),
}


def resolve_decode_path(decode_path: str, device: torch.device) -> str:
    """auto -> kernels on CUDA, batched on the CPU. Kernels on the CPU run only under
    Triton's interpreter, which must be chosen before triton is imported."""
    if decode_path not in DECODE_PATHS:
        raise ValueError(f"decode_path={decode_path} is not allowed; allowed: {', '.join(DECODE_PATHS)}")
    if decode_path == "auto":
        return "kernels" if device.type == "cuda" else "batched"
    if kernels_need_interpreter(decode_path, device.type):
        raise ValueError("decode_path=kernels on device=cpu needs TRITON_INTERPRET=1 (Triton's interpreter) "
                         "in the environment before triton is imported; or use decode_path=batched")
    return decode_path


class C4Format:
    """How one layer stores and reads its compressed records and its window ring (docs/kv.md):
    a CSA layer's C4 records, or an HCA layer's C128 records (Model.layer_formats).

    native: 584-byte records, read whole. triton: packed R + 72-byte records (packed at
    the KV write), reconstructed to native for attention. kernel: packed records read
    directly: only kept coordinates enter scores and output; on the kernels decode path
    the model folds the kernel's kept-first column order into a CSA layer's wq_b and wo
    (FoldedWeights). pack_records False (an HCA layer with retention.c128_records=native):
    the records stay native in a packed mode. pack_window (packed modes;
    retention.window_records): the layer's window ring holds packed records too, with the
    same kept columns, stored and read as packed records are.
    """

    def __init__(self, mode: str = "native", keep: torch.Tensor | None = None,
                 device: torch.device | str = "cpu", pack_window: bool = False, pack_records: bool = True):
        rules = mode_of(mode)
        if rules.keeps_retention == (keep is None):
            raise ValueError(f"mode={mode} {'needs a' if rules.keeps_retention else 'takes no'} retention keep list")
        if pack_window and not rules.packed:
            raise ValueError(f"mode={mode} stores native records: it packs no window records")
        if keep is not None:
            check_keep(keep)
        #: The mode's name (as the batched decode step compares it) and what it does.
        self.mode, self.rules = mode, rules
        self.keep, self.device = keep, torch.device(device)
        self.pack_window, self.pack_records = pack_window, pack_records
        self.cols = None if keep is None else torch.cat([keep.cpu(), torch.arange(NOPE_DIM, HEAD_DIM)]).to(device)
        #: The kept columns as the kernels read them, on `device`, built once (None: native).
        self.columns = None if keep is None else KeptColumns.of(keep, self.device)

    def to(self, device: torch.device | str) -> "C4Format":
        """The same format with its column tables on `device` (keep stays as given)."""
        if torch.device(device) == self.device:
            return self
        return C4Format(self.mode, self.keep, device, self.pack_window, self.pack_records)

    @property
    def retention(self) -> int:
        return HEAD_DIM if self.keep is None else self.keep.numel() + ROPE_DIM

    @property
    def records_packed(self) -> bool:
        """Whether the layer's compressed records are stored packed."""
        return self.rules.packed and self.pack_records

    @property
    def record_bytes(self) -> int:
        return self.rules.record_bytes(self.retention) if self.pack_records else NATIVE_RECORD_BYTES

    @property
    def record_columns(self) -> KeptColumns | None:
        """The kept columns the records are stored with (the store's keep; None: native)."""
        return self.columns if self.records_packed else None

    def write(self, native: torch.Tensor) -> torch.Tensor:
        """Native records uint8 [n, 584] -> as stored, uint8 [n, record_bytes]."""
        return pack(native, self.keep) if self.records_packed else native

    def read(self, stored: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Stored records -> (keys float32 [n, D], output columns [D] or None for all 512)."""
        return self._read(stored) if self.records_packed else (dequantize(stored), None)

    def _read(self, stored: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Packed records (C4, C128 or window) as the mode reads them."""
        if self.rules.reconstructs:
            return dequantize(unpack(stored, self.keep)), None
        return packed_keys(stored, self.keep), self.cols

    @property
    def window_form(self) -> str:
        """How this layer's window ring holds its records, as decode's window_columns names
        it: "packed" (pack_window: the C4 records' packed form, R + 72 bytes), "kept_first"
        (kernel mode otherwise: remnant.kv.paged.quantize_kept_first, codes in kept-first
        order, scale tiles of 64 kept-first positions, which the packed decode kernel reads
        with word loads and scales found from positions; benchmarks/kernels/NOTES.md) or
        "natural" (native records). With all 448 coordinates kept every form is the native
        record: the ring is native and the native decode kernel reads that layer."""
        if self.columns is None or not self.columns.packed:
            return "natural"
        if self.pack_window:
            return "packed"
        return "kept_first" if self.rules.direct_decode else "natural"

    @property
    def window_kept_first(self) -> bool:
        return self.window_form == "kept_first"

    @property
    def ring_retention(self) -> int:
        """R of this layer's window ring records: the layer's where the ring is packed, else
        512 (whole records)."""
        return self.retention if self.window_form == "packed" else HEAD_DIM

    @property
    def ring_record_bytes(self) -> int:
        """Bytes of one record of this layer's window ring."""
        return self.columns.record_bytes if self.window_form == "packed" else NATIVE_RECORD_BYTES

    def ring_records(self, latents: torch.Tensor) -> torch.Tensor:
        """Window latents float [n, 512] -> uint8 [n, ring_record_bytes] as this layer's ring
        stores them."""
        form = self.window_form
        if form == "packed":
            return pack(quantize(latents), self.keep)
        return quantize_kept_first(latents, self.columns) if form == "kept_first" else quantize(latents)

    def ring_keys(self, stored: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Records read from this layer's ring -> (keys float32 [n, D], output columns [D] or
        None for all 512 in natural order), as read gives C4 records'."""
        form = self.window_form
        if form == "packed":
            return self._read(stored)
        return (dequantize_kept_first(stored, self.columns) if form == "kept_first" else dequantize(stored)), None


NATIVE_RING = C4Format()  # a layer that packs nothing: native records, a natural-order ring


@dataclass
class FoldedWeights:
    """A kernel-mode CSA layer's wq_b and wo with the packed decode kernel's kept-first
    column order (KeptColumns.order) folded into the projections, per head.

    q = rope(rms_norm(q_lora @ wq_b)) comes out as natural q in kept-first order, up to
    float summation order: the per-head rms_norm does not depend on column order (its sum
    runs in another order) and RoPE acts on columns 448..511, which the order leaves in
    place. Likewise o (kept-first) @ wo is natural o @ natural wo. The decode kernel then takes q and gives out in its own order
    (columns="kept_first") instead of permuting both around the call (NOTES.md, "Third
    round", in benchmarks/kernels, has what that saves).
    """

    wq_b: torch.Tensor  # [q_lora_rank, H * 512], output columns in kept-first order per head
    wo: torch.Tensor  # [H * 512, hidden], input rows in kept-first order per head
    order: torch.Tensor  # int64 [512]: kept_first = natural[..., order]
    inverse: torch.Tensor  # int64 [512]: natural = kept_first[..., inverse]

    @classmethod
    def of(cls, layer: "Layer", columns: KeptColumns) -> "FoldedWeights":
        """Folded copies of `layer`'s wq_b and wo (the layer's own weights are left natural)."""
        order, inverse = columns.order.long(), columns.inverse.long()
        r, width = layer.wq_b.shape
        heads = width // HEAD_DIM
        wq_b = layer.wq_b.view(r, heads, HEAD_DIM)[:, :, order].reshape(r, width)
        wo = layer.wo.view(heads, HEAD_DIM, -1)[:, order, :].reshape(width, -1)
        return cls(wq_b, wo, order, inverse)


#: Layers built side by side (Model's thread pool) that draw their routed experts on a CUDA
#: device draw and quantize at most two at a time: a V4-sized layer's float32 experts and the
#: quantizer's temporaries take ~7 GiB, and sixteen at once ran an 80 GB H100 out of memory
#: at load (2026-12-05) beside 47 GB of finished weights.
_CUDA_EXPERT_DRAWS = threading.BoundedSemaphore(2)


class Layer:
    """Weights of one decoder layer: attention, then a routed MoE (remnant.engine.moe) or a
    dense SwiGLU.

    wo is the output projection's first matrix, rows per head [H * 512, X]: X = hidden
    (one dense wo) or o_lora_rank (V4's grouped low-rank projection: group g's heads ->
    o_lora_rank through wo's rows of those heads, then the groups' concatenation through
    wo_b [o_groups * o_lora_rank, hidden])."""

    def __init__(self, args: ModelArgs, ratio: int, gen: torch.Generator, device: torch.device = torch.device("cpu")):
        """Weights from `gen` (a CPU generator): every device gets the same ones, but for the
        routed experts, which a CUDA `device` draws there, seeded from `gen` (a V4-sized MoE
        in seconds, not minutes on the CPU)."""
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
        self.wo_b = None
        if args.o_lora_rank:
            # Scaled to a group's fan-in (H * 512 / o_groups rows), and per head as the dense wo.
            self.wo = w(H * HEAD_DIM, args.o_lora_rank) * math.sqrt(args.o_groups / H)
            self.wo_b = w(args.o_groups * args.o_lora_rank, h)
        else:
            self.wo = w(H * HEAD_DIM, h) / math.sqrt(H)
        self.ffn_norm = torch.ones(h)
        self.moe = None
        if args.n_routed_experts:
            from remnant.engine.moe import MoE

            experts_gen, draws = gen, contextlib.nullcontext()
            if device.type == "cuda":
                seed = int(torch.randint(0, 2**62, (1,), generator=gen))
                experts_gen, draws = torch.Generator(device).manual_seed(seed), _CUDA_EXPERT_DRAWS
            with draws:  # drawn and quantized at once: the float32 experts live only here
                self.moe = MoE(hidden_size=h, moe_intermediate_size=args.moe_intermediate_size,
                               n_routed_experts=args.n_routed_experts, num_experts_per_tok=args.num_experts_per_tok,
                               n_shared_experts=args.n_shared_experts, expert_dtype=args.expert_dtype,
                               generator=experts_gen).quantize()
        else:
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

    def to(self, device: torch.device, dtype: torch.dtype = torch.float32) -> "Layer":
        """Move every weight to `device` in `dtype` (in place); the attention sinks stay
        float32 (a softmax logit)."""
        for name, value in list(vars(self).items()):
            if isinstance(value, torch.Tensor) and name != "w_in":  # w_in is made again from its parts
                setattr(self, name, value.to(device, torch.float32 if name == "sink" else dtype))
        if self.moe is not None:
            self.moe.to(device, dtype)
        self._merge_inputs()
        return self

    #: The projections of a layer's normed input x, in w_in's column order (those the
    #: layer has: compressor and indexer ones on compressed layers).
    INPUTS = ("wq_a", "wkv", "wc", "wg", "wi_k", "wi_w")

    def _merge_inputs(self) -> None:
        """One matrix w_in [hidden, sum of widths] for every projection of x (INPUTS), and
        each of them a view of its columns: a step reads x once and launches one matrix
        product where it would launch six (at batch 1 each is a few microseconds of launch
        and a partial wave for a few megabytes), as SGLang fuses V4's q_a and kv_a."""
        names = [n for n in self.INPUTS if getattr(self, n, None) is not None]
        self.w_in = torch.cat([getattr(self, n) for n in names], dim=1)
        #: The projections w_in holds, in its column order, and their widths.
        self.input_names = names
        self.input_widths = [getattr(self, n).shape[1] for n in names]
        for name, view in zip(names, self.w_in.split(self.input_widths, dim=1)):
            setattr(self, name, view)


class Model:
    """Random seeded weights for `args` on `device`; forward helpers used by the engine.

    device: cpu or cuda (see resolve_device). decode_path: how single-token chunks run:
    reference (the per-sequence torch path), batched or kernels (remnant.engine.decode_step,
    attention in torch or through remnant.kernels), auto (kernels on cuda, batched on cpu).
    native_decode: which kernel those chunks run over native records (resolve_native_decode).
    dtype: the compute dtype (resolve_dtype). cuda_graph: decode steps on cuda replay CUDA
    graphs (remnant.engine.graphs) of batches up to cuda_graph_max_bs. torch_compile: on cuda,
    the elementwise chains run compiled (remnant.engine.step_ops; not on decode_path=reference,
    the ground truth). index_key_format: how the indexer's keys are stored, "fp8" (SGLang's
    default) or "mxfp4" (its --enable-deepseek-v4-fp4-indexer; remnant.kv.index_keys).
    """

    def __init__(self, args: ModelArgs, c4_formats: dict[int, C4Format] | None = None,
                 device: str = "cpu", decode_path: str = "auto", native_decode: str = "auto",
                 dtype: str = "auto", cuda_graph: bool = True, cuda_graph_max_bs: int = 128,
                 torch_compile: bool = True, index_key_format: str = "fp8"):
        for i, r in enumerate(args.compress_ratios):
            if r not in (0, CSA_RATIO, HCA_RATIO):
                raise ValueError(f"compress_ratios[{i}]={r}; allowed: 0, {CSA_RATIO}, {HCA_RATIO}")
        self.args = args
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.decode_path = resolve_decode_path(decode_path, self.device)
        #: Prefill chunks run as one batched step (remnant.engine.prefill_step) on every path
        #: but the reference. False sends them through the per-sequence reference (_extend):
        #: tests of the decode step set it, so that both sides decode from the same KV.
        self.batched_prefill = self.decode_path != "reference"
        #: "flashmla", "triton" or "reference", and why not FlashMLA (None when it runs).
        self.native_decode, self.native_decode_reason = resolve_native_decode(
            native_decode, self.device, self.decode_path, args.num_attention_heads)
        self.csa_layers = [i for i, r in enumerate(args.compress_ratios) if r == CSA_RATIO]
        #: The indexer keys' stored form (the pools' indexer pages hold it).
        self.index_key_format = IndexKeyFormat(index_key_format, args.index_head_dim)
        #: The elementwise chains' functions: compiled on cuda (remnant.engine.step_ops).
        self.ops = PLAIN_OPS
        if torch_compile and self.device.type == "cuda" and self.decode_path != "reference":
            self.ops = compiled_ops()
        #: layer -> list of query tensors [T, H, 512] while calibrating (None otherwise)
        self.capture: dict[int, list[torch.Tensor]] | None = None
        #: A capture server's remnant.calibration.capture_recorder.CaptureRecorder: CSA layers hand it
        #: their decode queries (natural order, after RoPE) and C4 latents (before FP8).
        self.recorder = None
        #: The indexer scores' launch (remnant.kernels.indexer.ScoresConfig; None:
        #: default_scores_config): the decode step's, and its fp8_q for prefill's shared
        #: scores too. The engine bench's --index-fp8-queries sets fp8_q.
        self.index_scores_config = None
        #: The engine bench's remnant.engine.prefill_reads.PrefillReads while it counts what
        #: prefill steps attend (None otherwise: counting reads sizes back to the host).
        self.prefill_reads = None
        # Generated on the CPU from the seed, then moved: every device holds the same weights.
        gen = torch.Generator().manual_seed(args.seed)
        dt = self.dtype
        self.embed = torch.randn(args.vocab_size, args.hidden_size, generator=gen).to(self.device, dt)
        # Each layer from its own generator, seeded from the model's, so that layers draw side
        # by side (randn releases the GIL): one thread took 32 s for a V4-sized model's 12 GB
        # of attention weights, each server start on the GPU.
        seeds = torch.randint(0, 2**62, (len(args.compress_ratios),), generator=gen).tolist()

        def layer(i: int) -> Layer:
            own = torch.Generator().manual_seed(seeds[i])
            return Layer(args, args.compress_ratios[i], own, self.device).to(self.device, dt)

        with ThreadPoolExecutor(max_workers=max(1, min(len(seeds), os.cpu_count() or 1, 16))) as pool:
            self.layers = list(pool.map(layer, range(len(seeds))))
        self.norm = torch.ones(args.hidden_size, device=self.device, dtype=dt)
        #: The per-head RMS norm of q has no weight: ones, made once.
        self.head_norm = torch.ones(HEAD_DIM, device=self.device, dtype=dt)
        self.lm_head = (torch.randn(args.hidden_size, args.vocab_size, generator=gen) / math.sqrt(
            args.hidden_size
        )).to(self.device, dt)
        self.scale = 1.0 / math.sqrt(HEAD_DIM)
        #: All 512 columns as the kernels read native records, built once.
        self.native_columns = KeptColumns.of(None, self.device)
        #: remnant.engine.graphs.DecodeGraphs where decode steps replay CUDA graphs, else None.
        self.graphs = None
        #: HCA and window-only layers' formats where they pack a part (set_other_formats),
        #: and the retention map they came from (remnant.engine.retention_setup; for
        #: /server_info).
        self.other_formats: dict[int, C4Format] = {}
        self.other_map = None
        #: layer -> window latents [T, 512] of HCA and window-only layers while calibrating.
        self.capture_windows: dict[int, list[torch.Tensor]] | None = None
        # After the layers: folded weights are made from them.
        self.set_c4_formats(c4_formats if c4_formats is not None else {i: C4Format() for i in self.csa_layers})
        if cuda_graph and self.device.type == "cuda" and self.decode_path != "reference":
            from remnant.engine.graphs import DecodeGraphs

            self.graphs = DecodeGraphs(self, cuda_graph_max_bs)

    def set_c4_formats(self, formats: dict[int, C4Format]) -> None:
        """One format per CSA layer (new sequences only: stored records, window rings and
        prefix-cache window checkpoints keep the format they were written in). The only
        way to change c4_formats: it also rebuilds folded_weights."""
        if sorted(formats) != self.csa_layers:
            raise ValueError(f"C4 formats given for layers {sorted(formats)}; the model's CSA layers are {self.csa_layers}")
        self.c4_formats = {i: f.to(self.device) for i, f in formats.items()}
        packed = [f for f in self.c4_formats.values() if f.rules.direct_decode and f.columns.packed]
        #: The kernel of kernel mode's packed decode steps, and why not the SM90 kernel
        #: (None, None without packed kernel-mode layers).
        self.packed_decode, self.packed_decode_reason = resolve_packed_decode(
            self.device, self.decode_path, self.args.num_attention_heads,
            packed[0].columns.n_kept if packed else None, self.dtype,
            packed[0].window_form if packed else "kept_first")
        #: Kernel-mode CSA layer -> its FoldedWeights, on the kernels decode path only: the
        #: reference path reads natural q and would gain nothing.
        self.folded_weights = {i: FoldedWeights.of(self.layers[i], f.columns) for i, f in self.c4_formats.items()
                               if f.rules.direct_decode and self.decode_path == "kernels"}
        if self.graphs is not None:
            self.graphs.clear()  # captured steps bake in the old formats' kernels and weights

    def set_other_formats(self, formats: dict[int, C4Format]) -> None:
        """Formats of HCA and window-only layers that pack their window or C128 records
        (retention.window_records=packed, retention.c128_records=packed; the others store
        native ones). New sequences only, as set_c4_formats."""
        csa = [i for i in formats if i in self.csa_layers or not 0 <= i < len(self.layers)]
        if csa:
            raise ValueError(f"other formats are for HCA and window-only layers; layers {csa} are CSA layers or "
                             f"none of the model's {len(self.layers)}")
        self.other_formats = {i: f.to(self.device) for i, f in formats.items()}
        self.other_map = None
        if self.graphs is not None:
            self.graphs.clear()

    # Per-token projections, batched over any token set ------------------------------

    def project(self, layer: Layer, x: torch.Tensor) -> "Projections":
        """x [T, hidden] normed through every input projection of `layer` at once (w_in)."""
        parts = dict(zip(layer.input_names, (x @ layer.w_in).split(layer.input_widths, dim=-1)))
        return Projections(*(parts.get(n) for n in Layer.INPUTS))

    def queries(self, layer: Layer, p: "Projections", pos: torch.Tensor, folded: FoldedWeights | None = None):
        """The layer's projections `p` of T tokens -> q [T, H, 512] with RoPE (kept-first
        with `folded`'s wq_b), and q_lora [T, q_lora_rank]."""
        a = self.args
        ops = self.ops
        q_lora = ops.rms_norm(p.q_a, layer.q_norm, a.rms_norm_eps)
        wq_b = layer.wq_b if folded is None else folded.wq_b
        q = (q_lora @ wq_b).view(-1, a.num_attention_heads, HEAD_DIM)
        return ops.norm_rope(q, self.head_norm, a.rms_norm_eps, pos, a.rope_theta), q_lora

    def window_latents(self, layer: Layer, p: "Projections", pos: torch.Tensor) -> torch.Tensor:
        """The layer's projections `p` of T tokens -> their K=V latents [T, 512] with RoPE
        (the window ring holds them quantized: native records)."""
        return self.ops.norm_rope(p.kv, layer.kv_norm, self.args.rms_norm_eps, pos, self.args.rope_theta)

    def ffn(self, layer: Layer, h: torch.Tensor) -> torch.Tensor:
        """h [T, hidden] + the layer's feed-forward block (routed MoE or dense SwiGLU)."""
        x = self.ops.rms_norm(h, layer.ffn_norm, self.args.rms_norm_eps)
        if layer.moe is not None:
            return layer.moe.forward(x, route=self.ops.moe_route, align_pairs=self.ops.moe_align, residual=h,
                                     activation=self.ops.silu_mul)
        return h + (F.silu(x @ layer.w_gate) * (x @ layer.w_up)) @ layer.w_down

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(h, self.norm, self.args.rms_norm_eps) @ self.lm_head

    def compress(
        self, layer: Layer, c: torch.Tensor, g: torch.Tensor, block_index: torch.Tensor
    ) -> torch.Tensor:
        """Compress blocks of `ratio` tokens into record latents.

        c, g: [n_blocks, ratio, 512] content and gate logits of complete blocks.
        block_index: [n_blocks] index of each block in the sequence (for RoPE).
        Returns float32 [n_blocks, 512] with RoPE (stored quantized: native records).
        """
        return self.ops.compress_latents(c, g, layer.gate_bias, layer.kv_norm, block_index, layer.ratio,
                                         self.args.rms_norm_eps, self.args.compress_rope_theta)

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
        dtype, q = q.dtype, q.float()  # scores and softmax in float32
        logits, parts = [], []
        for (k, cols), m in zip(key_sets, masks):
            if k.shape[0] == 0:
                continue
            k = k.float()
            qk = q if cols is None else q[..., cols]
            s = torch.einsum("thd,sd->hts", qk, k) * self.scale
            logits.append(s.masked_fill(~m[None], float("-inf")))
            parts.append((k, cols))
        T, H = q.shape[0], q.shape[1]
        sink = layer.sink[:, None, None].expand(H, T, 1)
        p = torch.softmax(torch.cat([sink, *logits], dim=-1), dim=-1)[..., 1:]  # the sink gives no value
        out = torch.zeros(T, H, HEAD_DIM, dtype=q.dtype, device=q.device)
        start = 0
        for k, cols in parts:
            o = torch.einsum("hts,sd->thd", p[..., start : start + k.shape[0]], k)
            start += k.shape[0]
            if cols is None:
                out += o
            else:
                out[..., cols] += o
        return out.to(dtype)

    def output(self, layer: Layer, h: torch.Tensor, o: torch.Tensor, folded: FoldedWeights | None = None) -> torch.Tensor:
        """h [T, hidden] + o [T, H, 512] (kept-first with `folded`) through the output
        projection (Layer's docstring)."""
        wo = layer.wo if folded is None else folded.wo
        o = o.reshape(o.shape[0], -1)
        # h + (o @ w), not torch.addmm: at batch 1 cuBLAS copies h into its output first
        # (memcpy32_post), as many launches as the add (H100, 2026-12-07,
        # benchmarks/engine-h100-routed-apart/).
        if layer.wo_b is None:
            return h + o @ wo
        groups = self.args.o_groups
        low = torch.einsum("tgk,gkr->tgr", o.view(o.shape[0], groups, -1), wo.view(groups, -1, wo.shape[1]))
        return h + low.reshape(o.shape[0], -1) @ layer.wo_b

    # Indexer (CSA layers) -------------------------------------------------------------

    def quantize_index_keys(self, keys: torch.Tensor) -> torch.Tensor:
        """Index keys float [k, d] -> as the indexer pages store them (index_key_format),
        through the step ops (compiled on cuda)."""
        if self.index_key_format.name == "fp8":
            return self.ops.quantize_index_keys(keys)
        return self.ops.quantize_index_keys_mxfp4(keys)

    def index_scores(
        self, layer: Layer, iw: torch.Tensor, q_lora: torch.Tensor, keys: torch.Tensor
    ) -> torch.Tensor:
        """Indexer scores float32 [T, n_records]: sum_h w_h relu(q_h . k_j); keys float [n, d];
        iw: the tokens' head-weight projection (Projections.iw)."""
        a = self.args
        qi = (q_lora @ layer.wi_q).view(-1, a.index_n_heads, a.index_head_dim).float()
        wi = iw.float() * self.index_weight_scale
        return torch.einsum("th,thj->tj", wi, torch.relu(torch.einsum("thd,jd->thj", qi, keys.float())))

    def index_queries(self, layer: Layer, iw: torch.Tensor, q_lora: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The indexer's queries [T, heads, d] (compute dtype) and head weights float32 [T,
        heads] of T tokens (index_scores' q and w): iw times index_weight_scale."""
        return self.index_q(layer, q_lora), iw.float() * self.index_weight_scale

    def index_q(self, layer: Layer, q_lora: torch.Tensor) -> torch.Tensor:
        """The indexer's queries [T, heads, d] (compute dtype) of T tokens."""
        return (q_lora @ layer.wi_q).view(-1, self.args.index_n_heads, self.args.index_head_dim)

    @property
    def index_weight_scale(self) -> float:
        """What the indexer's head weights are multiplied by in float32: 1 / sqrt(heads) (a
        product, as CUDA's torch makes a division by a constant, so that every device and
        the indexer kernel (its w_scale) give the same weights)."""
        return 1.0 / math.sqrt(self.args.index_n_heads)

    def index_scores_batched(self, layer: Layer, iw: torch.Tensor, q_lora: torch.Tensor,
                             keys: torch.Tensor) -> torch.Tensor:
        """index_scores for B tokens, each over its own keys [B, n, d]: float32 [B, n]. The
        product runs in the keys' dtype (the compute dtype), accumulated in float32
        (remnant.kernels.indexer reads the FP8 keys in place instead, on the kernels path)."""
        qi, wi = self.index_queries(layer, iw, q_lora)
        qi = qi.to(keys.dtype)
        logits = torch.relu(torch.bmm(qi, keys.transpose(1, 2)).float())  # [B, heads, n]
        return torch.einsum("bh,bhn->bn", wi, logits)

    # One engine step: extend several sequences by their new tokens ------------------

    def forward(self, seqs: list, chunks: list[list[int]], pools) -> torch.Tensor:
        """Extend each sequence by its chunk of new tokens (prefill chunks and decodes mixed).

        seqs: remnant.engine.sequence.Sequence each, whose pages, SWA block and state slot
        in `pools` (remnant.engine.pools.KVPools, on the model's device) receive the new KV;
        updated in place. chunks: new token ids per sequence (non-empty). Single-token
        chunks run as one batched decode step (remnant.engine.decode_step, replayed from a
        CUDA graph where the model has them, eagerly while a capture records), the longer
        ones as one batched prefill step (remnant.engine.prefill_step), unless
        decode_path=reference or a calibration collects queries: then every chunk goes
        through the per-sequence torch reference (_extend).
        Returns float32 [B, vocab] logits at the last new token of each sequence (on the
        model's device).

        chunks may instead be a decode step's tokens as an int64 [B] tensor on the model's
        device, not yet read by the host (remnant.engine.engine launches a step ahead of
        reading the last): each sequence's token_ids then gets UNREAD_TOKEN in its token's
        place, for the caller to fill in once read.
        """
        if isinstance(chunks, torch.Tensor):
            if self.decode_path != "reference" and self.capture is None:
                return self.decode(seqs, chunks, pools)
            chunks = [[t] for t in chunks.tolist()]  # the per-sequence paths take host tokens
        step = [i for i, c in enumerate(chunks) if len(c) == 1]
        rest = [i for i in range(len(chunks)) if i not in set(step)]
        if not step or not rest:
            return self._batched_or_reference(seqs, chunks, pools)
        # Apart on every path, so that the reference projects a decode token in a batch of the
        # same shape as the batched step does (the same float rounding, which FP8 records
        # would amplify): the two paths then differ only where attention does.
        logits = torch.empty(len(seqs), self.args.vocab_size, device=self.device)
        logits[rest] = self._batched_or_reference([seqs[i] for i in rest], [chunks[i] for i in rest], pools)
        logits[step] = self._batched_or_reference([seqs[i] for i in step], [chunks[i] for i in step], pools)
        return logits

    def _batched_or_reference(self, seqs: list, chunks: list[list[int]], pools) -> torch.Tensor:
        """Chunks all of one token (a decode step) or all prefill chunks through their
        batched step where it runs, else through _extend."""
        if self.decode_path == "reference" or self.capture is not None:
            return self._extend(seqs, chunks, pools)
        if all(len(c) == 1 for c in chunks):
            return self.decode(seqs, [c[0] for c in chunks], pools)
        if not self.batched_prefill:
            return self._extend(seqs, chunks, pools)
        return self.prefill(seqs, chunks, pools)

    def decode(self, seqs: list, tokens: "list[int] | torch.Tensor", pools) -> torch.Tensor:
        """One batched decode step: each sequence extended by its token (host ints, or an
        int64 [B] tensor on the device: see forward); float32 [B, vocab]."""
        from remnant.engine.decode_step import DecodeBatch, decode_step

        if self.graphs is not None and self.recorder is None:  # a capture's host copies stay out of graphs
            logits = self.graphs.run(seqs, tokens, pools)
        else:
            batch = DecodeBatch.of(seqs, tokens, pools, self.device)
            logits = decode_step(self, pools, batch, self.attention)
        for seq, token in zip(seqs, [UNREAD_TOKEN] * len(seqs) if isinstance(tokens, torch.Tensor) else tokens):
            seq.length += 1
            seq.token_ids.append(token)
        return logits

    def prefill(self, seqs: list, chunks: list[list[int]], pools) -> torch.Tensor:
        """One batched prefill step: each sequence extended by its chunk; float32 [N, vocab]
        at each chunk's last token."""
        from remnant.engine.prefill_step import PrefillPlan, prefill_step

        ratios = {r for r in self.args.compress_ratios if r}
        plan = PrefillPlan.of(seqs, chunks, pools, self.args.window_size, ratios, self.device)
        logits = prefill_step(self, pools, plan, self.attention)
        for seq, chunk in zip(seqs, chunks):
            seq.length += len(chunk)
            seq.token_ids.extend(chunk)
        return logits

    @property
    def attention(self) -> str:
        """How the batched decode step attends: "kernels" (remnant.kernels) or "torch"."""
        return "kernels" if self.decode_path == "kernels" else "torch"

    def _extend(self, seqs: list, chunks: list[list[int]], pools) -> torch.Tensor:
        """The per-sequence torch path: every chunk through _attend_sequence, layer by layer;
        float32 [B, vocab] logits at each chunk's last token."""
        sizes = [len(c) for c in chunks]
        starts = [0, *itertools.accumulate(sizes)]
        ids = torch.tensor([t for c in chunks for t in c], dtype=torch.long, device=self.device)
        pos = torch.cat([torch.arange(q.length, q.length + n, dtype=torch.long) for q, n in zip(seqs, sizes)])
        pos = pos.to(self.device)
        h = self.embed[ids]
        for li, layer in enumerate(self.layers):
            x = self.ops.rms_norm(h, layer.attn_norm, self.args.rms_norm_eps)
            folded = self.folded_weights.get(li)
            p = self.project(layer, x)
            q, q_lora = self.queries(layer, p, pos, folded)
            kv = self.window_latents(layer, p, pos)
            parts = (p.iw, q, q_lora, kv, pos, p.c, p.g, p.ik)
            steps = [_Step(*(None if t is None else t[a:b] for t in parts)) for a, b in zip(starts, starts[1:])]
            o = torch.cat([self._attend_sequence(li, layer, seq, pools, st) for seq, st in zip(seqs, steps)])
            h = self.ffn(layer, self.output(layer, h, o.to(h.dtype), folded))
        for seq, chunk in zip(seqs, chunks):
            seq.length += len(chunk)
            seq.token_ids.extend(chunk)
        last = torch.tensor(starts[1:], device=self.device) - 1
        return self.logits(h[last]).float()

    def _attend_sequence(self, li: int, layer: Layer, seq, pools, st: "_Step") -> torch.Tensor:
        """The torch reference: one sequence's chunk of T tokens attends; returns [T, H, 512]
        in st.q's column order (kept-first on layers with folded_weights)."""
        a = self.args
        length = seq.length
        # Sliding window: the ring holds the previous window - 1 tokens; the chunk's own
        # tokens join from memory, quantized as the ring stores them (the kernels read a
        # decode token's own record from its ring slot), then the last `window` of them go
        # into the ring.
        ring = self.layer_format(li)
        kv = ring.ring_records(st.kv)
        if self.recorder is not None:  # a capture: copies only (remnant.engine.capture_hooks)
            from remnant.engine.capture_hooks import record_tokens

            # Decode steps are one-token chunks (so is a prompt's rare last chunk of one token).
            record_tokens(self, li, layer, st.q, st.iw, st.q_lora, st.kv.float(), decode=st.q.shape[0] == 1)
        if self.capture_windows is not None and li in self.capture_windows:
            # Calibrating an HCA or window-only layer: its queries and window latents.
            self.capture[li].append(st.q.detach().clone())
            self.capture_windows[li].append(st.kv.detach().clone())
        prev_pos = torch.arange(max(0, length - (a.window_size - 1)), length, device=self.device)
        prev = pools.swa.read(li, pools.swa_slots(seq.swa_block, prev_pos))
        window_keys = ring.ring_keys(torch.cat([prev, kv]))
        kpos = torch.cat([prev_pos, st.pos])
        win_mask = (kpos[None, :] <= st.pos[:, None]) & (kpos[None, :] > st.pos[:, None] - a.window_size)
        tail = slice(max(0, kv.shape[0] - a.window_size), None)
        pools.swa.write(li, pools.swa_slots(seq.swa_block, st.pos[tail]), kv[tail])
        key_sets, masks = [window_keys], [win_mask]

        selected = self._select_records(li, layer, seq, pools, st)
        if selected is not None:
            used, mask = selected
            # Only the selected records are read back from their stored bytes.
            stored = _record_pages(li, layer, pools).read(seq.page_tensor(self.device), used)
            key_sets.append(self.layer_format(li).read(stored))
            masks.append(mask)
        # The reference attends in natural column order (key sets are natural records).
        o = self.attend(layer, self.natural_q(li, st.q), key_sets, masks)
        folded = self.folded_weights.get(li)
        return o if folded is None else o[..., folded.order]

    def natural_q(self, li: int, q: torch.Tensor) -> torch.Tensor:
        """q [..., 512] of layer li in the model's natural column order (it is kept-first on
        layers with folded_weights)."""
        folded = self.folded_weights.get(li)
        return q if folded is None else q[..., folded.inverse]

    def _select_records(self, li: int, layer: Layer, seq, pools,
                        st: "_Step") -> tuple[torch.Tensor, torch.Tensor] | None:
        """Close the blocks this chunk completes into records, then choose what each new
        token reads: on CSA layers the indexer's top-k of its visible records, on HCA layers
        every visible record.

        Returns (records, mask): the sequence's record indices any new token reads, int64
        [k], and which token reads which, bool [T, k]; None on window-only layers and while
        no token sees a record.
        """
        if not layer.ratio:
            return None
        n = self._compress_new_blocks(li, layer, seq, pools, st)
        if self.capture is not None and layer.ratio == CSA_RATIO and li in self.capture:
            self.capture[li].append(self.natural_q(li, st.q).detach().clone())  # policies read natural q
        if not n:
            return None
        rec_end = (torch.arange(n, device=self.device) + 1) * layer.ratio - 1
        visible = rec_end[None, :] <= st.pos[:, None]  # [T, n]
        if layer.ratio == CSA_RATIO:
            pages = seq.page_tensor(self.device)
            index_keys = self.index_key_format.dequantize(pools.indexer[li].read(pages, torch.arange(n, device=self.device)))
            scores = self.index_scores(layer, st.iw, st.q_lora, index_keys)
            scores = scores.masked_fill(~visible, float("-inf"))
            top = self.ops.index_top_k(scores, min(self.args.index_topk, n))[1]
            chosen = torch.zeros_like(visible).scatter_(1, top, True) & visible
        else:
            chosen = visible
        used = chosen.any(0).nonzero().squeeze(1)
        return (used, chosen[:, used]) if used.numel() else None

    def _compress_new_blocks(self, li: int, layer: Layer, seq, pools, st: "_Step") -> int:
        """Close the blocks this chunk completes into records; returns the record count."""
        r = layer.ratio
        length = seq.length
        state = pools.c4_state[li] if r == CSA_RATIO else pools.c128_state[li]
        open_rows = pools.state_rows(r, seq.slot, length % r)
        # Every token enters the compressor as its state holds it (the pools' state dtype:
        # float32, or bfloat16 with compressor_state_dtype), computed on in float32.
        sd = state.dtype
        pc = torch.cat([state[open_rows, 0, :HEAD_DIM], st.c.to(sd)]).float()
        pg = torch.cat([state[open_rows, 1, :HEAD_DIM], st.g.to(sd)]).float()
        pik = None
        if r == CSA_RATIO:
            d = self.args.index_head_dim
            pik = torch.cat([pools.c4_index_state[li][open_rows, 0, :d], st.ik.to(sd)]).float()
        full = pc.shape[0] // r
        first = length // r
        if full:
            pages = seq.page_tensor(self.device)
            index = torch.arange(first, first + full, device=self.device)
            latents = self.compress(layer, pc[: full * r].view(full, r, -1), pg[: full * r].view(full, r, -1), index)
            if self.recorder is not None:  # a capture: copies only
                from remnant.engine.capture_hooks import record_blocks

                record_blocks(self, li, layer, pc[: full * r].view(full, r, -1), pg[: full * r].view(full, r, -1),
                              index, latents, sd, None if pik is None else pik[: full * r].view(full, r, -1))
            self._write_records(li, layer, pools, pages, index, latents)
            if r == CSA_RATIO:
                keys = pik[: full * r].view(full, r, -1).mean(1)
                pools.indexer[li].write(pages, index, self.quantize_index_keys(keys))
        left = pc.shape[0] - full * r
        rows = pools.state_rows(r, seq.slot, left)
        state[rows, 0, :HEAD_DIM] = pc[full * r :].to(sd)
        state[rows, 1, :HEAD_DIM] = pg[full * r :].to(sd)
        if pik is not None:
            pools.c4_index_state[li][rows, 0, : pik.shape[1]] = pik[full * r :].to(sd)
        return first + full

    def _write_records(self, li: int, layer: Layer, pools, pages: torch.Tensor, index: torch.Tensor,
                       latents: torch.Tensor) -> None:
        """Store the records of blocks `index` [k] from their latents float32 [k, 512] in the
        layer's format (packed at the KV write where it packs them), through
        remnant.kernels.dispatch.store (the Triton store on CUDA, its torch reference
        elsewhere: the module docstring says why not the interpreter's)."""
        target = _record_pages(li, layer, pools)
        store(latents.float(), target.buf, target.layout, target.locations(pages, index),
              self.layer_format(li).record_columns)

    def layer_format(self, li: int) -> C4Format:
        """How layer li stores and reads its window ring and compressed records: its C4
        format (CSA layers), its format of other_formats (HCA and window-only layers that
        pack a part), else native records and a natural ring."""
        return self.c4_formats.get(li) or self.other_formats.get(li, NATIVE_RING)


def _record_pages(li: int, layer: Layer, pools):
    """The pages holding layer li's compressed records: C4 on CSA layers, C128 on HCA."""
    return pools.c4[li] if layer.ratio == CSA_RATIO else pools.c128[li]


@dataclass
class Projections:
    """A layer's input projections of T tokens' normed x (Model.project): one matrix product,
    split. None where the layer has no such projection."""

    q_a: torch.Tensor  # [T, q_lora_rank] before q's low-rank norm
    kv: torch.Tensor  # [T, 512] before the K=V norm and RoPE
    c: torch.Tensor | None  # [T, 512] compressor content (compressed layers)
    g: torch.Tensor | None  # [T, 512] compressor gate logits (compressed layers)
    ik: torch.Tensor | None  # [T, index_head_dim] indexer key contributions (CSA layers)
    iw: torch.Tensor | None  # [T, index_n_heads] indexer head weights, before scaling (CSA layers)


@dataclass
class _Step:
    """One sequence's slice of a batched step, per layer (T new tokens)."""

    iw: torch.Tensor | None  # [T, index_n_heads] the indexer's head-weight projection (CSA layers)
    q: torch.Tensor  # [T, H, 512], kept-first on layers with folded_weights
    q_lora: torch.Tensor  # [T, q_lora_rank]
    kv: torch.Tensor  # float32 [T, 512] window latents of the new tokens (RoPE applied)
    pos: torch.Tensor  # [T] positions
    c: torch.Tensor | None  # [T, 512] compressor content
    g: torch.Tensor | None  # [T, 512] compressor gate logits
    ik: torch.Tensor | None  # [T, index_head_dim] indexer key parts
