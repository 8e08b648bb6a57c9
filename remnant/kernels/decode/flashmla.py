"""FlashMLA's sparse FP8 decode (PyPI `sgl-flash-mla`, the "V4" KV format) over Remnant's pages.

SGLang serves DeepSeek-V4's native attention with this kernel: native and triton modes run
it there, so it is the stock decode every Remnant decode figure is measured against, and
the embedded engine runs it on CUDA for native records (remnant.engine.model). The
package is optional (`pip install --no-deps sgl-flash-mla==1.0.0`; its metadata asks for
torch >= 2.14.1 but its abi3 build loads on 2.11) and imported only on CUDA.

Records: the 584-byte native record in SGLang's split page layout (per page, the 576-byte
data parts, then the 8-byte scale tails; the page stride padded to a multiple of 576), as
remnant.kv.layout.PageLayout.sglang describes it. FlashMLA takes such a pool as a view
[pages, per_page, 1, 584] whose stride(0) is the page stride (kv_view) and a record's
index as page * per_page + slot: Remnant's flat location. As SGLang calls it, the window
is the main cache and the C4 (or C128) records the extra one; indices are int32, -1 for
none, padded to a multiple of 64 entries.

Plain reference of the same operation: remnant.kernels.decode.reference.decode_native_reference
(float64). Whether it takes a call is remnant.kernels.decode.plan's rule (choose).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from remnant.kv.formats import HEAD_DIM, NATIVE_RECORD_BYTES, SCALE_BYTES
from remnant.kv.layout import PageLayout

PACKAGE = "sgl-flash-mla"
INSTALL = f"pip install --no-deps {PACKAGE}==1.0.0"
HEADS = (64, 128)
CAPABILITIES = ((9, 0), (10, 0))
# Data parts of SGLang's pages are 576 bytes, and pages are padded to a multiple of them.
PAGE_ALIGN = 576
INDEX_BLOCK = 64  # FlashMLA reads indices in blocks of 64 (SGLang asserts the multiple)
_SCHEDULES_KEPT = 64


def unavailable_reason(device: torch.device, heads: int) -> str | None:
    """Why FlashMLA's V4 decode cannot serve `heads` query heads on `device`; None if it can.

    Imports flash_mla only where the device is an NVIDIA GPU it runs on."""
    if device.type != "cuda":
        return f"FlashMLA runs on CUDA GPUs, not on device={device.type}"
    if torch.version.hip is not None:
        return "FlashMLA's V4 decode is built for NVIDIA GPUs, not ROCm"
    capability = torch.cuda.get_device_capability(device)
    if capability not in CAPABILITIES:
        return (f"FlashMLA's V4 decode runs on SM90 (H100/H200) and SM100 GPUs; this one is "
                f"sm_{capability[0]}{capability[1]}")
    if heads not in HEADS:
        return f"FlashMLA's sparse decode takes 64 or 128 query heads; this model has {heads}"
    try:
        import flash_mla
    except Exception as exc:  # noqa: BLE001 - a broken install is as absent as a missing one
        return f"flash_mla does not import ({type(exc).__name__}: {exc}); install it with `{INSTALL}`"
    if not flash_mla.has_legacy():
        return "this flash_mla build has no legacy SM90 kernels, which hold the V4 KV format"
    return None


def layout_reason(layout: PageLayout) -> str | None:
    """Why FlashMLA cannot read native records laid out as `layout`; None if it can."""
    if layout.record_bytes != NATIVE_RECORD_BYTES or layout.tail_bytes != SCALE_BYTES:
        return f"FlashMLA's V4 format reads native {NATIVE_RECORD_BYTES}-byte records, not {layout.record_bytes}-byte ones"
    if layout.page_stride % PAGE_ALIGN:
        return (f"FlashMLA reads SGLang's split pages (page stride a multiple of {PAGE_ALIGN} bytes), not a page "
                f"stride of {layout.page_stride}")
    return None


def version() -> str | None:
    """The installed flash_mla's version, or None (without importing it)."""
    from importlib import metadata

    try:
        return metadata.version(PACKAGE)
    except metadata.PackageNotFoundError:
        return None


def kv_view(pages: torch.Tensor, layout: PageLayout, name: str) -> torch.Tensor:
    """Native pages uint8 [P, page_stride] as FlashMLA's k_cache [P, per_page, 1, 584].

    FlashMLA finds a record's data part and scale tail from the page base and the V4
    split layout, so only the page stride travels in the view (as SGLang views its pools)."""
    layout.check(pages, name)
    why = layout_reason(layout)
    if why:
        raise ValueError(f"{name}: {why}; use PageLayout.sglang(per_page)")
    return pages.as_strided((pages.shape[0], layout.per_page, 1, NATIVE_RECORD_BYTES),
                            (layout.page_stride, NATIVE_RECORD_BYTES, NATIVE_RECORD_BYTES, 1))


def indices(locs: torch.Tensor) -> torch.Tensor:
    """Locations int [B, K] (-1 = none) as FlashMLA's indices: int32 [B, 1, K'], K' the
    next multiple of 64, padded with -1."""
    pad = -locs.shape[1] % INDEX_BLOCK
    out = locs.to(torch.int32)
    if pad:
        out = F.pad(out, (0, pad), value=-1)
    return out.unsqueeze(1)


class ScheduleCache:
    """Objects made by `make()` per key, at most `kept` of them besides the pinned ones.

    A key used while a CUDA graph is being captured is pinned for good: the graph holds
    the raw addresses of its schedule's tensors, so dropping it (as the oldest key, once
    eager prefills of many token counts had added theirs) freed memory that later
    replays read: an illegal memory access in a served run. Unpinned keys (eager calls'
    shapes: a prefill chunk's token count) are dropped oldest first."""

    def __init__(self, kept: int, make):
        self.kept, self.make = kept, make
        self.items: dict[tuple, object] = {}
        self.pinned: set[tuple] = set()

    def get(self, key: tuple, pin: bool = False):
        if key not in self.items:
            unpinned = [k for k in self.items if k not in self.pinned]
            if len(unpinned) >= self.kept:
                del self.items[unpinned[0]]
            self.items[key] = self.make()
        if pin:
            self.pinned.add(key)
        return self.items[key]


def _new_schedule():
    from flash_mla import get_mla_metadata

    return get_mla_metadata()[0]


_schedules = ScheduleCache(_SCHEDULES_KEPT, _new_schedule)


def _schedule(key: tuple):
    """One FlashMLASchedMeta per call shape. Without topk_length, FlashMLA's split plan
    depends on the shapes alone (its docstring), so a plan is reused across calls of one
    shape, as SGLang reuses one per forward batch; the first call fills it in, outside any
    CUDA graph being captured (the engine and the benchmark warm up before capture). Shapes
    a graph captures stay (ScheduleCache)."""
    return _schedules.get(key, pin=torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def decode(
    q: torch.Tensor,
    c4: torch.Tensor,
    c4_layout: PageLayout,
    c4_locs: torch.Tensor,
    window: torch.Tensor,
    window_layout: PageLayout,
    window_locs: torch.Tensor,
    sink: torch.Tensor,
    scale: float = HEAD_DIM ** -0.5,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sparse decode over native records through FlashMLA, as remnant.kernels.decode.decode
    takes it for native records (keep None).

    q: [B, H, 512] (bf16, or float: cast to bf16, which the kernel reads); c4, window:
    native pages (SGLang's split layout) with c4_locs int [B, K] and window_locs int [B, W]
    (-1 = none; K or W may be 0); sink float [H]. Returns FlashMLA's own output as [B, H,
    512] (bf16; cast to q's dtype where that differs), or copies it into `out` (a pass the
    benchmark leaves out: it times FlashMLA as SGLang calls it).
    """
    from flash_mla import flash_mla_with_kvcache

    if q.ndim != 3 or q.shape[2] != HEAD_DIM:
        raise ValueError(f"q must be [B, H, {HEAD_DIM}], got {tuple(q.shape)}")
    batch, heads, _ = q.shape
    if heads not in HEADS:
        raise ValueError(f"FlashMLA's sparse decode takes 64 or 128 query heads, got {heads}")
    sets = [(kv_view(pages, layout, name), indices(locs))
            for pages, layout, locs, name in ((window, window_layout, window_locs, "window"), (c4, c4_layout, c4_locs, "c4"))
            if locs.shape[1]]
    if not sets:  # nothing to attend: the sink alone, whose value is zero
        return torch.zeros_like(q) if out is None else out.zero_()
    (main, main_idx), extra = sets[0], sets[1] if len(sets) > 1 else (None, None)
    key = (q.device, batch, heads, main.shape[1], main_idx.shape[2],
           None if extra[0] is None else extra[0].shape[1], None if extra[1] is None else extra[1].shape[2])
    o, _ = flash_mla_with_kvcache(
        q=q.to(torch.bfloat16).contiguous().unsqueeze(1), k_cache=main, block_table=None, cache_seqlens=None,
        head_dim_v=HEAD_DIM, tile_scheduler_metadata=_schedule(key), softmax_scale=scale, is_fp8_kvcache=True,
        indices=main_idx, attn_sink=sink.float().contiguous(), extra_k_cache=extra[0],
        extra_indices_in_kvcache=extra[1], use_legacy=True, kv_format="V4")
    o = o.view(batch, heads, HEAD_DIM)
    if out is None:
        return o.to(q.dtype)
    return out.copy_(o)


def run(plan, q: torch.Tensor, c4: torch.Tensor, c4_layout: PageLayout, c4_locs: torch.Tensor, window: torch.Tensor,
        window_layout: PageLayout, window_locs: torch.Tensor, sink: torch.Tensor, keep, scale: float,
        out: torch.Tensor | None, compiled: list | None) -> torch.Tensor:
    """remnant.kernels.decode.decode's call of FlashMLA (no plan: FlashMLA schedules its own
    launch; native records, so no kept columns; no Triton kernel to append to `compiled`):
    `decode`, giving FlashMLA's own output where no `out` is given."""
    return decode(q, c4, c4_layout, c4_locs, window, window_layout, window_locs, sink, scale, out=out)
