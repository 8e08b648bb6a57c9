"""What the plugin's pools store per full token against what SGLang 0.5.18's pool sizing
counts (DSV4PoolConfigurator._get_bytes_per_full_token), per component: the bytes SGLang
counts but the pools do not hold, which the configurator hook takes off its cost per full
token so that they become tokens (remnant.sglang.plugin.bytes_per_full_token).

SGLang counts 584 bytes for every C4 record and d + 4 d / 128 bytes for every indexer key
(132 at d = 128), whatever its --enable-deepseek-v4-fp4-indexer says. Components here
carry remnant.engine.capacity's names:

- c4: a packed mode's C4 records, R + 72 bytes per CSA layer's record;
- swa: with window_records=packed_csa, the CSA layers' window records at the same R + 72
  (SGLang counts swa_ratio x 584 per layer and full token);
- c4_indexer: with SGLang's FP4 indexer, the key its pool stores (DeepSeekV4IndexerPool.
  get_bytes_per_token: d / 2 + 4 = 68 bytes at d = 128).

Plain Python: no torch, no sglang (the hook reads SGLang's flag and passes it in).
"""

from __future__ import annotations

from remnant.kv.formats import CSA_RATIO, NATIVE_RECORD_BYTES
from remnant.sglang.settings import Settings

#: SGLang's quantization block of FP8 indexer keys (one fp32 scale per block), as its
#: configurator counts them.
INDEXER_QUANT_BLOCK = 128


def counted_index_key_bytes(index_head_dim: int) -> int:
    """Bytes of one indexer key as SGLang's configurator counts it, FP4 indexer or not."""
    return index_head_dim + index_head_dim // INDEXER_QUANT_BLOCK * 4


def fp4_index_key_bytes(index_head_dim: int) -> int:
    """Bytes of one indexer key as SGLang's pool stores it with the FP4 indexer: E2M1 codes
    two a byte, then four bytes of UE8M0 scales (DeepSeekV4IndexerPool.get_bytes_per_token)."""
    return index_head_dim // 2 + 4


def freed_per_full_token(configurator, s: Settings, packed_c4: list[int], fp4_indexer: bool) -> dict[str, float]:
    """Bytes per full token that `configurator` (SGLang's DSV4PoolConfigurator, or anything
    with its fields) counts and the plugin's pools do not store, by component.

    packed_c4: stored bytes of one C4 record per CSA layer of the stage (R + 72; read only
    in a packed mode); fp4_indexer: SGLang's --enable-deepseek-v4-fp4-indexer, as the
    indexer pool reads it.
    """
    n_c4 = configurator.num_layers_ca4
    freed = {}
    if s.packed and n_c4:
        native = configurator.qk_nope_head_dim + configurator.qk_rope_head_dim * 2 + 8
        if native != NATIVE_RECORD_BYTES:
            raise RuntimeError(f"remnant: SGLang counts {native}-byte records; the packed pools replace "
                               f"{NATIVE_RECORD_BYTES}-byte ones (DeepSeek-V4's 448 + 64 head)")
        c4_frac = 1 / (CSA_RATIO * configurator.c4_shrink_factor)
        freed["c4"] = c4_frac * (native * n_c4 - sum(packed_c4))
        if s.packed_windows:
            # One window record per token of the SWA pool (swa_ratio x F tokens), per CSA layer.
            freed["swa"] = configurator.swa_ratio * (native * n_c4 - sum(packed_c4))
    if fp4_indexer and n_c4:
        d = configurator.indexer_head_dim
        freed["c4_indexer"] = (counted_index_key_bytes(d) - fp4_index_key_bytes(d)) * n_c4 / CSA_RATIO
    return freed
