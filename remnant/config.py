"""Run configuration as plain dataclasses, and the rules that make a run valid.

Hydra composes conf/ into these (cli.py registers them in a ConfigStore so a typo or a
wrong type fails at compose time); everything past cli.py sees only dataclasses. This
module imports no heavy package.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any

from remnant.kv.formats import KERNEL_RETENTION, RETENTION_VALUES
from remnant.kv.retention import POLICIES, profile_values

MODES = ("native", "triton", "kernel")

#: OmegaConf's marker for a value the user must give (kept literal: no OmegaConf import here).
MISSING = "???"


class ConfigError(ValueError):
    """A run configuration a user can fix: the message names field, value and what is allowed."""


@dataclass
class ModeConfig:
    """How C4 records are stored and attended (DESIGN section 4)."""

    name: str = "native"


@dataclass
class RetentionConfig:
    """Coordinates kept per C4 record: uniform `retention`, or one value per CSA layer."""

    name: str = "r256"
    retention: int = 256
    per_layer: list[int] | None = None
    #: A retention map file (remnant/retention-map JSON); without one the engine calibrates
    #: at load and `policy` chooses the kept coordinates.
    map_path: str | None = None
    policy: str = "attention"

    def values(self) -> list[int]:
        return list(self.per_layer) if self.per_layer else [self.retention]


@dataclass
class ModelConfig:
    """A DeepSeek-V4-shaped model for the embedded engine, or a real checkpoint's path.

    The architecture fields use DeepSeek-V4's config.json names. `path` names an existing
    model directory; when unset the embedded host generates one from these fields.
    """

    name: str = "tiny"
    path: str | None = None
    vocab_size: int = 258
    #: Random prompts draw token ids from 0..prompt_vocab_size-1 (ids that decode to text).
    prompt_vocab_size: int = 256
    hidden_size: int = 256
    num_hidden_layers: int = 4
    num_attention_heads: int = 8
    q_lora_rank: int = 128
    intermediate_size: int = 512
    compress_ratios: list[int] = field(default_factory=lambda: [0, 4, 128, 4])
    window_size: int = 128
    index_n_heads: int = 4
    index_head_dim: int = 128
    index_topk: int = 64
    max_position_embeddings: int = 65536
    rope_theta: int = 10000
    compress_rope_theta: int = 40000
    seed: int = 0


@dataclass
class WorkloadConfig:
    """Common fields of every workload; `kind` picks the implementation."""

    name: str = MISSING
    kind: str = MISSING
    seed: int = 0
    concurrency: int = 4
    flush_timeout_s: float = 60.0
    request_timeout_s: float = 600.0


@dataclass
class RandomWorkloadConfig(WorkloadConfig):
    """Random token ids: C warm-up requests, then 3C measured (counts overridable).

    Lengths are drawn uniformly from [len * range_ratio, len]; range_ratio=1 fixes them.
    """

    name: str = "random"
    kind: str = "random"
    input_len: int = 256
    output_len: int = 32
    range_ratio: float = 1.0
    warmup_requests: int | None = None
    measured_requests: int | None = None

    def counts(self) -> tuple[int, int]:
        warmup = self.concurrency if self.warmup_requests is None else self.warmup_requests
        measured = 3 * self.concurrency if self.measured_requests is None else self.measured_requests
        return warmup, measured


@dataclass
class SharedPrefixWorkloadConfig(WorkloadConfig):
    """G prefix groups: each request is its group's prefix plus a unique suffix.

    Warm-up sends one request per group after a cache flush; the measured requests
    (requests_per_group per group, shuffled) then run on the warm cache, so the cache-hit
    rate shows whether the groups' working set fits in the KV pool.
    """

    name: str = "shared_prefix"
    kind: str = "shared_prefix"
    concurrency: int = 16
    groups: int = 16
    prefix_len: int = 1024
    suffix_len: int = 64
    output_len: int = 16
    requests_per_group: int = 4


@dataclass
class ShareGPTWorkloadConfig(WorkloadConfig):
    """Conversations from a ShareGPT-format JSON file (never downloaded).

    The first human turn is the prompt and the first reply's token count the output length
    (or output_len when set), as sglang.bench_serving samples ShareGPT; prompts are
    truncated to max_input_len tokens and outputs capped at max_output_len. C warm-up
    requests, then num_prompts measured, cache flushed before each phase.
    """

    name: str = "sharegpt"
    kind: str = "sharegpt"
    dataset_path: str = MISSING
    num_prompts: int = 12
    max_input_len: int = 1024
    max_output_len: int = 128
    output_len: int | None = None


@dataclass
class LongContextWorkloadConfig(WorkloadConfig):
    """Long random prompts: input_len in, output_len out, at a fixed concurrency or at the
    allocator ceiling (the most requests the server's max_total_num_tokens holds at once,
    read from /server_info per mode and recorded)."""

    name: str = "long_context"
    kind: str = "long_context"
    concurrency: int = 24
    input_len: int = 131072
    output_len: int = 8192
    at_ceiling: bool = False
    requests_per_slot: int = 1


@dataclass
class LongSWEWorkloadConfig(WorkloadConfig):
    """Recorded multi-turn sessions replayed by `concurrency` active users.

    Sessions come from sessions_path (remnant/sessions JSON), from trace_path (a
    Mooncake-style JSONL trace, imported), or from the synthetic generator. Each user
    replays one session's turns in order, the next turn starting when the previous answer
    ends (plus recorded think time); a user whose session ends takes the next session.
    token_scale shrinks recorded lengths (for small engines); replay_timestamps also holds
    each turn until its recorded time. The first warmup_sessions sessions warm up.
    """

    name: str = "longswe"
    kind: str = "longswe"
    concurrency: int = 24
    sessions_path: str | None = None
    trace_path: str | None = None
    num_sessions: int = 48
    warmup_sessions: int = 4
    #: Replay only sessions with at least this many turns (traces mix in single requests).
    min_turns: int = 1
    token_scale: float = 1.0
    max_input_len: int = 1048576
    replay_timestamps: bool = False
    synthetic_turns: list[int] = field(default_factory=lambda: [3, 6])
    synthetic_initial_tokens: list[int] = field(default_factory=lambda: [2048, 8192])
    synthetic_turn_tokens: list[int] = field(default_factory=lambda: [256, 2048])
    synthetic_output_tokens: list[int] = field(default_factory=lambda: [64, 512])


@dataclass
class HostConfig:
    kind: str = MISSING


@dataclass
class EmbeddedHostConfig(HostConfig):
    """remnant-serve in a child process on a free loopback port."""

    kind: str = "embedded"
    startup_timeout_s: float = 120.0
    threads: int = 2
    log_tail_lines: int = 40
    #: Bytes for every KV pool together (SGLang sizes pools from what the GPU has left).
    kv_budget_mib: float = 96.0
    max_running_requests: int = 32
    page_size: int = 256
    swa_ratio: float = 0.1
    chunked_prefill_size: int = 512
    prefix_cache: bool = True


@dataclass
class ExternalHostConfig(HostConfig):
    """A server that is already running; never started or stopped."""

    kind: str = "external"
    base_url: str = MISSING
    health_timeout_s: float = 30.0


@dataclass
class RunConfig:
    mode: ModeConfig = field(default_factory=ModeConfig)
    retention: RetentionConfig = field(default_factory=RetentionConfig)
    workload: Any = MISSING
    host: Any = MISSING
    model: ModelConfig = field(default_factory=ModelConfig)
    #: The run's seed; conf/workload/*.yaml take workload.seed from it.
    seed: int = 0
    #: SGLang's hierarchical cache; any layer with retention != 256 requires it off.
    hicache: bool = False
    #: Extra caveats a reader of this run must see, added to run.json's limits.
    limits: list[str] = field(default_factory=list)
    #: Run a sweep cell again even when its run.json says completed.
    force: bool = False


def csa_layer_count(model: ModelConfig) -> int:
    return sum(1 for r in model.compress_ratios if r == 4)


def validate(cfg: RunConfig) -> None:
    """Enforce the mode/retention rules of DESIGN section 4 and the fields' ranges;
    raise ConfigError naming the first field that breaks one."""
    mode = cfg.mode.name
    if mode not in MODES:
        raise ConfigError(f"mode={mode} is not a mode; allowed: {', '.join(MODES)}")
    validate_model(cfg.model)
    validate_workload(cfg.workload)
    validate_host(cfg.host)
    if mode == "native":
        return  # native ignores retention
    ret = cfg.retention
    if ret.per_layer is not None:
        n_csa = csa_layer_count(cfg.model)
        if len(ret.per_layer) != n_csa:
            raise ConfigError(
                f"retention.per_layer has {len(ret.per_layer)} values; model={cfg.model.name} "
                f"has {n_csa} CSA layers, so it needs {n_csa}"
            )
        try:
            profile_values(None, list(ret.per_layer), n_csa)
        except ValueError as exc:
            raise ConfigError(f"retention.{exc}") from None
    if ret.map_path is not None and not os.path.isfile(ret.map_path):
        raise ConfigError(f"retention.map_path={ret.map_path} is not a file")
    if ret.policy not in POLICIES:
        raise ConfigError(f"retention.policy={ret.policy} is not a policy; allowed: {', '.join(POLICIES)}")
    elif ret.retention not in RETENTION_VALUES:
        raise ConfigError(f"retention={ret.retention} is not allowed; allowed: {', '.join(map(str, RETENTION_VALUES))}")
    if mode == "kernel" and any(v != KERNEL_RETENTION for v in ret.values()):
        bad = next(v for v in ret.values() if v != KERNEL_RETENTION)
        raise ConfigError(
            f"retention={bad} is not allowed with mode=kernel; kernel supports retention={KERNEL_RETENTION}"
        )
    if cfg.hicache and any(v != KERNEL_RETENTION for v in ret.values()):
        raise ConfigError(
            f"hicache=true is not allowed with retention={ret.name}; "
            f"retention other than {KERNEL_RETENTION} requires hicache=false"
        )


def _positive_finite(value: float, field: str) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ConfigError(f"{field}={value} must be a finite number > 0")


def validate_workload(w: WorkloadConfig) -> None:
    _positive_finite(w.request_timeout_s, "workload.request_timeout_s")
    _positive_finite(w.flush_timeout_s, "workload.flush_timeout_s")
    if w.concurrency < 1:
        raise ConfigError(f"workload.concurrency={w.concurrency} must be >= 1")
    for name in ("groups", "prefix_len", "suffix_len", "output_len", "requests_per_group", "num_prompts",
                 "max_input_len", "max_output_len", "input_len", "requests_per_slot", "num_sessions", "min_turns"):
        value = getattr(w, name, None)
        if value is not None and value < 1:
            raise ConfigError(f"workload.{name}={value} must be >= 1")
    scale = getattr(w, "token_scale", None)
    if scale is not None:
        _positive_finite(scale, "workload.token_scale")
    for name in ("warmup_requests", "measured_requests", "warmup_sessions"):
        value = getattr(w, name, None)
        if value is not None and value < 0:
            raise ConfigError(f"workload.{name}={value} must be >= 0")


def validate_host(h: HostConfig) -> None:
    if h.kind == "external":
        from urllib.parse import urlsplit

        try:
            url = urlsplit(h.base_url)
            ok = url.scheme in ("http", "https") and bool(url.hostname) and (url.port or True)
        except ValueError:
            ok = False
        if not ok:
            raise ConfigError(f"host.base_url={h.base_url} is not an http(s) URL like http://127.0.0.1:30000")
    if h.kind == "embedded":
        _positive_finite(h.startup_timeout_s, "host.startup_timeout_s")
        _positive_finite(h.kv_budget_mib, "host.kv_budget_mib")
        if h.page_size % 128 or h.page_size < 128:
            raise ConfigError(f"host.page_size={h.page_size} must be a positive multiple of 128")
        if not 0 < h.swa_ratio <= 1:
            raise ConfigError(f"host.swa_ratio={h.swa_ratio} must be in (0, 1]")
        if h.max_running_requests < 1:
            raise ConfigError(f"host.max_running_requests={h.max_running_requests} must be >= 1")


def validate_model(model: ModelConfig) -> None:
    for i, ratio in enumerate(model.compress_ratios):
        if ratio not in (0, 4, 128):
            raise ConfigError(
                f"model.compress_ratios[{i}]={ratio} is not allowed; allowed: 0 (window only), 4 (CSA), 128 (HCA)"
            )
    if len(model.compress_ratios) != model.num_hidden_layers:
        raise ConfigError(
            f"model.compress_ratios has {len(model.compress_ratios)} values; "
            f"model.num_hidden_layers={model.num_hidden_layers} needs one per layer"
        )


def recorded_config(cfg: RunConfig) -> dict:
    """The resolved config as run.json records it: native records no retention."""
    import dataclasses

    d = dataclasses.asdict(cfg)
    if cfg.mode.name == "native":
        d["retention"] = None
    return d
