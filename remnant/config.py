"""Run configuration as plain dataclasses, and the rules that span config groups.

Hydra composes conf/ into these (cli.py registers them in a ConfigStore so a typo or a
wrong type fails at compose time); everything past cli.py sees only dataclasses.

The groups whose options pick an implementation (workload, host) are open: each kind's
config class lives in its own module, remnant/workloads/<kind>.py or
remnant/hosts/<kind>.py, extends its group's base class beside the group's other
foundations (WorkloadConfig in remnant/workloads/base.py, HostConfig in
remnant/hosts/base.py) and registers in that module's Kinds registry (WORKLOADS, HOSTS)
with its `kind`; it bounds its own fields (`validate`) and builds what it names (a
workload's plan, a host). This module holds the registry class, the closed groups (mode,
retention, model, capture), RunConfig and the rules that read more than one group; it
imports none of hosts/ or workloads/ (RunConfig holds their configs as Any) and no heavy
package. ConfigError and the one-field checks are remnant.config_errors'.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
from dataclasses import dataclass, field
from typing import Any

from remnant.calibration.capture_recorder import DEFAULT_RECORDS, DEFAULT_TOKENS
from remnant.calibration.retention import POLICIES, profile_values
from remnant.config_errors import ConfigError, at_least, positive_finite
from remnant.kv.formats import C128_RECORDS, CSA_RATIO, HCA_RATIO, RETENTION_VALUES, WINDOW_RECORDS
from remnant.kv.modes import check_packed_rules, mode_of

#: OmegaConf's marker for a value the user must give (kept literal: no OmegaConf import here).
MISSING = "???"


@dataclass
class ModeConfig:
    """How C4 records are stored and attended: `name` is a mode of remnant.kv.modes."""

    name: str = "native"


#: The parts beyond C4 a packed run may pack, by their retention options' values, as the
#: capacity formula names them (remnant.engine.capacity.PACKABLE_PARTS).
PACKED_PART_LABELS = {("window_records", "packed_csa"): "csa_swa", ("window_records", "packed"): "swa",
                      ("c128_records", "packed"): "c128"}


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
    #: The window records of packed modes (remnant.kv.formats.WINDOW_RECORDS): native,
    #: packed_csa (each CSA layer's window packed with its C4 map) or packed (every layer's;
    #: docs/kv.md).
    window_records: str = "native"
    #: The HCA layers' C128 records in packed modes (remnant.kv.formats.C128_RECORDS).
    c128_records: str = "native"

    def label(self) -> str:
        """The profile's name, then each part beyond C4 it packs ("r256+swa+c128", the
        capacity formula's part names): how reports and frontier searches tell apart runs
        that pack other parts, which must never pool into one cell."""
        parts = [label for (name, value), label in PACKED_PART_LABELS.items() if getattr(self, name) == value]
        return "+".join([self.name, *parts])

    def packs_other_layers(self) -> bool:
        """Whether HCA or window-only layers pack a part (they then need maps of their own,
        at one uniform R)."""
        return self.window_records == "packed" or self.c128_records == "packed"

    def values(self) -> list[int]:
        return list(self.per_layer) if self.per_layer else [self.retention]


@dataclass(kw_only=True)
class BlockShapes:
    """A DeepSeek-V4 layer's parts beyond attention, with config.json names; optional (a
    model without them has a dense output projection and a dense SwiGLU or none). One
    home for the config (ModelConfig) and the engine's weights (remnant.engine.model.ModelArgs)."""

    #: Grouped low-rank output projection: o_groups groups of heads -> o_lora_rank each, then
    #: -> hidden (V4-Flash: 1024, 8). 0: one dense output projection.
    o_lora_rank: int = 0
    o_groups: int = 0
    #: Routed MoE feed-forward (V4-Flash: moe_intermediate_size 2048, top-6 routed + 1 shared);
    #: 0 routed experts: the dense SwiGLU of intermediate_size (0: no feed-forward).
    n_routed_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    n_shared_experts: int = 0
    #: How routed experts are stored (EXPERT_DTYPES, below).
    expert_dtype: str = "float8_e4m3fn"


@dataclass
class ModelConfig(BlockShapes):
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
    #: How this model differs from the one it stands for: run.json's limits carry them.
    limits: list[str] = field(default_factory=list)


class Kinds:
    """The config classes of one open group (workload, host) by `kind`.

    The kind of remnant.<package>.<kind> registers its class with `@register`; the
    registry imports the package's modules when asked for its kinds, so adding one is its
    module, its conf/<group>/ file and its tests, with no list to extend elsewhere."""

    def __init__(self, group: str, package: str):
        self.group, self.package = group, package
        self._classes: dict[str, type] = {}

    def register(self, cls: type) -> type:
        """Class decorator: `cls.kind` (its field's default) names it; a second class of
        the same kind is an error, not a silent replacement."""
        if self._classes.get(cls.kind, cls) is not cls:
            raise TypeError(f"{self.group} kind {cls.kind!r} is registered twice: {self._classes[cls.kind].__qualname__} "
                            f"and {cls.__qualname__}")
        self._classes[cls.kind] = cls
        return cls

    def all(self) -> dict[str, type]:
        """Every kind's config class, by kind, in order of name."""
        package = importlib.import_module(self.package)
        for module in pkgutil.iter_modules(package.__path__):
            importlib.import_module(f"{self.package}.{module.name}")
        return dict(sorted(self._classes.items()))

    def get(self, kind: str) -> type:
        """The config class of `kind`; ConfigError names the kinds there are."""
        kinds = self._classes if kind in self._classes else self.all()
        if kind not in kinds:
            raise ConfigError(f"{self.group}.kind={kind} is not a {self.group}; allowed: {', '.join(kinds)}")
        return kinds[kind]


@dataclass
class CaptureConfig:
    """A capture run (`remnant-capture`, or `remnant-run capture=on`): the native server
    records each CSA layer's first `tokens` decode queries and first `records` C4 latents
    (remnant.calibration.capture_recorder) into capture.safetensors in the run directory,
    the calibration data of python -m remnant.cli.build_map."""

    name: str = "on"
    tokens: int = DEFAULT_TOKENS
    records: int = DEFAULT_RECORDS
    #: What the capture is of, recorded in the file (policies are evaluated on a source they
    #: were not calibrated on); empty: the workload's name.
    source: str = ""


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
    #: A capture run when set (conf/capture/on.yaml); None: an ordinary run.
    capture: CaptureConfig | None = None


def validate_capture(cfg: RunConfig) -> None:
    """ConfigError where a capture run cannot run: a packed mode, a host that cannot
    capture, a budget below one token or record."""
    cap = cfg.capture
    if mode_of(cfg.mode.name).packed:
        raise ConfigError(f"capture=on needs mode=native, got mode={cfg.mode.name}: a capture records the native "
                          "model's latents, which the packed modes no longer hold")
    refusal = cfg.host.capture_refusal()
    if refusal:
        raise ConfigError(f"capture=on is not possible on host={cfg.host.kind}: {refusal}")
    for name in ("tokens", "records"):
        value = getattr(cap, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"capture.{name}={value} must be an integer >= 1")
    if csa_layer_count(cfg.model) == 0:
        raise ConfigError(f"capture=on: model={cfg.model.name} has no CSA layer (compress_ratios has no {CSA_RATIO}) "
                          "to capture")


def csa_layer_count(model: ModelConfig) -> int:
    return sum(1 for r in model.compress_ratios if r == CSA_RATIO)


def validate(cfg: RunConfig) -> None:
    """Enforce each group's bounds, the mode/retention rules (docs/architecture.md, The modes) and the
    rules that read more than one group; raise ConfigError naming the first field that
    breaks one."""
    mode = mode_of(cfg.mode.name)
    if cfg.seed < 0:
        raise ConfigError(f"seed={cfg.seed} must be >= 0 (numpy's generators take non-negative seeds)")
    validate_model(cfg.model)
    cfg.workload.validate()
    cfg.workload.check_model(cfg.model)
    cfg.host.validate()
    cfg.host.check_model(cfg.model)
    if cfg.capture is not None:
        validate_capture(cfg)
    if not mode.keeps_retention:
        return  # native ignores retention
    ret = cfg.retention
    if cfg.host.serves_sglang() and ret.map_path is None and ret.policy != "prefix":
        # The SGLang plugin cannot calibrate at load as the embedded engine does.
        raise ConfigError(
            f"retention.policy={ret.policy} needs calibration, which host={cfg.host.kind} (SGLang) cannot do at load; "
            "give retention.map_path (a map built with python -m remnant.cli.build_map) or retention.policy=prefix"
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
    for name, allowed in (("window_records", WINDOW_RECORDS), ("c128_records", C128_RECORDS)):
        value = getattr(ret, name)
        if value not in allowed:
            raise ConfigError(f"retention.{name}={value} is not allowed; allowed: {', '.join(allowed)}")
        if value != "native" and cfg.host.serves_sglang():
            # The SGLang plugin serves what it can pack without calibrating at load.
            from remnant.sglang.settings import check_served_records

            check_served_records(name, value, f"retention.{name}")
        elif value != "native" and cfg.host.kind != "embedded":
            # The embedded engine's pools and attention hold every packed form; other servers none.
            raise ConfigError(f"retention.{name}={value} is served by host=embedded only; "
                              f"host={cfg.host.kind}'s server takes no such setting")
    if ret.packs_other_layers() and ret.per_layer is not None:
        raise ConfigError(f"retention.window_records={ret.window_records} retention.c128_records={ret.c128_records} "
                          "pack HCA or window-only layers, which take one uniform R: give retention, not "
                          "retention.per_layer")
    if ret.map_path is not None and not os.path.isfile(ret.map_path):
        raise ConfigError(f"retention.map_path={ret.map_path} is not a file")
    if ret.policy not in POLICIES:
        raise ConfigError(f"retention.policy={ret.policy} is not a policy; allowed: {', '.join(POLICIES)}")
    elif ret.retention not in RETENTION_VALUES:
        raise ConfigError(f"retention={ret.retention} is not allowed; allowed: {', '.join(map(str, RETENTION_VALUES))}")
    check_packed_rules(mode.name, ret.values(), cfg.hicache, ret.name)


#: Storage of routed experts: FP8 e4m3 with a float32 scale per output column (the engine's
#: choice: V4-Flash keeps FP4 experts), bf16, or float32 (remnant.engine.moe).
EXPERT_DTYPES = ("float8_e4m3fn", "bfloat16", "float32")

#: Layer widths of a DeepSeek-V4-shaped model are whole 64-wide tiles (V4-Flash: hidden
#: 4096, q_lora_rank 1024, intermediate 2048, indexer heads 128 wide), as the GPU kernels
#: and FlashMLA tile them.
WIDTH_TILE = 64
#: Token ids the generated model directory's tokenizer needs (256 bytes, BOS, EOS):
#: remnant.engine.model_dir.EOS_ID + 1.
GENERATED_VOCAB_MIN = 258


def validate_model(model: ModelConfig) -> None:
    at_least(model, "model.", ("num_hidden_layers", "num_attention_heads", "index_n_heads", "index_topk",
                                "window_size", "max_position_embeddings", "tp_size", "prompt_vocab_size"), 1)
    at_least(model, "model.", ("seed",), 0)
    for name in ("hidden_size", "q_lora_rank", "index_head_dim"):
        value = getattr(model, name)
        if value < WIDTH_TILE or value % WIDTH_TILE:
            raise ConfigError(f"model.{name}={value} must be a positive multiple of {WIDTH_TILE}")
    if model.intermediate_size < 0 or model.intermediate_size % WIDTH_TILE:
        raise ConfigError(f"model.intermediate_size={model.intermediate_size} must be a multiple of {WIDTH_TILE} "
                          "(0: no feed-forward, attention only)")
    for name in ("rope_theta", "compress_rope_theta"):
        positive_finite(getattr(model, name), f"model.{name}")
    validate_output_projection(model)
    validate_moe(model)
    if model.path is None and model.vocab_size < GENERATED_VOCAB_MIN:
        raise ConfigError(f"model.vocab_size={model.vocab_size} is too small for the generated model directory; "
                          f"its tokenizer needs >= {GENERATED_VOCAB_MIN}")
    if model.prompt_vocab_size > model.vocab_size:
        raise ConfigError(f"model.prompt_vocab_size={model.prompt_vocab_size} must be <= "
                          f"model.vocab_size={model.vocab_size}")
    for i, ratio in enumerate(model.compress_ratios):
        if ratio not in (0, CSA_RATIO, HCA_RATIO):
            raise ConfigError(f"model.compress_ratios[{i}]={ratio} is not allowed; allowed: 0 (window only), "
                              f"{CSA_RATIO} (CSA), {HCA_RATIO} (HCA)")
    if len(model.compress_ratios) != model.num_hidden_layers:
        raise ConfigError(
            f"model.compress_ratios has {len(model.compress_ratios)} values; "
            f"model.num_hidden_layers={model.num_hidden_layers} needs one per layer"
        )
    from remnant.api_key import refuse_inline_keys

    refuse_inline_keys(model.server_args, {}, "model.server_args", "")


def validate_output_projection(model: ModelConfig) -> None:
    """o_lora_rank 0 (a dense projection) or whole tiles, with o_groups dividing the heads."""
    at_least(model, "model.", ("o_lora_rank", "o_groups"), 0)
    if not model.o_lora_rank:
        return
    if model.o_lora_rank % WIDTH_TILE:
        raise ConfigError(f"model.o_lora_rank={model.o_lora_rank} must be a multiple of {WIDTH_TILE} "
                          "(0: one dense output projection)")
    if model.o_groups < 1 or model.num_attention_heads % model.o_groups:
        raise ConfigError(f"model.o_groups={model.o_groups} must divide model.num_attention_heads="
                          f"{model.num_attention_heads} (o_lora_rank={model.o_lora_rank} groups the heads)")


def validate_moe(model: ModelConfig) -> None:
    """Routed experts: none, or top-k of them with whole-tile expert widths."""
    at_least(model, "model.", ("n_routed_experts", "num_experts_per_tok", "n_shared_experts"), 0)
    if model.expert_dtype not in EXPERT_DTYPES:
        raise ConfigError(f"model.expert_dtype={model.expert_dtype} is not allowed; allowed: {', '.join(EXPERT_DTYPES)}")
    if not model.n_routed_experts:
        return
    if not 1 <= model.num_experts_per_tok <= model.n_routed_experts:
        raise ConfigError(f"model.num_experts_per_tok={model.num_experts_per_tok} must be in 1.."
                          f"{model.n_routed_experts} (model.n_routed_experts)")
    if model.moe_intermediate_size < WIDTH_TILE or model.moe_intermediate_size % WIDTH_TILE:
        raise ConfigError(f"model.moe_intermediate_size={model.moe_intermediate_size} must be a positive multiple "
                          f"of {WIDTH_TILE} with routed experts")


def recorded_config(cfg: RunConfig) -> dict:
    """The resolved config as run.json records it: native records no retention."""
    import dataclasses

    d = dataclasses.asdict(cfg)
    if not mode_of(cfg.mode.name).keeps_retention:
        d["retention"] = None
    return d
