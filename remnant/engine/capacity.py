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

Capacity beyond C4 (docs/kv.md): every part above has its stored size in PoolGeometry,
each defaulting to what SGLang 0.5.18 stores, so a geometry that names none of them sizes
exactly as before. A Combination names which parts are stored how (packed window, C4 or
C128 records at a retention, MXFP4 indexer keys, bf16 compressor state);
combination_geometry gives the geometry of a model with it. Served today: packed C4
records and, beside them, the CSA layers' window records packed with their maps
(retention.window_records=packed_csa), by the engine and the SGLang plugin; by the engine
only, every layer's window records (retention.window_records=packed) and packed C128
records (retention.c128_records); MXFP4 index keys and bf16 compressor state (the engine's
and the SGLang hosts' host.index_key_format and host.compressor_state_dtype: for SGLang,
its own --enable-deepseek-v4-fp4-indexer, which the plugin sizes at the pool's 68 bytes,
and SGLANG_DSV4_COMPRESS_STATE_DTYPE).
What SGLang 0.5.18 does with each part:
- window (SWA) and C128 records: the same 584-byte pool class as C4
  (mem_cache/deepseek_v4_memory_pool.py, DeepSeekV4SingleKVPool asserts 584); the
  configurator counts one kv_bytes = 584 for all three.
- indexer keys: the configurator always counts d + 4 d / 128 (132 at d = 128), also under
  --enable-deepseek-v4-fp4-indexer (experimental, SM100/SM120 only), whose pool
  (DeepSeekV4IndexerPool.get_bytes_per_token) stores d / 2 + 4 = 68 bytes (E2M1 codes, one
  UE8M0 scale per 32 coordinates): SGLang alone sizes that pool smaller than it budgets
  and leaves the difference unused; the plugin's configurator hook counts the 68 bytes
  (remnant.sglang.sizing), as the formula here does.
- compressor state: SGLANG_DSV4_COMPRESS_STATE_DTYPE (float32 default, or bfloat16) sets
  both the pools' dtype (mem_cache/kv_cache_configurator.py) and the byte size the
  configurator counts (model_executor/pool_configurator.py,
  _get_dsv4_compress_state_dtype_sizes): the C4 and indexer state per token and the fixed
  C128 state alike.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict, dataclass, field

from remnant.kv.formats import (
    CSA_RATIO,
    HCA_RATIO,
    HEAD_DIM,
    INDEX_KEY_FORMATS,
    KERNEL_RETENTION,
    NATIVE_RECORD_BYTES,
    RETENTION_VALUES,
    index_key_parts,
    packed_record_bytes,
)

# SGLang 0.5.18 defaults for DeepSeek-V4 (arg_groups/overrides.py, deepseek_v4_memory_pool.py).
DSV4_PAGE_SIZE = 256
DSV4_SWA_RATIO = 0.1
C4_RING = 8
C128_RING = 128
STATE_DTYPE_BYTES = 4  # SGLANG_DSV4_COMPRESS_STATE_DTYPE=float32
INDEXER_QUANT_BLOCK = 128

#: Compressor state dtypes SGLANG_DSV4_COMPRESS_STATE_DTYPE takes, by their byte size.
STATE_DTYPES = {"float32": 4, "bfloat16": 2}
#: Stored sizes a window (SWA) or C128 record may take: packed at a retention, or native.
RECORD_BYTES = tuple(packed_record_bytes(r) for r in RETENTION_VALUES) + (NATIVE_RECORD_BYTES,)


def index_key_bytes(key_format: str, index_head_dim: int) -> int:
    """Bytes of one C4 indexer key of `index_head_dim` coordinates in `key_format`
    (remnant.kv.formats.index_key_parts): fp8 132 at d = 128, what SGLang's configurator
    counts; mxfp4 68, SGLang's DeepSeekV4IndexerPool with the FP4 indexer."""
    return sum(index_key_parts(key_format, index_head_dim))


@dataclass
class PoolGeometry:
    """What pool sizing needs to know of a model and a server.

    c4_record_bytes: stored bytes of one C4 record per CSA layer (584 native, R + 72 packed).
    The stored size of every other part, each defaulting to what SGLang 0.5.18 stores (so
    a geometry naming none of them sizes as SGLang does; the engine's pools hold every
    part in every size given here):
    swa_record_bytes: one window (SWA) record (584 native, R + 72 packed): one size for every
        layer, or a list of one per layer (the engine's retention.window_records=packed_csa
        packs only CSA layers' windows).
    c128_record_bytes: one C128 record, every HCA layer (584 native, R + 72 packed).
    index_key_bytes: one C4 indexer key; None: SGLang's FP8 keys at index_head_dim (132 at
        128; index_key_bytes("mxfp4", 128) = 68).
    state_dtype_bytes: one compressor-state element, C4, indexer and C128 state alike (4:
        float32, SGLang's default; 2: bfloat16, SGLANG_DSV4_COMPRESS_STATE_DTYPE=bfloat16).
    """

    compress_ratios: list[int]
    c4_record_bytes: list[int]
    window_size: int = 128
    index_head_dim: int = 128
    page_size: int = DSV4_PAGE_SIZE
    swa_ratio: float = DSV4_SWA_RATIO
    max_running_requests: int = 64
    swa_record_bytes: int | list[int] = NATIVE_RECORD_BYTES
    c128_record_bytes: int = NATIVE_RECORD_BYTES
    index_key_bytes: int | None = None
    state_dtype_bytes: int = STATE_DTYPE_BYTES

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
        allowed = ", ".join(map(str, RECORD_BYTES))
        if isinstance(self.swa_record_bytes, list) and len(self.swa_record_bytes) != self.n_layers:
            raise ValueError(f"swa_record_bytes has {len(self.swa_record_bytes)} values; the model has "
                             f"{self.n_layers} layers (or give one size for all)")
        for name, value in (*(("swa_record_bytes", b) for b in self.window_record_bytes()),
                            ("c128_record_bytes", self.c128_record_bytes)):
            if value not in RECORD_BYTES:
                raise ValueError(f"{name}={value} is not a record size; allowed: {allowed} "
                                 f"(packed_record_bytes(R) = R + 72, or native {NATIVE_RECORD_BYTES})")
        if self.index_key_bytes is not None and (isinstance(self.index_key_bytes, bool)
                                                 or not isinstance(self.index_key_bytes, int)
                                                 or self.index_key_bytes < 1):
            raise ValueError(f"index_key_bytes={self.index_key_bytes!r} must be a positive number of bytes "
                             f"(or None: FP8 keys, {index_key_bytes('fp8', self.index_head_dim)})")
        if self.state_dtype_bytes not in STATE_DTYPES.values():
            raise ValueError(f"state_dtype_bytes={self.state_dtype_bytes!r} is not allowed; allowed: "
                             + ", ".join(f"{b} ({name})" for name, b in STATE_DTYPES.items()))

    @property
    def n_layers(self) -> int:
        return len(self.compress_ratios)

    @property
    def n_c4(self) -> int:
        return sum(1 for r in self.compress_ratios if r == CSA_RATIO)

    @property
    def n_c128(self) -> int:
        return sum(1 for r in self.compress_ratios if r == HCA_RATIO)

    def window_record_bytes(self) -> list[int]:
        """One window record's stored bytes in each layer (swa_record_bytes per layer)."""
        if isinstance(self.swa_record_bytes, list):
            return list(self.swa_record_bytes)
        return [self.swa_record_bytes] * self.n_layers

    def indexer_key_bytes(self) -> int:
        """One C4 indexer key as stored: index_key_bytes, or by default FP8 codes plus one fp32
        scale per 128 coordinates (132 B)."""
        if self.index_key_bytes is not None:
            return self.index_key_bytes
        return index_key_bytes("fp8", self.index_head_dim)

    def bytes_per_full_token(self) -> dict[str, float]:
        """Cost of one full token per component, in bytes (SGLang's _get_bytes_per_full_token)."""
        r, ring_frac = self.swa_ratio, C4_RING / self.window_size
        state4 = 2 * 2 * HEAD_DIM * self.state_dtype_bytes
        idx_state4 = 2 * 2 * self.index_head_dim * self.state_dtype_bytes
        return {
            "swa": r * sum(self.window_record_bytes()),
            "c4": sum(self.c4_record_bytes) / CSA_RATIO,
            "c128": self.c128_record_bytes * self.n_c128 / HCA_RATIO,
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
        return rows * 2 * HEAD_DIM * self.state_dtype_bytes * self.n_c128


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
    state4 = 2 * 2 * HEAD_DIM * geometry.state_dtype_bytes
    idx_state4 = 2 * 2 * geometry.index_head_dim * geometry.state_dtype_bytes
    return {
        "swa": sizes.swa_tokens * sum(geometry.window_record_bytes()),
        "c4": sizes.c4_records * sum(geometry.c4_record_bytes),
        "c128": sizes.c128_records * geometry.c128_record_bytes * geometry.n_c128,
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


#: The parts a Combination may store packed, by their component name: the C4 records, the
#: window (SWA) records of the CSA layers only (with each layer's C4 map: what the engine
#: serves), the window records of every layer, the C128 records.
PACKABLE_PARTS = ("c4", "csa_swa", "swa", "c128")


@dataclass(frozen=True)
class Combination:
    """Which parts of the per-token KV bytes are stored how (docs/kv.md, "Capacity beyond C4").

    packed: the parts whose records are packed at `retention` (a subset of PACKABLE_PARTS;
        the others stay native, 584 B; "csa_swa" and "swa" exclude each other).
    retention: R, coordinates kept of 512 by every packed part (packed_record_bytes(R) =
        R + 72 bytes a record).
    index_keys: the C4 indexer keys' format, one of INDEX_KEY_FORMATS.
    state_dtype: the compressors' state dtype, one of STATE_DTYPES.
    Served by the engine (Combination.served): every combination that packs the C4 records
    or nothing (its packed modes always pack the C4 records; retention.window_records and
    retention.c128_records pack the rest, host.index_key_format and
    host.compressor_state_dtype set the others).
    """

    packed: tuple[str, ...] = ("c4",)
    retention: int = KERNEL_RETENTION
    index_keys: str = "fp8"
    state_dtype: str = "float32"

    def __post_init__(self) -> None:
        unknown = [p for p in self.packed if p not in PACKABLE_PARTS]
        if unknown or len(set(self.packed)) != len(self.packed):
            raise ValueError(f"packed={list(self.packed)} must name distinct parts of: {', '.join(PACKABLE_PARTS)}")
        if {"csa_swa", "swa"} <= set(self.packed):
            raise ValueError(f"packed={list(self.packed)} names both csa_swa (the CSA layers' window records) and swa "
                             "(every layer's): give one")
        if "csa_swa" in self.packed and "c4" not in self.packed:
            raise ValueError(f"packed={list(self.packed)}: csa_swa packs the CSA layers' window records with their "
                             "C4 maps, so it needs c4 packed too")
        # One order whatever order given, so equal combinations compare and name alike.
        object.__setattr__(self, "packed", tuple(p for p in PACKABLE_PARTS if p in self.packed))
        packed_record_bytes(self.retention)  # a ValueError naming retention= and the allowed values
        if self.index_keys not in INDEX_KEY_FORMATS:
            raise ValueError(f"index_keys={self.index_keys!r} is not allowed; allowed: {', '.join(INDEX_KEY_FORMATS)}")
        if self.state_dtype not in STATE_DTYPES:
            raise ValueError(f"state_dtype={self.state_dtype!r} is not allowed; allowed: {', '.join(STATE_DTYPES)}")

    @property
    def name(self) -> str:
        """native, or the parts stored unlike SGLang joined by "+" (c4+swa+c128+mxfp4_index+bf16_state,
        c4+csa_swa)."""
        parts = list(self.packed)
        if self.index_keys != "fp8":
            parts.append(f"{self.index_keys}_index")
        if self.state_dtype != "float32":
            parts.append({"bfloat16": "bf16"}.get(self.state_dtype, self.state_dtype) + "_state")
        return "+".join(parts) or "native"

    @property
    def served(self) -> bool:
        """Whether Remnant's engine serves this combination: it packs the C4 records, or
        nothing (a packed mode packs the other parts only beside its C4 records)."""
        return not self.packed or "c4" in self.packed


def combination_geometry(geometry: PoolGeometry, combination: Combination) -> PoolGeometry:
    """`geometry` (a model at a server's settings) with every part stored as `combination`
    says; the parts of `geometry` itself are replaced, not kept."""
    record = packed_record_bytes(combination.retention)

    def part(name: str) -> int:
        return record if name in combination.packed else NATIVE_RECORD_BYTES

    if "csa_swa" in combination.packed:
        swa = [record if ratio == CSA_RATIO else NATIVE_RECORD_BYTES for ratio in geometry.compress_ratios]
    else:
        swa = part("swa")
    return dataclasses.replace(
        geometry,
        c4_record_bytes=[part("c4")] * geometry.n_c4,
        swa_record_bytes=swa,
        c128_record_bytes=part("c128"),
        index_key_bytes=index_key_bytes(combination.index_keys, geometry.index_head_dim),
        state_dtype_bytes=STATE_DTYPES[combination.state_dtype],
    )


# The ladder (issue 44): each adds one part to the one before.
NATIVE = Combination(packed=())
C4_ONLY = Combination(packed=("c4",))
C4_SWA = Combination(packed=("c4", "swa"))
C4_SWA_C128 = Combination(packed=("c4", "swa", "c128"))
C4_SWA_C128_MXFP4 = Combination(packed=("c4", "swa", "c128"), index_keys="mxfp4")
C4_SWA_C128_MXFP4_BF16 = Combination(packed=("c4", "swa", "c128"), index_keys="mxfp4", state_dtype="bfloat16")
# The CSA layers' windows packed with their C4 maps (the other layers' windows native,
# so no map beyond the C4 maps), then the state and the index keys.
C4_CSA_SWA = Combination(packed=("c4", "csa_swa"))
C4_CSA_SWA_BF16 = Combination(packed=("c4", "csa_swa"), state_dtype="bfloat16")
C4_CSA_SWA_MXFP4_BF16 = Combination(packed=("c4", "csa_swa"), index_keys="mxfp4", state_dtype="bfloat16")
#: The standard combinations, in the order the report lists them: native first, the issue's
#: ladder, then the CSA layers' windows alone.
STANDARD_COMBINATIONS = (NATIVE, C4_ONLY, C4_SWA, C4_SWA_C128, C4_SWA_C128_MXFP4, C4_SWA_C128_MXFP4_BF16,
                         C4_CSA_SWA, C4_CSA_SWA_BF16, C4_CSA_SWA_MXFP4_BF16)

