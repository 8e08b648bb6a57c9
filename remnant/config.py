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
    #: Tensor-parallel GPUs a real server shards the model over (SGLang's --tp-size).
    tp_size: int = 1
    #: Server arguments this model needs (SGLang flags; host=local appends them).
    server_args: list[str] = field(default_factory=list)


@dataclass
class WorkloadConfig:
    """Common fields of every workload; `kind` picks the implementation."""

    name: str = MISSING
    kind: str = MISSING
    seed: int = 0
    concurrency: int = 4
    flush_timeout_s: float = 60.0
    #: Per read: the longest one request may wait for its next bytes.
    request_timeout_s: float = 600.0
    #: The no-progress watchdog: while requests are in flight and none of them has given a
    #: token (or ended) for this long, the server has stalled: the run stops sending,
    #: cancels what is in flight and ends failed (stage client, stall).
    stall_timeout_s: float = 120.0
    #: The longest the client may drive the server, all phases and flushes together; past
    #: it the run ends failed (stage client, deadline). null: no deadline.
    deadline_s: float | None = None
    #: A run whose measured requests failed at more than this share (0..1) ends degraded,
    #: not completed.
    max_failed_share: float = 0.1


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


#: Values of EmbeddedHostConfig.device and .decode_path (remnant.engine.model checks them too).
ENGINE_DEVICES = ("cpu", "cuda")
DECODE_PATHS = ("auto", "reference", "kernels")
#: Values of EmbeddedHostConfig.native_decode (remnant.kernels.flashmla.NATIVE_KERNELS).
NATIVE_DECODES = ("auto", "flashmla", "triton")


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
    #: Where the engine's weights and KV pools live: cpu or cuda (one GPU).
    device: str = "cpu"
    #: How decode steps attend: reference (torch), kernels (remnant.kernels' Triton decode,
    #: store and reconstruct), or auto (kernels on cuda, reference on cpu).
    decode_path: str = "auto"
    #: Which kernel decode steps on the kernels path run over native records (native and
    #: triton modes, window-only and HCA layers): flashmla (FlashMLA's V4 decode, as SGLang
    #: runs; needs sgl-flash-mla, an SM90/SM100 GPU and 64 or 128 heads), triton (Remnant's
    #: Triton native kernel), or auto (flashmla where it runs, else triton: run.json's
    #: limits say so).
    native_decode: str = "auto"


@dataclass
class ExternalHostConfig(HostConfig):
    """A server that is already running; never started or stopped."""

    kind: str = "external"
    base_url: str = MISSING
    health_timeout_s: float = 30.0


@dataclass
class LocalHostConfig(HostConfig):
    """A Docker container on this Linux host, from the image runners/docker/Dockerfile builds.

    `server` picks what the image serves: sglang (SGLang with Remnant's plugin, on the GPUs
    in `gpus`) or embedded (remnant-serve, CPU). The image is tagged by a hash of its build
    context and built when missing (or always, with rebuild=true).
    """

    kind: str = "local"
    server: str = "sglang"
    #: The image the Dockerfile builds on (BASE_IMAGE): a tag or a digest.
    base_image: str = "lmsysorg/sglang:v0.5.18"
    rebuild: bool = False
    #: GPU ids as this host numbers them, comma-separated ("0,1,2,3"); empty: no GPU.
    gpus: str = ""
    shm_size: str = "32g"
    #: The server's port and the distributed rendezvous port (SGLang's NCCL port), on
    #: this host's network; 0 picks a free one.
    port: int = 0
    master_port: int = 0
    startup_timeout_s: float = 1800.0
    stop_timeout_s: float = 30.0
    log_tail_lines: int = 40
    #: Shell command run before the container starts, e.g. to reserve the GPUs of a shared
    #: node; GPUS and REMNANT_RUN_ID are in its environment, a non-zero exit stops the run.
    reserve_command: str | None = None
    #: Extra environment of the server (SGLANG_* switches, HF_TOKEN, ...).
    env: dict[str, str] = field(default_factory=dict)
    #: Server arguments after the model's server_args.
    server_args: list[str] = field(default_factory=list)

    def gpu_ids(self) -> list[int]:
        """`gpus` as a list of ids; raises ConfigError naming the field when it is not one."""
        text = str(self.gpus).strip()
        if not text:
            return []
        parts = [p.strip() for p in text.split(",")]
        if not all(p.isdigit() for p in parts) or len(set(parts)) != len(parts):
            raise ConfigError(f"host.gpus={self.gpus} is not a list of distinct GPU ids like 0,1,2,3 (GPUS)")
        return [int(p) for p in parts]


LOCAL_SERVERS = ("sglang", "embedded")


@dataclass
class ModalHostConfig(HostConfig):
    """The same SGLang server on Modal GPUs (runners/modal/app.py), reached through a tunnel.

    The fields from `app_name` to `port` are the app's settings (runners/modal/app.py
    `Settings`, same names): the host deploys the app with them. Planned GPU time is
    gpu_count x serve_timeout_s (Modal stops `serve` at its timeout), and
    kernels_gpu_count x kernels_timeout_s for `benchmark_kernels`; a plan over
    budget_gpu_hours is refused before anything starts.
    """

    kind: str = "modal"
    app_name: str = "remnant"
    gpu: str = "H100"
    #: GPUs of `serve`, and SGLang's --tp-size (model.tp_size must match).
    gpu_count: int = 4
    serve_timeout_s: int = 7200
    kernels_gpu_count: int = 1
    kernels_timeout_s: int = 1800
    download_timeout_s: int = 14400
    inspect_timeout_s: int = 300
    budget_gpu_hours: float = 8.0
    model_repo: str = "deepseek-ai/DeepSeek-V4-Flash"
    #: The checkpoint's commit on the hub; `serve` refuses to start without one.
    model_revision: str | None = None
    model_volume: str = "remnant-models"
    runs_volume: str = "remnant-runs"
    base_image: str = "lmsysorg/sglang:v0.5.18"
    port: int = 30000
    #: `modal deploy` the app before the run (quick when nothing changed); false reuses
    #: the deployed app, which must have been deployed with the same settings.
    deploy: bool = True
    #: Modal environment (null: the profile's default).
    environment: str | None = None
    #: runners/modal/app.py of a remnant checkout (null: the one remnant is imported from).
    app_path: str | None = None
    #: Until /health answers through the tunnel: container start, weights, CUDA graphs.
    startup_timeout_s: float = 1800.0
    log_tail_lines: int = 40
    #: Extra environment of the server (SGLANG_* switches, ...).
    env: dict[str, str] = field(default_factory=dict)
    #: Server arguments after the model's server_args.
    server_args: list[str] = field(default_factory=list)

    def planned_gpu_hours(self) -> dict[str, float]:
        """GPU-hours each GPU function may bill at most: GPUs x timeout."""
        return {"serve": self.gpu_count * self.serve_timeout_s / 3600,
                "benchmark_kernels": self.kernels_gpu_count * self.kernels_timeout_s / 3600}


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
    if cfg.seed < 0:
        raise ConfigError(f"seed={cfg.seed} must be >= 0 (numpy's generators take non-negative seeds)")
    validate_model(cfg.model)
    validate_workload(cfg.workload)
    validate_context(cfg.workload, cfg.model)
    validate_host(cfg.host)
    if cfg.host.kind == "local":
        validate_local(cfg.host, cfg.model)
    if cfg.host.kind == "modal":
        validate_modal(cfg.host)
    if mode == "native":
        return  # native ignores retention
    ret = cfg.retention
    serves_sglang = cfg.host.kind == "modal" or (cfg.host.kind == "local" and cfg.host.server == "sglang")
    if serves_sglang and ret.map_path is None and ret.policy != "prefix":
        # The SGLang plugin cannot calibrate at load as the embedded engine does.
        raise ConfigError(
            f"retention.policy={ret.policy} needs calibration, which host={cfg.host.kind} (SGLang) cannot do at load; "
            "give retention.map_path (a map built with python -m remnant.kv.build_map) or retention.policy=prefix"
        )
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
    check_packed_rules(mode, ret.values(), cfg.hicache, ret.name)


def check_packed_rules(mode: str, values: list[int], hicache: bool, name: str) -> None:
    """DESIGN section 4's rules for the packed modes, shared by run configs and the SGLang
    plugin: kernel supports R=256 only; any layer with R != 256 requires HiCache off.

    values: R per CSA layer (or one uniform R); name: how the retention is called in errors.
    """
    if mode == "kernel" and any(v != KERNEL_RETENTION for v in values):
        bad = next(v for v in values if v != KERNEL_RETENTION)
        raise ConfigError(
            f"retention={bad} is not allowed with mode=kernel; kernel supports retention={KERNEL_RETENTION}"
        )
    if hicache and any(v != KERNEL_RETENTION for v in values):
        raise ConfigError(
            f"hicache=true is not allowed with retention={name}; "
            f"retention other than {KERNEL_RETENTION} requires hicache=false"
        )


def _positive_finite(value: float, field: str) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ConfigError(f"{field}={value} must be a finite number > 0")


def _at_least(obj: object, prefix: str, names: tuple[str, ...], minimum: int) -> None:
    """Integer fields of `obj` that must be >= minimum (None, where a field allows it, passes)."""
    for name in names:
        value = getattr(obj, name, None)
        if value is not None and value < minimum:
            raise ConfigError(f"{prefix}{name}={value} must be >= {minimum}")


def _range_pair(value: list[int], field: str) -> None:
    """A [low, high] range of token counts or turns."""
    if len(value) != 2 or not 1 <= value[0] <= value[1]:
        raise ConfigError(f"{field}={list(value)} must be [low, high] with 1 <= low <= high")


def validate_workload(w: WorkloadConfig) -> None:
    _positive_finite(w.request_timeout_s, "workload.request_timeout_s")
    _positive_finite(w.flush_timeout_s, "workload.flush_timeout_s")
    _positive_finite(w.stall_timeout_s, "workload.stall_timeout_s")
    if w.deadline_s is not None:
        _positive_finite(w.deadline_s, "workload.deadline_s")
    if not (math.isfinite(w.max_failed_share) and 0 <= w.max_failed_share <= 1):
        raise ConfigError(f"workload.max_failed_share={w.max_failed_share} must be a share in [0, 1]")
    _at_least(w, "workload.", ("seed",), 0)
    _at_least(w, "workload.", ("concurrency", "groups", "prefix_len", "suffix_len", "output_len",
                               "requests_per_group", "num_prompts", "max_input_len", "max_output_len", "input_len",
                               "requests_per_slot", "num_sessions", "min_turns"), 1)
    scale = getattr(w, "token_scale", None)
    if scale is not None:
        _positive_finite(scale, "workload.token_scale")
    ratio = getattr(w, "range_ratio", None)
    if ratio is not None and not (math.isfinite(ratio) and 0 < ratio <= 1):
        raise ConfigError(f"workload.range_ratio={ratio} must be in (0, 1]")
    _at_least(w, "workload.", ("warmup_requests", "measured_requests", "warmup_sessions"), 0)
    for name in ("synthetic_turns", "synthetic_initial_tokens", "synthetic_turn_tokens", "synthetic_output_tokens"):
        value = getattr(w, name, None)
        if value is not None:
            _range_pair(value, f"workload.{name}")


def request_tokens(w: WorkloadConfig) -> tuple[int, str] | None:
    """The most tokens (prompt + output) one request of `w` can need, as far as the config
    fixes it, and the fields that set it; None where only the data does (longswe)."""
    if w.kind in ("random", "long_context"):
        return w.input_len + w.output_len, f"workload.input_len={w.input_len} + workload.output_len={w.output_len}"
    if w.kind == "shared_prefix":
        return (w.prefix_len + w.suffix_len + w.output_len,
                f"workload.prefix_len={w.prefix_len} + workload.suffix_len={w.suffix_len} + "
                f"workload.output_len={w.output_len}")
    if w.kind == "sharegpt":
        out = w.max_output_len if w.output_len is None else min(w.output_len, w.max_output_len)
        return w.max_input_len + out, f"workload.max_input_len={w.max_input_len} + {out} output tokens"
    return None


def validate_context(w: WorkloadConfig, model: ModelConfig) -> None:
    """A request longer than the model's context would be refused by every server; say so
    before a plan of millions of tokens is drawn."""
    need = request_tokens(w)
    if need is not None and need[0] > model.max_position_embeddings:
        raise ConfigError(
            f"{need[1]} = {need[0]} tokens per request is more than model={model.name}'s context length "
            f"(model.max_position_embeddings={model.max_position_embeddings}); shorten the requests or "
            f"choose a model with a longer context")


def validate_host(h: HostConfig) -> None:
    _at_least(h, "host.", ("log_tail_lines",), 0)
    if h.kind == "external":
        from urllib.parse import urlsplit

        try:
            url = urlsplit(h.base_url)
            ok = url.scheme in ("http", "https") and bool(url.hostname) and (url.port or True)
        except ValueError:
            ok = False
        if not ok:
            raise ConfigError(f"host.base_url={h.base_url} is not an http(s) URL like http://127.0.0.1:30000")
        _positive_finite(h.health_timeout_s, "host.health_timeout_s")
    if h.kind == "embedded":
        _positive_finite(h.startup_timeout_s, "host.startup_timeout_s")
        _positive_finite(h.kv_budget_mib, "host.kv_budget_mib")
        _at_least(h, "host.", ("threads", "max_running_requests"), 1)
        if h.page_size % 128 or h.page_size < 128:
            raise ConfigError(f"host.page_size={h.page_size} must be a positive multiple of 128")
        if not (math.isfinite(h.swa_ratio) and 0 < h.swa_ratio <= 1):
            raise ConfigError(f"host.swa_ratio={h.swa_ratio} must be in (0, 1]")
        if h.chunked_prefill_size < 1:
            # 0 would give every prefill step no tokens: the engine would spin, never answering.
            raise ConfigError(f"host.chunked_prefill_size={h.chunked_prefill_size} must be >= 1 "
                              "(prompt tokens per engine step)")
        if h.device not in ENGINE_DEVICES:
            raise ConfigError(f"host.device={h.device} is not allowed; allowed: {', '.join(ENGINE_DEVICES)}")
        if h.decode_path not in DECODE_PATHS:
            raise ConfigError(f"host.decode_path={h.decode_path} is not allowed; allowed: {', '.join(DECODE_PATHS)}")
        if h.native_decode not in NATIVE_DECODES:
            raise ConfigError(f"host.native_decode={h.native_decode} is not allowed; allowed: "
                              f"{', '.join(NATIVE_DECODES)}")
        if h.native_decode == "flashmla" and h.device == "cpu":
            raise ConfigError("host.native_decode=flashmla needs host.device=cuda (FlashMLA runs on SM90/SM100 GPUs); "
                              "use native_decode=auto or triton")
        if h.decode_path == "kernels" and h.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            # The server would refuse it at start; say so before one is launched.
            raise ConfigError("host.decode_path=kernels with host.device=cpu needs TRITON_INTERPRET=1 in the "
                              "environment (Triton's interpreter); use host.device=cuda, or decode_path=auto")


def validate_local(h: LocalHostConfig, model: ModelConfig) -> None:
    """host=local's fields, and what its server needs of the model."""
    import re

    if h.server not in LOCAL_SERVERS:
        raise ConfigError(f"host.server={h.server} is not a server; allowed: {', '.join(LOCAL_SERVERS)}")
    if not str(h.base_image).strip():
        raise ConfigError("host.base_image is empty; give an image tag or digest like lmsysorg/sglang:v0.5.18")
    gpus = h.gpu_ids()
    for name in ("port", "master_port"):
        value = getattr(h, name)
        if not 0 <= value <= 65535:
            raise ConfigError(f"host.{name}={value} must be a port in 1..65535, or 0 for a free one")
    if h.port and h.port == h.master_port:
        raise ConfigError(f"host.master_port={h.master_port} is host.port too; they must differ")
    if not re.fullmatch(r"[1-9][0-9]*[bkmg]?", str(h.shm_size)):
        raise ConfigError(f"host.shm_size={h.shm_size} is not a size like 32g, 512m")
    _positive_finite(h.startup_timeout_s, "host.startup_timeout_s")
    _positive_finite(h.stop_timeout_s, "host.stop_timeout_s")
    if model.tp_size < 1:
        raise ConfigError(f"model.tp_size={model.tp_size} must be >= 1")
    if model.path is not None and not os.path.isdir(model.path):
        raise ConfigError(f"model.path={model.path} is not a directory (MODEL_PATH)")
    if h.server == "sglang":
        if model.path is None:
            raise ConfigError(
                f"model.path is not set; host.server=sglang serves a checkpoint: set MODEL_PATH "
                f"(or model.path=...) to model={model.name}'s directory"
            )
        if len(gpus) != model.tp_size:
            raise ConfigError(
                f"host.gpus={h.gpus or '(none)'} gives {len(gpus)} GPUs; model={model.name} has "
                f"tp_size={model.tp_size}, so it needs {model.tp_size} (GPUS=0,1,2,3 style)"
            )


def validate_modal(h: ModalHostConfig) -> None:
    """host=modal's fields and its budget guard: the planned GPU-hours must fit the budget."""
    _at_least(h, "host.", ("gpu_count", "kernels_gpu_count", "serve_timeout_s", "kernels_timeout_s",
                           "download_timeout_s", "inspect_timeout_s"), 1)
    _positive_finite(h.startup_timeout_s, "host.startup_timeout_s")
    _positive_finite(h.budget_gpu_hours, "host.budget_gpu_hours")
    if not 1 <= h.port <= 65535:
        raise ConfigError(f"host.port={h.port} must be a port in 1..65535")
    for function, (count, timeout) in {"serve": ("gpu_count", "serve_timeout_s"),
                                       "benchmark_kernels": ("kernels_gpu_count", "kernels_timeout_s")}.items():
        planned = h.planned_gpu_hours()[function]
        if planned > h.budget_gpu_hours:
            raise ConfigError(
                f"host.{count}={getattr(h, count)} x host.{timeout}={getattr(h, timeout)} plans "
                f"{planned:.2f} GPU-hours for {function}, over host.budget_gpu_hours={h.budget_gpu_hours:g}; "
                f"lower host.{timeout} or raise host.budget_gpu_hours"
            )


#: Layer widths of a DeepSeek-V4-shaped model are whole 64-wide tiles (V4-Flash: hidden
#: 4096, q_lora_rank 1024, intermediate 2048, indexer heads 128 wide), as the GPU kernels
#: and FlashMLA tile them.
WIDTH_TILE = 64
#: Token ids the generated model directory's tokenizer needs (256 bytes, BOS, EOS):
#: remnant.engine.model_dir.EOS_ID + 1.
GENERATED_VOCAB_MIN = 258


def validate_model(model: ModelConfig) -> None:
    _at_least(model, "model.", ("num_hidden_layers", "num_attention_heads", "index_n_heads", "index_topk",
                                "window_size", "max_position_embeddings", "tp_size", "prompt_vocab_size"), 1)
    _at_least(model, "model.", ("seed",), 0)
    for name in ("hidden_size", "q_lora_rank", "index_head_dim"):
        value = getattr(model, name)
        if value < WIDTH_TILE or value % WIDTH_TILE:
            raise ConfigError(f"model.{name}={value} must be a positive multiple of {WIDTH_TILE}")
    if model.intermediate_size < 0 or model.intermediate_size % WIDTH_TILE:
        raise ConfigError(f"model.intermediate_size={model.intermediate_size} must be a multiple of {WIDTH_TILE} "
                          "(0: no feed-forward, attention only)")
    for name in ("rope_theta", "compress_rope_theta"):
        _positive_finite(getattr(model, name), f"model.{name}")
    if model.path is None and model.vocab_size < GENERATED_VOCAB_MIN:
        raise ConfigError(f"model.vocab_size={model.vocab_size} is too small for the generated model directory; "
                          f"its tokenizer needs >= {GENERATED_VOCAB_MIN}")
    if model.prompt_vocab_size > model.vocab_size:
        raise ConfigError(f"model.prompt_vocab_size={model.prompt_vocab_size} must be <= "
                          f"model.vocab_size={model.vocab_size}")
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
