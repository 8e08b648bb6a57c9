"""The indexer's keys as the pools store them, in two formats (`IndexKeyFormat`).

fp8 (the default; what the engine writes today): 128-coordinate blocks of FP8 e4m3 codes,
each block with one float32 scale (amax / 448), codes of a key first and its scales after
(d + 4 d / 128 bytes: 132 at V4's index_head_dim of 128).

mxfp4 (68 bytes at d = 128), as SGLang 0.5.18 stores DeepSeek-V4's indexer keys with
--enable-deepseek-v4-fp4-indexer (sglang/srt/mem_cache/deepseek_v4_memory_pool.py
DeepSeekV4IndexerPool.get_bytes_per_token: index_head_dim // 2 + 4; the writer
sglang/kernels/jit/csrc/deepseek_v4/fused_norm_rope_v2.cuh, forward_fp4, and its Triton
twin sglang/kernels/ops/attention/dsv4/fp4_indexer.py; read by DeepGEMM's
fp8_fp4_paged_mqa_logits, SM100/SM120 only in SGLang):

    bytes 0 .. d/2-1      FP4 e2m1 codes, two per byte: coordinate 2i in the low nibble of
                          byte i, coordinate 2i+1 in the high nibble
    bytes d/2 .. d/2+d/32-1   one UE8M0 exponent byte s per 32 coordinates (byte g for
                          coordinates 32g .. 32g+31); the block's scale is 2^(s - 127)

An e2m1 nibble is sign (bit 3) and a magnitude index m (bits 0-2) naming 0, 0.5, 1, 1.5,
2, 3, 4, 6 (OCP MX v1.0's FP4 E2M1: 2 exponent bits with bias 1, 1 mantissa bit, no
Inf/NaN). Encoding, SGLang's exactly (the CUDA writer its default compressor runs):
scale_raw = max(1e-4, amax of the 32) / 6 in float32; s = its float32 exponent field, plus
one when its mantissa is not zero (the power of two at or above scale_raw, so the block's
largest value lands at or below 6, up to the division's rounding); each x * 2^(127 - s)
(exact: a power of two) is clamped to 6 and rounded to the nearest magnitude with ties
toward zero (thresholds 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5: not OCP's
round-half-to-even), and a negative value keeps its sign unless it rounds to 0 (no -0).
SGLang's Triton writer floors the scale as max(amax / 6, 1e-4) instead; the two differ
only for blocks whose amax lies below 6e-4. Decoding is exact: value = e2m1(m) * 2^(s-127).
The writer never stores s < 111 (the floor) or 255 (OCP's NaN).

In a page of P keys both formats sit as the engine's split pages put them
(remnant.engine.pools.SplitPages, remnant.kv.layout.PageLayout): the P keys' data parts
(codes) first, then their P tails (scale bytes): SGLang's layout for MXFP4 too (its
store: page * page_bytes + slot * 64 for the codes, + P * 64 + slot * 4 for the
exponents; page_bytes = P * 68, where our pools pad to a multiple of the data row).
The engine writes them, its torch paths and remnant.kernels.indexer's reference read them
back through here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from remnant.kv.formats import (
    FP4_PER_BYTE,
    FP8_KEY_BLOCK,
    FP8_KEY_SCALE_BYTES,
    MX_KEY_BLOCK,
    index_key_parts,
)

#: Coordinates per scale block, and the bytes of one block's float32 scale (fp8 keys);
#: MXFP4 (OCP MX): coordinates per UE8M0 exponent byte, FP4 codes per byte. One home for
#: the sizes: remnant.kv.formats (plain Python, which the capacity formula takes too).
BLOCK = FP8_KEY_BLOCK
SCALE_BYTES = FP8_KEY_SCALE_BYTES
MX_BLOCK = MX_KEY_BLOCK
#: V4-Flash's index_head_dim, and the bytes of one key there in each format (132, 68).
INDEX_HEAD_DIM = 128
FP8_KEY_BYTES = sum(index_key_parts("fp8", INDEX_HEAD_DIM))
MXFP4_KEY_BYTES = sum(index_key_parts("mxfp4", INDEX_HEAD_DIM))
#: e2m1 magnitudes by 3-bit index; the largest; SGLang's floor on a block's amax.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0
MXFP4_AMAX_FLOOR = 1e-4
#: Rounding thresholds between consecutive magnitudes (a value above threshold i rounds to
#: magnitude i + 1 or higher; exactly at one rounds toward zero, as SGLang's quant_fp4_e2m1).
_E2M1_THRESHOLDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def quantize_index_keys(keys: torch.Tensor) -> torch.Tensor:
    """Indexer keys float [k, d] -> FP8 codes + one fp32 scale per 128 coords, uint8 [k, d + 4d/128]."""
    return join_index_keys(*index_key_codes(keys))


def index_key_codes(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Indexer keys float [k, d] -> (FP8 codes as uint8 [k, d], scales float32 [k, d/128])."""
    k, d = keys.shape
    blocks = keys.view(k, d // BLOCK, BLOCK)
    # Times the float32 reciprocal of 448: what torch on CUDA (and Inductor) make of a
    # division by a constant, and the CPU's and the kernels' too, so every path writes the
    # same scales (remnant.kernels.compress.index_key_decode, the compiled codec).
    scale = (blocks.abs().amax(-1) * (1.0 / 448.0)).clamp_min(1e-12)
    return (blocks / scale[..., None]).to(torch.float8_e4m3fn).view(torch.uint8).reshape(k, d), scale


def join_index_keys(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """index_key_codes' two parts as stored: uint8 [k, d + 4d/128] (codes, then the scales' bytes)."""
    return torch.cat([codes, scale.contiguous().view(torch.uint8).reshape(codes.shape[0], -1)], dim=1)


def dequantize_index_keys(stored: torch.Tensor) -> torch.Tensor:
    """quantize_index_keys' inverse up to FP8 rounding: uint8 [..., d + 4d/128] -> float32 [..., d]."""
    *lead, width = stored.shape
    d = width * BLOCK // (BLOCK + SCALE_BYTES)
    codes = stored[..., :d].contiguous().view(torch.float8_e4m3fn).float().view(*lead, d // BLOCK, BLOCK)
    scale = stored[..., d:].contiguous().view(torch.float32).view(*lead, d // BLOCK, 1)
    return (codes * scale).reshape(*lead, d)


@dataclass(frozen=True)
class IndexKeyFormat:
    """How one indexer key of `dim` coordinates is stored: `name` "fp8" | "mxfp4" (the
    module docstring), its data part (codes) and tail (scales) in bytes, which the pools'
    split pages (PageLayout's data_bytes and tail_bytes) and the capacity accounting take."""

    name: str
    dim: int = INDEX_HEAD_DIM

    def __post_init__(self):
        index_key_parts(self.name, self.dim)  # a ValueError naming the format or the dimension

    @property
    def data_bytes(self) -> int:
        """Code bytes of one key: d (fp8) or d / 2 (mxfp4)."""
        return index_key_parts(self.name, self.dim)[0]

    @property
    def tail_bytes(self) -> int:
        """Scale bytes of one key: 4 per 128 coordinates (fp8) or 1 per 32 (mxfp4)."""
        return index_key_parts(self.name, self.dim)[1]

    @property
    def bytes_per_key(self) -> int:
        """data_bytes + tail_bytes: 132 (fp8) or 68 (mxfp4) at d = 128."""
        return self.data_bytes + self.tail_bytes

    def quantize(self, keys: torch.Tensor) -> torch.Tensor:
        """Keys float [k, dim] -> uint8 [k, bytes_per_key] (codes, then scales)."""
        return quantize_index_keys(keys) if self.name == "fp8" else quantize_index_keys_mxfp4(keys)

    def dequantize(self, stored: torch.Tensor) -> torch.Tensor:
        """uint8 [..., bytes_per_key] -> float32 [..., dim]."""
        return dequantize_index_keys(stored) if self.name == "fp8" else dequantize_index_keys_mxfp4(stored)


def index_key_format(fmt: "str | IndexKeyFormat", dim: int = INDEX_HEAD_DIM) -> IndexKeyFormat:
    """An IndexKeyFormat from its name (or itself); ValueError naming the allowed names."""
    return fmt if isinstance(fmt, IndexKeyFormat) else IndexKeyFormat(fmt, dim)


def quantize_index_keys_mxfp4(keys: torch.Tensor) -> torch.Tensor:
    """Indexer keys float [k, d] (d a multiple of 32) -> MXFP4 uint8 [k, d/2 + d/32]: e2m1
    codes two a byte, then one UE8M0 exponent byte per 32 coordinates (SGLang's encoding;
    the module docstring). Non-finite keys give undefined bytes, as in SGLang."""
    return torch.cat(index_key_codes_mxfp4(keys), dim=1)


def index_key_codes_mxfp4(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Indexer keys float [k, d] -> (e2m1 codes uint8 [k, d/2], UE8M0 exponents uint8 [k, d/32])."""
    if keys.ndim != 2 or not keys.is_floating_point() or keys.shape[1] % MX_BLOCK:
        raise ValueError(f"keys must be float [k, d] with d a multiple of {MX_BLOCK}, got {keys.dtype} "
                         f"{tuple(keys.shape)}")
    k, d = keys.shape
    x = keys.float().reshape(k, d // MX_BLOCK, MX_BLOCK)
    # SGLang's cast_to_ue8m0: the float32 exponent field of max(1e-4, amax) / 6, rounded up
    # to the next power of two unless it is one.
    bits = (x.abs().amax(-1).clamp_min(MXFP4_AMAX_FLOOR) / E2M1_MAX).view(torch.int32)
    exponent = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).int()
    inverse = ((254 - exponent) << 23).view(torch.float32)           # 2^(127 - s), exact
    y = x * inverse[..., None]
    # The magnitude index counts the thresholds strictly below |y|: ties go toward zero. Seven
    # comparisons with constants, not a bucketize over a threshold tensor: a tensor made from
    # a list copies from the host, which a CUDA graph capture (the decode step's) refuses.
    a = y.abs()
    magnitude = sum((a > t).to(torch.uint8) for t in _E2M1_THRESHOLDS)
    nibble = magnitude | (((y < 0) & (magnitude != 0)).to(torch.uint8) << 3)
    nibble = nibble.reshape(k, d)
    return nibble[:, 0::2] | (nibble[:, 1::2] << 4), exponent.to(torch.uint8)


def dequantize_index_keys_mxfp4(stored: torch.Tensor) -> torch.Tensor:
    """quantize_index_keys_mxfp4's inverse up to FP4 rounding: uint8 [..., d/2 + d/32] ->
    float32 [..., d], value = e2m1(code) * 2^(s - 127) (exact; s = 0 reads as 0)."""
    *lead, width = stored.shape
    if stored.dtype != torch.uint8 or (width * MX_BLOCK) % (MX_BLOCK // FP4_PER_BYTE + 1):
        raise ValueError(f"MXFP4 index keys must be uint8 [..., 17 d / 32], got {stored.dtype} {tuple(stored.shape)}")
    d = width * MX_BLOCK // (MX_BLOCK // FP4_PER_BYTE + 1)
    packed = stored[..., : d // 2]
    nibble = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(*lead, d).long()
    # e2m1 magnitude index m -> value, by arithmetic (no table tensor: that would be a host
    # copy, which a CUDA graph capture refuses): m < 2 is 0 or 0.5, else (1 + (m & 1) / 2)
    # x 2^((m >> 1) - 1), i.e. 1, 1.5, 2, 3, 4, 6 (E2M1_VALUES).
    m = nibble & 7
    quarters = torch.where(m < 2, 2 * m, (2 + (m & 1)) << (m >> 1))
    magnitude = quarters.float() * 0.25
    value = torch.where(nibble >= 8, -magnitude, magnitude)
    scale = (stored[..., d // 2 :].int() << 23).view(torch.float32)  # 2^(s - 127) as float32 bits
    return (value.view(*lead, d // MX_BLOCK, MX_BLOCK) * scale[..., None]).reshape(*lead, d)
