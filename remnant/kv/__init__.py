"""The bytes of Remnant's KV: record formats, modes, page and column layouts, reference
codecs and reference attention (what kernels are tested against).

`remnant.kv.formats` and `remnant.kv.modes` are plain Python (config validation imports
them); everything else imports torch, so it loads on first use. What chooses the kept
coordinates (captures, policies, retention maps, fidelity) is remnant.calibration, which
builds on this package and never the other way.
"""

from remnant.kv.formats import (
    CSA_RATIO,
    HCA_RATIO,
    HEAD_DIM,
    KERNEL_RETENTION,
    NATIVE_RECORD_BYTES,
    NOPE_DIM,
    RETENTION_VALUES,
    ROPE_DIM,
    packed_record_bytes,
)

_LAZY = {
    "quantize": "remnant.kv.codec",
    "dequantize": "remnant.kv.codec",
    "pack": "remnant.kv.packing",
    "unpack": "remnant.kv.packing",
    "to_pages": "remnant.kv.packing",
    "from_pages": "remnant.kv.packing",
    "attend_native": "remnant.kv.attention",
    "attend_reconstructed": "remnant.kv.attention",
    "attend_packed": "remnant.kv.attention",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'remnant.kv' has no attribute {name!r}")


__all__ = [
    "CSA_RATIO",
    "HCA_RATIO",
    "HEAD_DIM",
    "KERNEL_RETENTION",
    "NATIVE_RECORD_BYTES",
    "NOPE_DIM",
    "RETENTION_VALUES",
    "ROPE_DIM",
    "packed_record_bytes",
    *_LAZY,
]
