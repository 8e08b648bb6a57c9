"""Byte layout of C4 attention records (DESIGN section 3).

A record holds one 512-coordinate latent: NoPE 0..447 as FP8 e4m3 codes with one UE8M0
scale per 64-coordinate tile, RoPE 448..511 as bf16. Native records are 584 bytes, as
SGLang's DeepSeek-V4 pool and FlashMLA's FP8 sparse layout store them.
"""

from __future__ import annotations

HEAD_DIM = 512
NOPE_DIM = 448
ROPE_DIM = HEAD_DIM - NOPE_DIM
TILE = 64
NUM_TILES = NOPE_DIM // TILE  # 7 UE8M0 scales
ROPE_BYTES = ROPE_DIM * 2  # bf16
SCALE_BYTES = NUM_TILES + 1  # 7 scales + 1 pad byte

NATIVE_RECORD_BYTES = NOPE_DIM + ROPE_BYTES + SCALE_BYTES  # 584
NATIVE_DATA_BYTES = NOPE_DIM + ROPE_BYTES  # 576, the data part of SGLang's split page

#: Retention values R (coordinates kept of 512; RoPE is always kept).
RETENTION_VALUES = tuple(range(64, 512, 64))  # 64, 128, ..., 448
KERNEL_RETENTION = 256

UE8M0_BIAS = 127
FP8_MAX = 448.0


def packed_record_bytes(retention: int) -> int:
    """Bytes of one packed record keeping `retention` of 512 coordinates (R + 72).

    The kept NoPE codes (R - 64 bytes), the 128 RoPE bytes, then the 7 scales and pad.
    """
    if retention not in RETENTION_VALUES and retention != HEAD_DIM:
        raise ValueError(
            f"retention={retention} is not allowed; allowed: {', '.join(map(str, RETENTION_VALUES))}"
        )
    return (retention - ROPE_DIM) + ROPE_BYTES + SCALE_BYTES
