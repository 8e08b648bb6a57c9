"""Pool sizing and byte-exact capacity accounting, as SGLang 0.5.18 sizes DeepSeek-V4 pools.

SGLang's DSV4PoolConfigurator (model_executor/pool_configurator.py) turns a byte budget
into a number of "full" tokens F with a per-token cost (bytes_per_full_token, below) after
taking out a fixed per-request-slot cost (the C128 compressor state). Every pool is sized
from F: the sliding-window (SWA) pool holds swa_ratio * F tokens, the C4 pool F / 4
records per CSA layer, the C128 pool F / 128 records per HCA layer, the C4 indexer pool
F / 4 keys per CSA layer, and the C4 compressor-state pools follow the SWA pool.

Per full token, with L layers, L4 CSA layers, L128 HCA layers, r = swa_ratio, w = window:
    swa            r * 584 * L
    c4             (1/4) * record_bytes * L4          (584 native, R + 72 packed)
    c128           (1/128) * 584 * L128
    c4_indexer     (1/4) * (d_idx + 4 * d_idx / 128) * L4             (132 B at d_idx 128)
    c4_state       r * (ring4 / w) * (2 * 2 * 512 * 4) * L4           (ring4 = 8, fp32)
    c4_idx_state   r * (ring4 / w) * (2 * 2 * d_idx * 4) * L4
Fixed: c128_state = rows * (2 * 512 * 4) * L128 with rows = ceil((slots * 128 + 129) / 128) * 128
and slots = max_running_requests + 1.

Sized as SGLang does when --max-running-requests is given (the embedded engine always
gives it). Without it SGLang estimates at least 2048 request slots for the fixed C128
state (and divides by the attention DP size); that path is not modelled here.

Packing changes only the c4 term, so the token-capacity ratio packed/native is
bpt_native / bpt_packed, independent of the budget (up to page rounding and the fixed
state). At V4-Flash attention dimensions this is 1.2113 at R = 256.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from remnant.kv.formats import CSA_RATIO, HCA_RATIO, HEAD_DIM, NATIVE_RECORD_BYTES, NOPE_DIM, ROPE_DIM

# SGLang 0.5.18 defaults for DeepSeek-V4 (arg_groups/overrides.py, deepseek_v4_memory_pool.py).
DSV4_PAGE_SIZE = 256
DSV4_SWA_RATIO = 0.1
C4_RING = 8
C128_RING = 128
STATE_DTYPE_BYTES = 4  # SGLANG_DSV4_COMPRESS_STATE_DTYPE=float32
INDEXER_QUANT_BLOCK = 128


@dataclass
class PoolGeometry:
    """What pool sizing needs to know of a model and a server.

    c4_record_bytes: stored bytes of one C4 record per CSA layer (584 native, R + 72 packed).
    """

    compress_ratios: list[int]
    c4_record_bytes: list[int]
    window_size: int = 128
    index_head_dim: int = 128
    page_size: int = DSV4_PAGE_SIZE
    swa_ratio: float = DSV4_SWA_RATIO
    max_running_requests: int = 64

    def __post_init__(self) -> None:
        n_c4 = self.n_c4
        if len(self.c4_record_bytes) != n_c4:
            raise ValueError(f"c4_record_bytes has {len(self.c4_record_bytes)} values; the model has {n_c4} CSA layers")
        if self.page_size % HCA_RATIO:  # a page holds whole C128 records
            raise ValueError(f"page_size={self.page_size} must be a multiple of {HCA_RATIO} for compressed attention")
        if self.index_head_dim % INDEXER_QUANT_BLOCK:
            raise ValueError(f"index_head_dim={self.index_head_dim} must be a multiple of {INDEXER_QUANT_BLOCK}")
        if not 0 < self.swa_ratio <= 1:
            raise ValueError(f"swa_ratio={self.swa_ratio} must be in (0, 1]")

    @property
    def n_layers(self) -> int:
        return len(self.compress_ratios)

    @property
    def n_c4(self) -> int:
        return sum(1 for r in self.compress_ratios if r == CSA_RATIO)

    @property
    def n_c128(self) -> int:
        return sum(1 for r in self.compress_ratios if r == HCA_RATIO)

    def indexer_key_bytes(self) -> int:
        """One C4 indexer key: FP8 codes plus one fp32 scale per 128 coordinates (132 B)."""
        return self.index_head_dim + self.index_head_dim // INDEXER_QUANT_BLOCK * 4

    def bytes_per_full_token(self) -> dict[str, float]:
        """Cost of one full token per component, in bytes (SGLang's _get_bytes_per_full_token)."""
        r, ring_frac = self.swa_ratio, C4_RING / self.window_size
        state4 = 2 * 2 * (NOPE_DIM + ROPE_DIM) * STATE_DTYPE_BYTES
        idx_state4 = 2 * 2 * self.index_head_dim * STATE_DTYPE_BYTES
        return {
            "swa": r * NATIVE_RECORD_BYTES * self.n_layers,
            "c4": sum(self.c4_record_bytes) / CSA_RATIO,
            "c128": NATIVE_RECORD_BYTES * self.n_c128 / HCA_RATIO,
            "c4_indexer": self.indexer_key_bytes() * self.n_c4 / CSA_RATIO,
            "c4_state": r * ring_frac * state4 * self.n_c4,
            "c4_indexer_state": r * ring_frac * idx_state4 * self.n_c4,
        }

    def c128_state_fixed_bytes(self) -> int:
        """Fixed C128 compressor state for max_running_requests + 1 request slots."""
        if self.n_c128 == 0:
            return 0
        slots = self.max_running_requests + 1
        rows = math.ceil((slots * C128_RING + C128_RING + 1) / 128) * 128
        return rows * 2 * HEAD_DIM * STATE_DTYPE_BYTES * self.n_c128


@dataclass
class PoolSizes:
    """Pools sized from a budget; token counts are page-aligned as SGLang aligns them."""

    budget_bytes: int
    full_tokens: int
    swa_tokens: int
    c4_records: int
    c128_records: int
    c4_state_slots: int
    bytes_per_full_token: dict[str, float]
    fixed_bytes: dict[str, int]
    used_bytes: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def size_pools(geometry: PoolGeometry, budget_bytes: int) -> PoolSizes:
    """SGLang's calculate_pool_sizes with max_running_requests given."""
    if budget_bytes <= 0:
        raise ValueError(f"budget_bytes={budget_bytes} must be > 0")
    per_token = geometry.bytes_per_full_token()
    bpt = sum(per_token.values())
    fixed = {"c128_state": geometry.c128_state_fixed_bytes()}
    available = max(budget_bytes - sum(fixed.values()), 0)
    full = int(available / bpt) // geometry.page_size * geometry.page_size
    swa = int(full * geometry.swa_ratio) // geometry.page_size * geometry.page_size
    sizes = PoolSizes(
        budget_bytes=budget_bytes,
        full_tokens=full,
        swa_tokens=swa,
        c4_records=full // CSA_RATIO,
        c128_records=full // HCA_RATIO,
        c4_state_slots=swa // geometry.window_size * C4_RING,
        bytes_per_full_token=per_token,
        fixed_bytes=fixed,
    )
    sizes.used_bytes = pool_bytes(geometry, sizes)
    return sizes


def pool_bytes(geometry: PoolGeometry, sizes: PoolSizes) -> dict[str, int]:
    """Bytes each component's pool holds at these sizes (what the engine allocates)."""
    state4 = 2 * 2 * HEAD_DIM * STATE_DTYPE_BYTES
    idx_state4 = 2 * 2 * geometry.index_head_dim * STATE_DTYPE_BYTES
    return {
        "swa": sizes.swa_tokens * NATIVE_RECORD_BYTES * geometry.n_layers,
        "c4": sizes.c4_records * sum(geometry.c4_record_bytes),
        "c128": sizes.c128_records * NATIVE_RECORD_BYTES * geometry.n_c128,
        "c4_indexer": sizes.c4_records * geometry.indexer_key_bytes() * geometry.n_c4,
        "c4_state": sizes.c4_state_slots * state4 * geometry.n_c4,
        "c4_indexer_state": sizes.c4_state_slots * idx_state4 * geometry.n_c4,
        **sizes.fixed_bytes,
    }


def request_capacity(geometry: PoolGeometry, sizes: PoolSizes, request_tokens: int) -> dict:
    """How many requests of `request_tokens` tokens fit at once, and what bounds it.

    A request holds ceil(L / page) full pages and, in the SWA pool, its last window plus
    one page of slack (the window straddles a page boundary); request slots cap both.
    """
    pages = math.ceil(request_tokens / geometry.page_size)
    by_tokens = sizes.full_tokens // (pages * geometry.page_size) if pages else 0
    swa_per_request = min(request_tokens, geometry.window_size) + geometry.window_size
    by_swa = sizes.swa_tokens // swa_per_request
    limits = {"full_tokens": by_tokens, "swa_tokens": by_swa, "request_slots": geometry.max_running_requests}
    bound = min(limits, key=limits.get)
    return {"requests": limits[bound], "bound_by": bound, "limits": limits}
