"""What remnant-serve is started with, defined once: the engine's settings (`EngineArgs`)
and the retention of its CSA layers (`RetentionArgs`).

The embedded host's config carries EngineArgs' fields (host.kv_budget_mib, ...) and hands
them whole to remnant-serve as flags (`to_argv`); remnant-serve's parser is made from the
same fields (`add_arguments`), so a setting's name, default, allowed values and flag are
written here only. Plain Python: importing this module imports neither torch nor the
engine.
"""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING

from remnant.config import RetentionConfig
from remnant.config_errors import ConfigError, at_least, positive_finite
from remnant.engine.capacity import STATE_DTYPES
from remnant.kv.formats import C128_RECORDS, INDEX_KEY_FORMATS, WINDOW_RECORDS

if TYPE_CHECKING:
    from remnant.calibration.capture_recorder import CaptureSettings

#: Values of EngineArgs.device, .decode_path and .native_decode (remnant.engine.model checks
#: them again; native_decode's are auto and two of remnant.kernels.decode.KERNELS).
ENGINE_DEVICES = ("cpu", "cuda")
DECODE_PATHS = ("auto", "reference", "batched", "kernels")
#: Values of EngineArgs.dtype: the compute dtype (auto: bfloat16 on cuda, float32 on cpu).
ENGINE_DTYPES = ("auto", "float32", "bfloat16")
NATIVE_DECODES = ("auto", "flashmla", "triton")


def kernels_need_interpreter(decode_path: str, device: str) -> bool:
    """Whether decode_path on device (cpu or cuda) asks for Triton kernels on the CPU without
    Triton's interpreter: there they run only under it, and TRITON_INTERPRET=1 must be in
    the environment before triton is first imported."""
    return decode_path == "kernels" and device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1"


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


@dataclass
class EngineArgs:
    """The engine's settings: KV pool budget and layout (SGLang's DeepSeek-V4 defaults for
    page size and SWA ratio), scheduler, device and decode kernels. A boolean field is on
    by default and has a flag that turns it off (metadata "flag")."""

    #: Bytes for every KV pool together, MiB (SGLang sizes pools from what the GPU has left).
    kv_budget_mib: float = field(default=96.0, metadata={"help": "bytes for every KV pool together, MiB"})
    max_running_requests: int = 32
    page_size: int = field(default=256, metadata={"help": "tokens per page (multiple of 128)"})
    swa_ratio: float = field(default=0.1, metadata={"help": "SWA pool tokens per full token"})
    chunked_prefill_size: int = 512
    prefix_cache: bool = field(default=True, metadata={"flag": "--disable-prefix-cache"})
    #: Where the engine's weights and KV pools live: cpu or cuda (one GPU).
    device: str = field(default="cpu", metadata={"choices": ENGINE_DEVICES, "help": "where weights and KV pools live"})
    #: How decode steps run: reference (per sequence, torch: the ground truth), batched (one
    #: batched step, attention in torch), kernels (one batched step, attention through
    #: remnant.kernels: FlashMLA, the Triton and SM90 kernels), or auto (kernels on cuda,
    #: batched on cpu). remnant.engine.decode_step has the batched step.
    decode_path: str = field(default="auto", metadata={
        "choices": DECODE_PATHS,
        "help": "decode steps: per-sequence torch reference, batched (torch attention) or batched on "
                "remnant.kernels (auto: kernels on cuda, batched on cpu)"})
    #: Compute dtype of weights and activations (softmax statistics and compressor state stay
    #: float32): auto is bfloat16 on cuda, float32 on cpu.
    dtype: str = field(default="auto", metadata={
        "choices": ENGINE_DTYPES, "help": "compute dtype (auto: bfloat16 on cuda, float32 on cpu)"})
    #: Decode steps on cuda replay CUDA graphs captured per batch-size bucket
    #: (remnant.engine.graphs); off: eager steps. Ignored on cpu.
    cuda_graph: bool = field(default=True, metadata={"flag": "--disable-cuda-graph"})
    #: On cuda, a step's answers (the tokens streamed to clients) go out after the next
    #: step is launched, while the GPU runs it (remnant.engine.engine); off: between the
    #: two steps, where the server's streaming holds up the next launch. Ignored on cpu,
    #: whose steps are not launched asynchronously (an answer would wait a whole step).
    overlap_answers: bool = field(default=True, metadata={"flag": "--disable-overlap-answers"})
    #: On cuda, a decode step whose requests all decode greedily is launched on the last
    #: step's tokens before the host reads them (remnant.engine.engine), as SGLang's overlap
    #: scheduler: the host's work between steps runs while the GPU computes. Off: each step
    #: is read before the next is built. Ignored on cpu (its steps run as they are launched).
    launch_ahead: bool = field(default=True, metadata={"flag": "--disable-launch-ahead"})
    #: On cuda, the model's elementwise chains (norms, RoPE, the compressor's gate, the
    #: indexer's key codec and top-k keys) run through torch.compile (remnant.engine.
    #: step_ops); off: plain torch operations. Ignored on cpu.
    torch_compile: bool = field(default=True, metadata={"flag": "--disable-torch-compile"})
    #: The compressors' state rows (the open blocks' content and gate, C4, indexer and C128):
    #: float32 as SGLang keeps them by default, or bfloat16, as SGLang's
    #: SGLANG_DSV4_COMPRESS_STATE_DTYPE=bfloat16 keeps them (half the state's bytes; the
    #: pools' budget and capacity count it, remnant.engine.capacity).
    compressor_state_dtype: str = field(default="float32", metadata={
        "choices": tuple(STATE_DTYPES),
        "help": "compressor state rows: float32 (SGLang's default) or bfloat16 "
                "(SGLANG_DSV4_COMPRESS_STATE_DTYPE=bfloat16)"})
    #: How the indexer's keys are stored: fp8 (SGLang's default, 132 bytes a key at V4's
    #: index_head_dim) or mxfp4 (SGLang's --enable-deepseek-v4-fp4-indexer, 68 bytes;
    #: remnant.kv.index_keys). The pools' budget and capacity count it.
    index_key_format: str = field(default="fp8", metadata={
        "choices": INDEX_KEY_FORMATS,
        "help": "indexer keys: fp8 (SGLang's default) or mxfp4 (--enable-deepseek-v4-fp4-indexer)"})
    #: The largest decode batch captured in a CUDA graph; larger batches run eagerly.
    cuda_graph_max_bs: int = field(default=128, metadata={"help": "largest decode batch captured in a CUDA graph"})
    #: Which kernel decode steps on the kernels path run over native records (native and
    #: triton modes, window-only and HCA layers): flashmla (FlashMLA's V4 decode, as SGLang
    #: runs; needs sgl-flash-mla, an SM90/SM100 GPU and 64 or 128 heads), triton (Remnant's
    #: Triton native kernel), or auto (flashmla where it runs, else triton: run.json's
    #: limits say so).
    native_decode: str = field(default="auto", metadata={
        "choices": NATIVE_DECODES,
        "help": "kernel for native records on the kernels path: FlashMLA's V4 decode (sgl-flash-mla), "
                "Remnant's Triton native kernel, or auto (FlashMLA where it runs)"})

    @property
    def kv_budget_bytes(self) -> int:
        return int(self.kv_budget_mib * (1 << 20))

    def engine_args(self) -> EngineArgs:
        """These settings alone, from a config that carries them among its own fields."""
        return EngineArgs(**{f.name: getattr(self, f.name) for f in fields(EngineArgs)})

    def check(self, prefix: str = "") -> None:
        """ConfigError naming the first setting out of range, as `prefix + name` (host.)."""
        positive_finite(self.kv_budget_mib, f"{prefix}kv_budget_mib")
        at_least(self, prefix, ("max_running_requests",), 1)
        if self.page_size % 128 or self.page_size < 128:
            raise ConfigError(f"{prefix}page_size={self.page_size} must be a positive multiple of 128")
        if not (math.isfinite(self.swa_ratio) and 0 < self.swa_ratio <= 1):
            raise ConfigError(f"{prefix}swa_ratio={self.swa_ratio} must be in (0, 1]")
        if self.chunked_prefill_size < 1:
            # 0 would give every prefill step no tokens: the engine would spin, never answering.
            raise ConfigError(f"{prefix}chunked_prefill_size={self.chunked_prefill_size} must be >= 1 "
                              "(prompt tokens per engine step)")
        at_least(self, prefix, ("cuda_graph_max_bs",), 1)
        for name in ("device", "decode_path", "native_decode", "dtype"):
            value, allowed = getattr(self, name), next(f for f in fields(EngineArgs) if f.name == name).metadata["choices"]
            if value not in allowed:
                raise ConfigError(f"{prefix}{name}={value} is not allowed; allowed: {', '.join(allowed)}")
        if self.native_decode == "flashmla" and self.device == "cpu":
            raise ConfigError(f"{prefix}native_decode=flashmla needs {prefix}device=cuda (FlashMLA runs on SM90/SM100 "
                              "GPUs); use native_decode=auto or triton")
        if kernels_need_interpreter(self.decode_path, self.device):
            # The server would refuse it at start; say so before one is launched.
            raise ConfigError(f"{prefix}decode_path=kernels with {prefix}device=cpu needs TRITON_INTERPRET=1 in the "
                              f"environment (Triton's interpreter); use {prefix}device=cuda, or decode_path=auto")

    def to_argv(self) -> list[str]:
        """remnant-serve's flags for these settings (every one, so the server's own
        defaults never decide)."""
        argv, switches = [], []
        for f in fields(EngineArgs):
            value = getattr(self, f.name)
            if isinstance(f.default, bool):
                switches += [] if value else [f.metadata["flag"]]
            else:
                argv += [_flag(f.name), str(value)]
        return argv + switches

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        """remnant-serve's flags of these settings, with their defaults."""
        for f in fields(EngineArgs):
            if isinstance(f.default, bool):
                parser.add_argument(f.metadata["flag"], dest=f.name, action="store_false", help=f.metadata.get("help"))
            else:
                parser.add_argument(_flag(f.name), dest=f.name, type=type(f.default), default=f.default,
                                    choices=f.metadata.get("choices"), help=f.metadata.get("help"))

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> EngineArgs:
        return cls(**{f.name: getattr(ns, f.name) for f in fields(EngineArgs)})


@dataclass
class RetentionArgs:
    """Retention of the CSA layers in triton and kernel modes (native ignores it): one R for
    every layer or one per layer, and a retention map file or the policy that calibrates
    one at load."""

    retention: int | None = None
    per_layer: list[int] | None = None
    map_path: str | None = None
    policy: str = RetentionConfig.policy  # one default, the run config's
    window_records: str = RetentionConfig.window_records
    c128_records: str = RetentionConfig.c128_records

    @classmethod
    def of(cls, ret: RetentionConfig) -> RetentionArgs:
        """A run config's retention as remnant-serve takes it; the map's path made absolute,
        since the server runs in another working directory."""
        return cls(None if ret.per_layer else ret.retention, list(ret.per_layer) if ret.per_layer else None,
                   str(Path(ret.map_path).resolve()) if ret.map_path else None, ret.policy, ret.window_records, ret.c128_records)

    def to_argv(self) -> list[str]:
        argv = []
        if self.per_layer:
            argv += ["--retention-per-layer", ",".join(map(str, self.per_layer))]
        elif self.retention is not None:
            argv += ["--retention", str(self.retention)]
        if self.map_path:
            argv += ["--retention-map", self.map_path]
        return argv + ["--retention-policy", self.policy, "--retention-window-records", self.window_records,
                       "--retention-c128-records", self.c128_records]

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--retention", type=int, default=None, help="coordinates kept per C4 record (R, uniform)")
        parser.add_argument("--retention-per-layer", default=None, help="R per CSA layer, comma-separated")
        parser.add_argument("--retention-map", dest="map_path", metavar="RETENTION_MAP", default=None,
                            help="retention map JSON (remnant/retention-map)")
        parser.add_argument("--retention-policy", dest="policy", metavar="RETENTION_POLICY",
                            default=RetentionArgs.policy, help="policy that chooses kept coordinates when no map is given")
        parser.add_argument("--retention-window-records", dest="window_records", choices=WINDOW_RECORDS,
                            default=RetentionArgs.window_records,
                            help="window records of packed modes: native, packed_csa (CSA layers' windows packed "
                                 "with their C4 map) or packed (every layer's)")
        parser.add_argument("--retention-c128-records", dest="c128_records", choices=C128_RECORDS,
                            default=RetentionArgs.c128_records,
                            help="HCA layers' C128 records in packed modes: native or packed")

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> RetentionArgs:
        """ValueError where --retention-per-layer is not integers."""
        per_layer = [int(v) for v in ns.retention_per_layer.split(",")] if ns.retention_per_layer else None
        return cls(ns.retention, per_layer, ns.map_path, ns.policy, ns.window_records, ns.c128_records)


def capture_argv(capture: CaptureSettings | None) -> list[str]:
    """remnant-serve's flags for a capture (none without one)."""
    if capture is None:
        return []
    return ["--capture", os.path.abspath(capture.path), "--capture-tokens", str(capture.tokens),
            "--capture-records", str(capture.records), "--capture-source", capture.source,
            "--capture-model-id", capture.model_id]


def add_capture_arguments(parser: argparse.ArgumentParser) -> None:
    """remnant-serve's capture flags (remnant.calibration.capture_recorder; native mode only)."""
    from remnant.calibration.capture_recorder import DEFAULT_RECORDS, DEFAULT_TOKENS

    parser.add_argument("--capture", metavar="FILE", default=None,
                        help="record CSA layers' decode queries and C4 latents into this capture file (native mode)")
    parser.add_argument("--capture-tokens", type=int, default=DEFAULT_TOKENS, help="decode queries kept per CSA layer")
    parser.add_argument("--capture-records", type=int, default=DEFAULT_RECORDS, help="C4 latents kept per CSA layer")
    parser.add_argument("--capture-source", default="unknown", help="what is served (a workload name), for the file")
    parser.add_argument("--capture-model-id", default=None, help="model id for the file (default: the served name)")


def capture_from_namespace(ns: argparse.Namespace) -> CaptureSettings | None:
    """The capture flags as settings; None without --capture. ConfigError names a bad flag."""
    from remnant.calibration.capture_recorder import CaptureSettings

    if not ns.capture:
        return None
    settings = CaptureSettings(ns.capture, ns.capture_tokens, ns.capture_records, ns.capture_source,
                               ns.capture_model_id or "")
    settings.check(prefix="--capture-")
    return settings
