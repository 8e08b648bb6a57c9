"""What a host that starts SGLang with Remnant's plugin (host=local with server=sglang,
host=modal) passes it: the plugin's settings (remnant.sglang.settings.Settings, whose
to_env the server's environment takes) from the run's ServerSpec and the host's fields for
the KV parts beyond C4 that SGLang 0.5.18 stores itself.

The embedded host names those parts in remnant.engine.args.EngineArgs
(host.compressor_state_dtype); SGLangKVFields gives SGLang hosts the same fields, so one
override means one thing on every host. Plain Python: no torch, no sglang.
"""

from __future__ import annotations

from dataclasses import dataclass

from remnant.config_errors import ConfigError
from remnant.hosts.base import ServerSpec

#: The compressors' state dtypes (remnant.engine.capacity.STATE_DTYPES' names).
STATE_DTYPE_NAMES = ("float32", "bfloat16")


@dataclass
class SGLangKVFields:
    """The KV parts SGLang stores as a server setting, as host.* fields.

    compressor_state_dtype: float32 (SGLang's default) or bfloat16, which the server gets as
    SGLang's own SGLANG_DSV4_COMPRESS_STATE_DTYPE (its state pools' dtype and its pool
    sizing both follow it), in every mode.
    """

    compressor_state_dtype: str = "float32"

    def validate_kv_fields(self, env: dict, passes: bool, why_not: str = "") -> None:
        """ConfigError naming the field where a value is not allowed, where this host's
        server (passes False: `why_not` says which) would not get it, or where host.env
        sets the same switch (the run would record one value and serve another)."""
        from remnant.sglang.settings import ENV_STATE_DTYPE

        if ENV_STATE_DTYPE in env:
            raise ConfigError(f"host.env sets {ENV_STATE_DTYPE}; give host.compressor_state_dtype instead (the run "
                              "records it and passes it on)")
        if self.compressor_state_dtype not in STATE_DTYPE_NAMES:
            raise ConfigError(f"host.compressor_state_dtype={self.compressor_state_dtype} is not allowed; allowed: "
                              f"{', '.join(STATE_DTYPE_NAMES)}")
        if not passes and self.compressor_state_dtype != "float32":
            raise ConfigError(f"host.compressor_state_dtype={self.compressor_state_dtype} is not passed to {why_not}; "
                              "allowed there: float32")


def plugin_settings(spec: ServerSpec, fields: SGLangKVFields, map_path: str | None):
    """The plugin's Settings for `spec` on a host with `fields`; map_path: where the server
    finds the retention map (the host mounts or writes it), None without one."""
    from remnant.sglang.settings import Settings

    ret = spec.retention
    if ret is None:
        return Settings(spec.mode, compressor_state_dtype=fields.compressor_state_dtype)
    return Settings(spec.mode, tuple(ret.values()), map_path if ret.map_path else None, ret.policy,
                    compressor_state_dtype=fields.compressor_state_dtype)
