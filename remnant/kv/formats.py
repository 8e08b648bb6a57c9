"""Byte layout of C4 attention records (docs/kv.md).

A record holds one 512-coordinate latent: NoPE 0..447 as FP8 e4m3 codes with one UE8M0
scale per 64-coordinate tile, RoPE 448..511 as bf16.

Native record, 584 bytes (SGLang's DeepSeek-V4 pool, FlashMLA's FP8 sparse layout):
    [0, 448)    NoPE FP8 codes        [448, 576) RoPE, 64 x bf16
    [576, 583)  7 UE8M0 scales        583        pad (zero)
Packed record keeping R of 512 coordinates (N = R - 64 NoPE codes kept), R + 72 bytes:
    [0, N)      kept NoPE codes, in retention-map order (sorted NoPE indices)
    [N, N+128)  RoPE, 64 x bf16       [N+128, N+135) the 7 scales    N+135 pad
R = 512 keeps everything: the packed record is the native record.

Plain Python only: config validation imports this module without torch.
"""

from __future__ import annotations

#: Token positions per compressed record: a CSA layer keeps one C4 record per CSA_RATIO
#: positions (the records Remnant packs), an HCA layer one C128 record per HCA_RATIO
#: (DeepSeek-V4's compress_ratios; 0: a window-only layer).
CSA_RATIO = 4
HCA_RATIO = 128

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

#: How a packed mode stores window (SWA) records (retention.window_records): native;
#: packed_csa, each CSA layer's window records packed as its C4 records, with the same map;
#: packed, every layer's: the HCA and window-only layers with maps of their own (the
#: engine calibrates them at load).
WINDOW_RECORDS = ("native", "packed_csa", "packed")
#: How a packed mode stores the HCA layers' C128 records (retention.c128_records): native,
#: or packed with each HCA layer's own map (the one its window takes).
C128_RECORDS = ("native", "packed")

UE8M0_BIAS = 127
FP8_MAX = 448.0


def _check_retention(retention: int) -> None:
    if retention not in RETENTION_VALUES and retention != HEAD_DIM:
        raise ValueError(
            f"retention={retention} is not allowed; allowed: {', '.join(map(str, RETENTION_VALUES))} "
            f"(or {HEAD_DIM}: keep everything)"
        )


def kept_nope(retention: int) -> int:
    """NoPE coordinates kept at retention R: N = R - 64."""
    _check_retention(retention)
    return retention - ROPE_DIM


def packed_data_bytes(retention: int) -> int:
    """Data part of a packed record (kept NoPE codes + RoPE): R + 64 bytes."""
    return kept_nope(retention) + ROPE_BYTES


def packed_record_bytes(retention: int) -> int:
    """Bytes of one packed record keeping `retention` of 512 coordinates: R + 72.

    The kept NoPE codes (R - 64 bytes), the 128 RoPE bytes, then the 7 scales and pad.
    """
    return packed_data_bytes(retention) + SCALE_BYTES


def page_bytes(page_size: int, retention: int = HEAD_DIM) -> int:
    """Bytes of one page of `page_size` records in SGLang's split layout.

    [page_size x data][page_size x 8 scale bytes], padded up to a whole number of data
    rows, as SGLang's DeepSeekV4SingleKVPool pads native pages to a multiple of 576.
    """
    if page_size < 1:
        raise ValueError(f"page_size={page_size} must be >= 1")
    row = packed_data_bytes(retention)
    raw = page_size * (row + SCALE_BYTES)
    return -(-raw // row) * row


#: The C4 indexer's key formats (remnant.kv.index_keys): fp8, e4m3 codes with one float32
#: scale per FP8_KEY_BLOCK coordinates (SGLang's default); mxfp4, e2m1 codes two to a byte
#: with one UE8M0 exponent byte per MX_KEY_BLOCK (SGLang's --enable-deepseek-v4-fp4-indexer).
INDEX_KEY_FORMATS = ("fp8", "mxfp4")
FP8_KEY_BLOCK = 128
FP8_KEY_SCALE_BYTES = 4
MX_KEY_BLOCK = 32
FP4_PER_BYTE = 2


def index_key_parts(key_format: str, dim: int) -> tuple[int, int]:
    """(code bytes, scale bytes) of one indexer key of `dim` coordinates in `key_format`:
    (d, 4 d / 128) for fp8 (132 bytes at V4's 128), (d / 2, d / 32) for mxfp4 (68). The
    pools' split pages, the capacity formula and the codec all take their sizes here."""
    if key_format not in INDEX_KEY_FORMATS:
        raise ValueError(f"index key format={key_format!r} is unknown; allowed: {', '.join(INDEX_KEY_FORMATS)}")
    block = FP8_KEY_BLOCK if key_format == "fp8" else MX_KEY_BLOCK
    if dim < block or dim % block:
        raise ValueError(f"index_head_dim={dim} must be a positive multiple of {block} for {key_format} index keys")
    if key_format == "fp8":
        return dim, dim // FP8_KEY_BLOCK * FP8_KEY_SCALE_BYTES
    return dim // FP4_PER_BYTE, dim // MX_KEY_BLOCK


def index_key_format_of(key_bytes: int, dim: int) -> str:
    """The indexer key format whose keys of `dim` coordinates take `key_bytes` bytes."""
    for name in INDEX_KEY_FORMATS:
        if sum(index_key_parts(name, dim)) == key_bytes:
            return name
    sizes = ", ".join(f"{n} {sum(index_key_parts(n, dim))}" for n in INDEX_KEY_FORMATS)
    raise ValueError(f"index keys of {key_bytes} bytes at index_head_dim={dim} are no indexer key format; "
                     f"allowed: {sizes}")

