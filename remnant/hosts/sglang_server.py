"""What a host that starts SGLang with Remnant's plugin (host=local with server=sglang,
host=modal) passes it: the plugin's settings (remnant.sglang.settings.Settings, whose
to_env the server's environment takes) from the run's ServerSpec and the host's fields for
the KV parts beyond C4 that SGLang 0.5.18 stores itself, and the server arguments those
need (sglang_server_args).

The embedded host names those parts in remnant.engine.args.EngineArgs
(host.compressor_state_dtype, host.index_key_format); SGLangKVFields gives SGLang hosts
the same fields, so one override means one thing on every host. Plain Python: no torch,
no sglang.
"""

from __future__ import annotations

from dataclasses import dataclass

from remnant.config_errors import ConfigError
from remnant.hosts.base import ServerSpec

#: The compressors' state dtypes (remnant.engine.capacity.STATE_DTYPES' names).
STATE_DTYPE_NAMES = ("float32", "bfloat16")
#: SGLang's switch of MXFP4 indexer keys (server_args.py; SM100/SM120 GPUs only).
FP4_INDEXER_FLAG = "--enable-deepseek-v4-fp4-indexer"


@dataclass
class SGLangKVFields:
    """The KV parts SGLang stores as a server setting, as host.* fields.

    compressor_state_dtype: float32 (SGLang's default) or bfloat16, which the server gets as
    SGLang's own SGLANG_DSV4_COMPRESS_STATE_DTYPE (its state pools' dtype and its pool
    sizing both follow it), in every mode.
    index_key_format: fp8 (SGLang's default) or mxfp4, which the server gets as SGLang's
    --enable-deepseek-v4-fp4-indexer and the plugin as REMNANT_INDEX_KEY_FORMAT (its pool
    sizing then counts the 68-byte keys SGLang stores), in every mode.
    """

    compressor_state_dtype: str = "float32"
    index_key_format: str = "fp8"

    def validate_kv_fields(self, env: dict, server_args: list, passes: bool, why_not: str = "") -> None:
        """ConfigError naming the field where a value is not allowed, where this host's
        server (passes False: `why_not` says which) would not get it, or where host.env or
        host.server_args set the same switch (the run would record one value and serve
        another)."""
        from remnant.kv.formats import INDEX_KEY_FORMATS
        from remnant.sglang.settings import ENV_INDEX_KEY_FORMAT, ENV_STATE_DTYPE

        for name, field in ((ENV_STATE_DTYPE, "compressor_state_dtype"), (ENV_INDEX_KEY_FORMAT, "index_key_format")):
            if name in env:
                raise ConfigError(f"host.env sets {name}; give host.{field} instead (the run records it and passes "
                                  "it on)")
        if FP4_INDEXER_FLAG in server_args:
            raise ConfigError(f"host.server_args holds {FP4_INDEXER_FLAG}; give host.index_key_format=mxfp4 instead "
                              "(the run records it, and the plugin's pool sizing counts the keys it stores)")
        for field, allowed in (("compressor_state_dtype", STATE_DTYPE_NAMES), ("index_key_format", INDEX_KEY_FORMATS)):
            value = getattr(self, field)
            if value not in allowed:
                raise ConfigError(f"host.{field}={value} is not allowed; allowed: {', '.join(allowed)}")
            if not passes and value != allowed[0]:
                raise ConfigError(f"host.{field}={value} is not passed to {why_not}; allowed there: {allowed[0]}")

    def sglang_server_args(self) -> list[str]:
        """SGLang's own arguments for these fields (after the model's and the host's)."""
        return [FP4_INDEXER_FLAG] if self.index_key_format == "mxfp4" else []


def plugin_settings(spec: ServerSpec, fields: SGLangKVFields, map_path: str | None):
    """The plugin's Settings for `spec` on a host with `fields`; map_path: where the server
    finds the retention map (the host mounts or writes it), None without one."""
    from remnant.sglang.settings import Settings

    ret = spec.retention
    parts = {"compressor_state_dtype": fields.compressor_state_dtype, "index_key_format": fields.index_key_format}
    if ret is None:
        return Settings(spec.mode, **parts)
    return Settings(spec.mode, tuple(ret.values()), map_path if ret.map_path else None, ret.policy, **parts,
                    window_records=ret.window_records, c128_records=ret.c128_records)
