"""Record formats and reference codecs of Remnant's KV.

`remnant.kv.formats` is plain Python (config validation imports it); the codecs import
torch, so they load on first use.
"""

from remnant.kv.formats import (
    HEAD_DIM,
    KERNEL_RETENTION,
    NATIVE_RECORD_BYTES,
    NOPE_DIM,
    RETENTION_VALUES,
    ROPE_DIM,
    packed_record_bytes,
)

_CODEC_NAMES = ("quantize", "dequantize")


def __getattr__(name: str):
    if name in _CODEC_NAMES:
        from remnant.kv import codec

        return getattr(codec, name)
    raise AttributeError(f"module 'remnant.kv' has no attribute {name!r}")


__all__ = [
    "HEAD_DIM",
    "KERNEL_RETENTION",
    "NATIVE_RECORD_BYTES",
    "NOPE_DIM",
    "RETENTION_VALUES",
    "ROPE_DIM",
    "dequantize",
    "packed_record_bytes",
    "quantize",
]
