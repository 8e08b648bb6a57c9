"""The plugin's settings: mode and retention, read from the environment.

SGLang loads plugins in every process it starts (the launcher, each scheduler process),
so the settings travel as environment variables, which child processes inherit;
`python -m remnant.cli.sglang_launch` turns its --remnant-* flags into them.

    REMNANT_MODE           native (default) | triton | kernel
    REMNANT_RETENTION      R for every CSA layer (e.g. 256), or one R per CSA layer
                           ("256,256,192,..."); default 256
    REMNANT_RETENTION_MAP  a remnant/retention-map JSON file naming the kept coordinates
                           (and R) per CSA layer; without one the `prefix` baseline keeps
                           the first R - 64 NoPE coordinates
    REMNANT_RETENTION_POLICY  the run config's policy; without a map only `prefix` is
                           accepted (SGLang cannot calibrate at load)
    REMNANT_CAPTURE        a capture file to write (remnant-capture/1): capture mode, native
                           only; REMNANT_CAPTURE_TOKENS, _RECORDS, _SOURCE and _MODEL_ID
                           bound and label it
                           (remnant.calibration.capture_recorder.CaptureSettings)
    SGLANG_DSV4_COMPRESS_STATE_DTYPE  SGLang's own variable, read as SGLang reads it
                           (float32 | fp32 | bfloat16 | bf16): the compressors' state dtype,
                           which SGLang itself applies to the state pools and counts in its
                           pool sizing, in every mode; carried here so that the hosts' one
                           setting (host.compressor_state_dtype) reaches SGLang through
                           to_env and is checked before SGLang starts
    REMNANT_INDEX_KEY_FORMAT  fp8 (default) | mxfp4: the indexer keys as SGLang's
                           --enable-deepseek-v4-fp4-indexer stores them, which the server
                           must be given too; the plugin's pool sizing then counts the
                           pool's 68 bytes a key where SGLang counts 132, in every mode
                           (native included: the one case where native registers hooks)
    REMNANT_WINDOW_RECORDS native (default) | packed_csa: in a packed mode, each CSA layer's
                           window records packed with its C4 map (retention.window_records;
                           packed, every layer's, is refused: SGLang cannot calibrate the
                           other layers' maps at load)
    REMNANT_C128_RECORDS   native (default): retention.c128_records; packed is refused (the
                           plugin does not pack C128 records)

`Settings.to_env` writes these variables (the hosts that start SGLang use it), `from_env`
reads them.

Rules (the run configs' own, remnant.kv.modes.check_packed_rules): kernel supports R=256
only; any R != 256 requires HiCache off (checked against SGLang's
--enable-hierarchical-cache when the server arguments are checked).

Plain Python: importing this module imports neither torch nor sglang.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

from remnant.config_errors import ConfigError
from remnant.kv.formats import C128_RECORDS, INDEX_KEY_FORMATS, KERNEL_RETENTION, RETENTION_VALUES, WINDOW_RECORDS
from remnant.kv.modes import check_packed_rules, mode_of

ENV_MODE = "REMNANT_MODE"
ENV_RETENTION = "REMNANT_RETENTION"
ENV_RETENTION_MAP = "REMNANT_RETENTION_MAP"
#: Without a map SGLang keeps the `prefix` coordinates: it cannot calibrate, so another
#: policy named here (the run config's) is refused rather than silently not used.
ENV_RETENTION_POLICY = "REMNANT_RETENTION_POLICY"
#: SGLang's own switch of the compressor state dtype (sglang/srt/environ.py), passed through
#: rather than renamed: SGLang reads it in every process, with or without the plugin.
ENV_STATE_DTYPE = "SGLANG_DSV4_COMPRESS_STATE_DTYPE"
#: The spellings SGLang accepts for each state dtype (pool_configurator.py,
#: _get_dsv4_compress_state_dtype_sizes), by the name Remnant gives it
#: (remnant.engine.capacity.STATE_DTYPES, host.compressor_state_dtype).
STATE_DTYPE_SPELLINGS = {"float32": ("float32", "fp32"), "bfloat16": ("bfloat16", "bf16")}
ENV_INDEX_KEY_FORMAT = "REMNANT_INDEX_KEY_FORMAT"
ENV_WINDOW_RECORDS = "REMNANT_WINDOW_RECORDS"
ENV_C128_RECORDS = "REMNANT_C128_RECORDS"
#: What the plugin serves of retention.window_records and retention.c128_records
#: (remnant.kv.formats.WINDOW_RECORDS, C128_RECORDS), and why it refuses the rest.
SERVED_RECORDS = {"window_records": ("native", "packed_csa"), "c128_records": ("native",)}
REFUSED_RECORDS = {
    ("window_records", "packed"): "packing every layer's window needs maps of the HCA and window-only layers, "
                                  "calibrated at load, which SGLang cannot do (a retention map file names CSA "
                                  "layers only)",
    ("c128_records", "packed"): "the SGLang plugin does not pack the HCA layers' C128 records (their maps are "
                                "calibrated at load, which SGLang cannot do)",
}

#: SGLang's entry-point group for general plugins, and the name Remnant registers there.
GENERAL_PLUGINS_GROUP = "sglang.srt.plugins"
PLUGIN_NAME = "remnant"

#: The sglang releases whose internals the plugin's hooks are written against.
SUPPORTED_SGLANG_VERSIONS = ("0.5.18",)


@dataclass(frozen=True)
class Settings:
    """mode: native | triton | kernel. retention: R per CSA layer, or a 1-tuple for a
    uniform R (the model's CSA layer count is known only when its pools are built).
    map_path: retention map file, or None. compressor_state_dtype: float32 | bfloat16, in
    every mode (SGLang's SGLANG_DSV4_COMPRESS_STATE_DTYPE). index_key_format: fp8 | mxfp4
    (remnant.kv.formats.INDEX_KEY_FORMATS), in every mode. window_records: native |
    packed_csa, c128_records: native, in the packed modes (SERVED_RECORDS)."""

    mode: str = "native"
    retention: tuple[int, ...] = (KERNEL_RETENTION,)
    map_path: str | None = None
    #: The run config's retention.policy, passed on so that the plugin refuses a policy it
    #: cannot calibrate instead of silently keeping the prefix coordinates (None: not given).
    policy: str | None = None
    compressor_state_dtype: str = "float32"
    index_key_format: str = "fp8"
    window_records: str = "native"
    c128_records: str = "native"

    @property
    def packed(self) -> bool:
        return mode_of(self.mode, ENV_MODE).packed

    @property
    def resizes(self) -> bool:
        """Whether the plugin sizes SGLang's pools other than SGLang does: a packed mode, or
        MXFP4 index keys (counted at the pool's true size) in any mode."""
        return self.packed or self.index_key_format != "fp8"

    def to_env(self) -> dict[str, str]:
        """The variables that `from_env` reads back as these settings: what a host exports
        to the server's processes. Native carries no retention, as it ignores it."""
        env = {ENV_MODE: self.mode}
        if self.packed:
            env[ENV_RETENTION] = _retention_label(self.retention)
            if self.map_path is not None:
                env[ENV_RETENTION_MAP] = os.path.abspath(self.map_path)
            if self.policy is not None:
                env[ENV_RETENTION_POLICY] = self.policy
        return {**env, **self.parts_env()}

    def parts_env(self) -> dict[str, str]:
        """The variables of the KV parts beyond the C4 records' mode and retention (a part
        of to_env): what a host whose server gets mode and retention another way adds
        (runners/modal/app.py writes those itself). A part at SGLang's default writes no
        variable: the server then runs as SGLang does without one."""
        env = {}
        if self.compressor_state_dtype != "float32":
            env[ENV_STATE_DTYPE] = self.compressor_state_dtype
        if self.index_key_format != "fp8":
            env[ENV_INDEX_KEY_FORMAT] = self.index_key_format
        if self.packed and self.window_records != "native":
            env[ENV_WINDOW_RECORDS] = self.window_records
        if self.packed and self.c128_records != "native":
            env[ENV_C128_RECORDS] = self.c128_records
        return env

    @property
    def packed_windows(self) -> bool:
        """Whether the CSA layers' window records are packed (window_records=packed_csa)."""
        return self.packed and self.window_records == "packed_csa"

    def values(self, n_csa: int) -> list[int]:
        """R of each of the model's `n_csa` CSA layers."""
        if len(self.retention) == 1:
            return [self.retention[0]] * n_csa
        if len(self.retention) != n_csa:
            raise ConfigError(
                f"{ENV_RETENTION} has {len(self.retention)} values; the model has {n_csa} CSA layers, "
                f"so it needs {n_csa} (or one uniform value)"
            )
        return list(self.retention)

    def check_hicache(self, hicache: bool) -> None:
        """ConfigError unless HiCache is allowed with this retention (R != 256 needs it off).

        With a retention map, the map's R values are the ones checked (REMNANT_RETENTION may
        be unset then)."""
        if not self.packed:
            return
        if self.map_path is not None:
            from remnant.calibration.retention import RetentionMap

            rmap = RetentionMap.load(self.map_path)
            values = sorted({rmap.retention(layer) for layer in rmap.csa_layers})
            check_packed_rules(self.mode, values, hicache, self.map_path)
            return
        check_packed_rules(self.mode, list(self.retention), hicache, _retention_label(self.retention))


def _retention_label(values: tuple[int, ...]) -> str:
    return str(values[0]) if len(values) == 1 else ",".join(map(str, values))


def parse_retention(text: str) -> tuple[int, ...]:
    """'256' -> (256,); '256,192' -> (256, 192). ConfigError names the bad item."""
    items = [item.strip() for item in text.split(",")]
    values = []
    for i, item in enumerate(items):
        try:
            value = int(item)
        except ValueError:
            value = None
        if value not in RETENTION_VALUES:
            where = ENV_RETENTION if len(items) == 1 else f"{ENV_RETENTION}[{i}]"
            raise ConfigError(
                f"{where}={item!r} is not allowed; allowed: {', '.join(map(str, RETENTION_VALUES))}"
            )
        values.append(value)
    return tuple(values)


def check_served_records(field: str, value: str, where: str) -> None:
    """ConfigError naming `where` (the variable, or the run config's field) where the plugin
    cannot serve `value` of retention.`field` (window_records or c128_records)."""
    if value in SERVED_RECORDS[field]:
        return
    why = REFUSED_RECORDS.get((field, value), "")
    raise ConfigError(f"{where}={value} is not served by the SGLang plugin{': ' + why if why else ''}; allowed with "
                      f"SGLang: {', '.join(SERVED_RECORDS[field])}")


def _one_of(env: Mapping[str, str], name: str, allowed: tuple[str, ...]) -> str:
    """Variable `name` of `env`, one of `allowed` (unset or empty: the first)."""
    value = env.get(name, "").strip() or allowed[0]
    if value not in allowed:
        raise ConfigError(f"{name}={value} is not allowed; allowed: {', '.join(allowed)}")
    return value


def parse_state_dtype(text: str) -> str:
    """SGLANG_DSV4_COMPRESS_STATE_DTYPE as SGLang reads it (stripped, any case; unset or
    empty: float32) -> float32 | bfloat16. ConfigError names the variable and what SGLang
    accepts, before SGLang would fail on it inside its pool sizing."""
    value = text.strip().lower() or "float32"
    for name, spellings in STATE_DTYPE_SPELLINGS.items():
        if value in spellings:
            return name
    allowed = ", ".join(s for spellings in STATE_DTYPE_SPELLINGS.values() for s in spellings)
    raise ConfigError(f"{ENV_STATE_DTYPE}={text.strip()} is not allowed; allowed: {allowed}")


def from_env(environ: Mapping[str, str] | None = None) -> Settings:
    """Settings from REMNANT_* variables, checked with the run configs' rules.

    ConfigError (a ValueError) names the variable, its value and what is allowed.
    """
    env = os.environ if environ is None else environ
    mode = env.get(ENV_MODE, "native").strip() or "native"
    parts = {"compressor_state_dtype": parse_state_dtype(env.get(ENV_STATE_DTYPE, "")),
             "index_key_format": _one_of(env, ENV_INDEX_KEY_FORMAT, INDEX_KEY_FORMATS)}
    if not mode_of(mode, ENV_MODE).keeps_retention:
        # Native ignores retention, as run configs do; the other parts hold in every mode.
        return Settings(**parts)
    retention = parse_retention(env.get(ENV_RETENTION, "").strip() or str(KERNEL_RETENTION))
    map_path = env.get(ENV_RETENTION_MAP, "").strip() or None
    if map_path is not None and not os.path.isfile(map_path):
        raise ConfigError(f"{ENV_RETENTION_MAP}={map_path} is not a file")
    policy = env.get(ENV_RETENTION_POLICY, "").strip() or None
    for field, name, allowed in (("window_records", ENV_WINDOW_RECORDS, WINDOW_RECORDS),
                                 ("c128_records", ENV_C128_RECORDS, C128_RECORDS)):
        parts[field] = _one_of(env, name, allowed)
        check_served_records(field, parts[field], name)
    if map_path is None and policy not in (None, "prefix"):
        raise ConfigError(
            f"{ENV_RETENTION_POLICY}={policy} needs calibration captures, which the SGLang server does not take; "
            f"give {ENV_RETENTION_MAP} (built with python -m remnant.cli.build_map) or {ENV_RETENTION_POLICY}=prefix")
    settings = Settings(mode=mode, retention=retention, map_path=map_path, policy=policy, **parts)
    check_packed_rules(mode, list(retention), False, _retention_label(retention))
    return settings


def capture_from_env(settings: Settings, environ: Mapping[str, str] | None = None):
    """The capture settings (CaptureSettings) of the REMNANT_CAPTURE* variables, or None
    without REMNANT_CAPTURE. Capture records native attention, so a packed mode with
    REMNANT_CAPTURE is a ConfigError naming both variables."""
    from remnant.calibration.capture_recorder import ENV_CAPTURE, CaptureSettings

    capture = CaptureSettings.from_env(environ)
    if capture is not None and settings.packed:
        raise ConfigError(f"{ENV_CAPTURE}={capture.path} is not allowed with {ENV_MODE}={settings.mode}; "
                          f"capture runs only with {ENV_MODE}=native (it records the native C4 latents)")
    return capture


def check_sglang_version(version: str) -> None:
    """RuntimeError naming the supported versions unless `version` is one of them."""
    if version not in SUPPORTED_SGLANG_VERSIONS:
        raise RuntimeError(
            f"sglang=={version} is not supported by the Remnant plugin; supported: "
            f"{', '.join(SUPPORTED_SGLANG_VERSIONS)} (its hooks patch that release's internals)"
        )


#: The settings the plugin's hooks act on in this process; set by
#: remnant.sglang.plugin.register (activate).
_active: Settings | None = None


def active() -> Settings:
    """The settings the hooks act on (activate's); RuntimeError before the plugin registered."""
    if _active is None:
        raise RuntimeError("the Remnant plugin is not registered (remnant.sglang.plugin.register was not called)")
    return _active


def activate(s: Settings) -> None:
    """Set the settings the hooks act on (remnant.sglang.plugin.register does this from the
    environment)."""
    global _active
    _active = s

