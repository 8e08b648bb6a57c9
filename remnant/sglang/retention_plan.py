"""The retention the plugin serves per CSA layer: R and the kept coordinates, from the
retention map or the profile, and the stored bytes of a C4 record they give. The pool hook
(remnant.sglang.plugin.make_kv_pool), the configurator hook and kernel mode's weight fold
(remnant.sglang.kernel_mode) all ask here."""

from __future__ import annotations

import logging

from remnant.config_errors import ConfigError
from remnant.kv.formats import CSA_RATIO
from remnant.kv.modes import check_packed_rules
from remnant.sglang.layers import csa_layers
from remnant.sglang.settings import ENV_RETENTION, Settings

logger = logging.getLogger("remnant.sglang.plugin")  # the plugin's log, as before the split


def retention_plan(s: Settings, compression_ratios: list[int]) -> tuple[dict[int, int], dict[int, "object"]]:
    """R and kept NoPE indices (int64 [R - 64]) per CSA model layer.

    From the retention map when one is given (its R must agree with an explicit
    REMNANT_RETENTION), else R from the profile and the `prefix` baseline's coordinates.
    """
    import os

    import torch

    from remnant.calibration.retention import RetentionMap

    csa = csa_layers(compression_ratios)
    if s.map_path is not None:
        rmap = RetentionMap.load(s.map_path)
        rmap.check(csa)
        values = {i: rmap.retention(i) for i in csa}
        if os.environ.get(ENV_RETENTION, "").strip():
            wanted = s.values(len(csa))
            if wanted != [values[i] for i in csa]:
                raise ConfigError(f"retention map {s.map_path} keeps R={[values[i] for i in csa]} per CSA layer; "
                                  f"{ENV_RETENTION} asks for {wanted}")
        check_packed_rules(s.mode, list(values.values()), False, s.map_path)
        keeps = {i: rmap.keep_tensor(i) for i in csa}
    else:
        values = dict(zip(csa, s.values(len(csa))))
        logger.warning("remnant: no REMNANT_RETENTION_MAP: CSA layers keep the first R - 64 NoPE coordinates "
                       "(the `prefix` baseline); give a calibrated map for real runs")
        keeps = {i: torch.arange(r - 64, dtype=torch.int64) for i, r in values.items()}
    return values, keeps


def packed_c4_bytes(compression_ratios: list[int], s: Settings) -> list[int]:
    """Stored bytes of one C4 record per CSA layer of this stage (R + 72)."""
    from remnant.kv.formats import packed_record_bytes

    n = sum(1 for r in compression_ratios if r == CSA_RATIO)
    if s.map_path is not None:
        from remnant.calibration.retention import RetentionMap

        rmap = RetentionMap.load(s.map_path)
        values = [rmap.retention(i) for i in rmap.csa_layers]
    else:
        values = s.values(n) if len(s.retention) == 1 or len(s.retention) == n else list(s.retention)
    if len(set(values)) == 1:
        values = [values[0]] * n
    elif len(values) != n:
        raise ConfigError(f"remnant: a per-layer retention ({len(values)} CSA layers) cannot be split across "
                          f"pipeline stages here ({n} CSA layers in this stage); use a uniform retention with "
                          f"pipeline parallelism")
    return [packed_record_bytes(v) for v in values]
