"""Which model layers of SGLang's DeepSeek-V4 are CSA layers (the ones with C4 records),
as its token pool describes them. The plugin's packed pool and the capture hooks both key
their work by these model layer indices. Plain Python: no torch, no sglang import."""

from __future__ import annotations

from remnant.kv.formats import CSA_RATIO


def csa_layers(compression_ratios: list[int]) -> list[int]:
    """The model's CSA layers: those whose compress ratio is CSA_RATIO."""
    return [i for i, r in enumerate(compression_ratios) if r == CSA_RATIO]


def stage_csa_layers(pool) -> list[int]:
    """The CSA model layers of a DeepSeek-V4 token pool's pipeline stage."""
    ratios = list(pool.compression_ratios)
    return [i for i in range(pool._stage_start, pool._stage_end) if ratios[i] == CSA_RATIO]
