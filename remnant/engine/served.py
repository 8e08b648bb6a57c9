"""What remnant-serve serves: a model directory loaded into an engine, its HTTP frontend, and
the description /server_info and /model_info give of it.

`load_served` reads the model directory (config.json, tokenizer.json), builds the model
and its retention, sizes the KV pools from the byte budget as SGLang sizes them, and
collects the environment where the server runs. The app (remnant.engine.server) keeps the
result in `app.state`; the routes read it there.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import remnant
from remnant.engine.api import ModelLimits
from remnant.engine.args import EngineArgs, RetentionArgs
from remnant.engine.engine import Engine
from remnant.engine.frontend import Frontend
from remnant.kv.modes import mode_of


@dataclass
class ServerInfo:
    """The served model as SGLang's /server_info and /model_info describe it. server_args:
    SGLang's ServerArgs names plus remnant_* ones; capacity: pool sizes and bytes;
    environment: provenance of the machine the server runs on (collected here, where the
    work runs, not by whoever started the server); started: Unix time."""

    model_dir: Path
    hf_config: dict
    server_args: dict
    capacity: dict
    environment: dict
    started: float

    @property
    def served_model_name(self) -> str:
        return self.server_args["served_model_name"]

    def server_info(self, stats: dict) -> dict:
        """GET /server_info, with the engine's current `stats`."""
        return {
            **self.server_args,
            "startup_time": self.started,
            "version": remnant.__version__,
            "engine": "remnant-embedded",
            "environment": self.environment,
            "model_config": {k: v for k, v in self.hf_config.items() if k != "remnant"},
            "capacity": self.capacity,
            "internal_states": [stats],
        }

    def model_info(self) -> dict:
        """GET /model_info."""
        return {
            "model_path": str(self.model_dir),
            "served_model_name": self.served_model_name,
            "tokenizer_path": str(self.model_dir),
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
            "load_format": "dummy",  # random weights generated from the seed
            "reasoning_parser": None,
            "tool_call_parser": None,
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": self.hf_config.get("model_type"),
            "architectures": self.hf_config.get("architectures"),
        }


@dataclass
class Served:
    """A loaded model ready to serve: the engine (started and stopped with the app), the
    frontend the routes submit requests through, its description, and the load time (s)."""

    engine: Engine
    frontend: Frontend
    info: ServerInfo
    load_s: float
    #: The capture a capture server records (remnant.calibration.capture_recorder.CaptureRecorder),
    #: closed when the server stops; None otherwise.
    recorder: object | None = None


def read_hf_config(model_dir: Path) -> dict:
    """config.json of `model_dir`; ValueError says how to write one."""
    path = model_dir / "config.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{path} does not exist; write one with python -m remnant.cli.model_dir --out {model_dir}") from None


def load_served(model_dir: Path, mode: str = "native", retention: RetentionArgs | None = None,
                engine_args: EngineArgs | None = None, capture=None) -> Served:
    """Load `model_dir` in `mode`; ValueError names what is wrong (a missing file, a budget
    too small for the pools, a bad retention, a capture outside native mode).

    capture: remnant.calibration.capture_recorder.CaptureSettings: the model records its CSA layers'
    decode queries and C4 latents into that capture file (native mode only)."""
    import torch
    from tokenizers import Tokenizer

    from remnant.engine.capacity import NATIVE, combination_geometry, size_pools
    from remnant.engine.chat_template import ChatTemplate
    from remnant.engine.model import Model, ModelArgs
    from remnant.engine.pools import KVPools, geometry_of
    from remnant.engine.prefix_cache import PrefixCache
    from remnant.engine.retention_setup import setup_retention
    from remnant.records.provenance import environment

    rules = mode_of(mode)  # a ValueError for a name that is no mode, before anything loads
    if capture is not None and rules.packed:
        raise ValueError(f"--capture needs --mode native, got {mode}: a capture records the native model's latents")
    retention = retention or RetentionArgs()
    engine_args = engine_args or EngineArgs()
    model_dir = Path(model_dir)
    hf = read_hf_config(model_dir)
    args = ModelArgs.from_hf_config(hf)
    t0 = time.perf_counter()
    model = Model(args, device=engine_args.device, decode_path=engine_args.decode_path,
                  native_decode=engine_args.native_decode, dtype=engine_args.dtype,
                  cuda_graph=engine_args.cuda_graph, cuda_graph_max_bs=engine_args.cuda_graph_max_bs,
                  torch_compile=engine_args.torch_compile, index_key_format=engine_args.index_key_format)
    served_name = hf.get("remnant", {}).get("preset") or model_dir.name
    rmap = setup_retention(model, mode, served_name, retention.retention, retention.per_layer,
                           retention.map_path, retention.policy, retention.window_records,
                           retention.c128_records)
    load_s = time.perf_counter() - t0
    recorder = None
    if capture is not None:
        recorder = capture_recorder(model, capture, served_name, model_dir)
    tokenizer_path = model_dir / "tokenizer.json"
    if not tokenizer_path.is_file():
        raise ValueError(f"{tokenizer_path} does not exist; the model directory needs a tokenizer")
    tokenizer = Tokenizer.from_file(str(tokenizer_path))

    geometry = geometry_of(model, engine_args.page_size, engine_args.swa_ratio, engine_args.max_running_requests,
                           engine_args.compressor_state_dtype)
    sizes = size_pools(geometry, engine_args.kv_budget_bytes)
    if sizes.full_tokens == 0 or sizes.swa_tokens < geometry.window_size:
        raise ValueError(
            f"kv budget {engine_args.kv_budget_bytes} bytes holds {sizes.full_tokens} tokens and "
            f"{sizes.swa_tokens} window slots after {sum(sizes.fixed_bytes.values())} fixed bytes; "
            f"raise the budget or lower max_running_requests"
        )
    native_tokens = size_pools(combination_geometry(geometry, NATIVE), engine_args.kv_budget_bytes).full_tokens
    pools = KVPools(geometry, sizes, model.device)
    engine = Engine(model, hf["eos_token_id"], pools, PrefixCache(pools, engine_args.prefix_cache),
                    engine_args.chunked_prefill_size,
                    overlap_answers=engine_args.overlap_answers and model.device.type == "cuda",
                    launch_ahead=engine_args.launch_ahead and model.device.type == "cuda")
    capacity = {
        "max_total_num_tokens": sizes.full_tokens,
        "swa_max_total_num_tokens": sizes.swa_tokens,
        "page_size": geometry.page_size,
        "swa_full_tokens_ratio": geometry.swa_ratio,
        "kv_budget_bytes": engine_args.kv_budget_bytes,
        "bytes_per_token": sizes.bytes_per_full_token,
        "fixed_bytes": sizes.fixed_bytes,
        "accounted_bytes": pools.accounted_bytes(),
        "allocated_bytes": pools.allocated_bytes(),
        "c4_records": sizes.c4_records,
        "c128_records": sizes.c128_records,
        "max_running_requests": pools.slots.n,
        # What SGLang's defaults (native records, FP8 index keys, float32 state) would hold
        # in the same budget, and this server's KV tokens over it (remnant.engine.capacity).
        "native_max_total_num_tokens": native_tokens,
        "capacity_ratio": sizes.full_tokens / native_tokens if native_tokens else None,
    }
    started = time.time()
    server_environment = environment()
    server_args = {
        "model_path": str(model_dir),
        "tokenizer_path": str(model_dir),
        "served_model_name": served_name,
        "dtype": str(model.dtype).removeprefix("torch."),
        "kv_cache_dtype": "fp8_e4m3",
        "chunked_prefill_size": engine_args.chunked_prefill_size,
        "max_running_requests": pools.slots.n,
        "max_total_num_tokens": sizes.full_tokens,
        "page_size": geometry.page_size,
        "disable_radix_cache": not engine_args.prefix_cache,
        "remnant_mode": mode,
        "device": model.device.type,  # as SGLang's ServerArgs.device: "cuda" or "cpu"
        "remnant_decode_path": model.decode_path,
        # Decode steps in CUDA graphs: buckets, captures and their time, kept current (null
        # where steps run eagerly: cpu, --disable-cuda-graph, decode_path=reference).
        "cuda_graph": None if model.graphs is None else model.graphs.stats,
        "disable_cuda_graph": model.graphs is None,
        # A step's answers go out while the next step runs (cuda, unless
        # --disable-overlap-answers) or between steps.
        "remnant_overlap_answers": engine.overlap_answers,
        # A greedy decode step is launched before the last one is read (cuda, unless
        # --disable-launch-ahead), or each step is read first.
        "remnant_launch_ahead": engine.launch_ahead,
        # The elementwise chains: "compiled" (torch.compile, on cuda) or "plain".
        "remnant_step_ops": model.ops.name,
        # The compressors' state rows: float32 or bfloat16 (SGLang: SGLANG_DSV4_COMPRESS_STATE_DTYPE).
        "compressor_state_dtype": engine_args.compressor_state_dtype,
        # The indexer keys' format: fp8 or mxfp4 (SGLang: --enable-deepseek-v4-fp4-indexer).
        "index_key_format": model.index_key_format.name,
        # Which kernel decode steps ran over native records, and why not FlashMLA.
        "remnant_native_decode": {"kernel": model.native_decode, "reason": model.native_decode_reason,
                                  "flashmla_version": _flashmla_version(model.native_decode)},
        # Which kernel kernel mode's decode steps ran over packed records, and why not the
        # SM90 Gluon kernel (null without packed kernel-mode layers).
        "remnant_packed_decode": {"kernel": model.packed_decode, "reason": model.packed_decode_reason},
        "remnant_retention": None if rmap is None else {
            "per_layer": {str(i): rmap.retention(i) for i in model.csa_layers},
            "policy": rmap.policy,
            "map_path": retention.map_path,
            "calibration": rmap.calibration,
            "window_records": retention.window_records,
            "c128_records": retention.c128_records,
            # The HCA and window-only layers that pack a part: their R and the calibration
            # their map came from (null where none does).
            "other_layers": None if model.other_map is None else {
                "per_layer": {str(i): model.other_map.retention(i) for i in sorted(model.other_formats)},
                "policy": model.other_map.policy,
                "calibration": model.other_map.calibration,
            },
        },
        "c4_record_bytes": [model.c4_formats[i].record_bytes for i in model.csa_layers],
        # Each layer's window (SWA) record size (584, or R + 72 where the layer packs it) and
        # the HCA layers' C128 record size.
        "window_record_bytes": geometry.window_record_bytes(),
        "c128_record_bytes": geometry.c128_record_bytes,
        # Where a capture server writes its capture, and its budget (null otherwise).
        "remnant_capture": None if recorder is None else {
            "path": str(recorder.settings.path), "tokens": recorder.settings.tokens,
            "records": recorder.settings.records, "source": recorder.settings.source},
        "random_seed": args.seed,
        "torch_num_threads": torch.get_num_threads(),
    }
    info = ServerInfo(model_dir, hf, server_args, capacity, server_environment, started)

    pool_tokens = pools.num_pages * geometry.page_size
    # Without max_new_tokens a request may generate one request's share of the pool (see
    # remnant.engine.api.engine_params): 113,664 / 32 = 3,552 tokens at the defaults.
    limits = ModelLimits(args.vocab_size, args.max_position_embeddings, pool_tokens,
                         default_new_tokens=max(1, pool_tokens // pools.slots.n))
    frontend = Frontend(engine, tokenizer, limits, served_name, ChatTemplate.from_model_dir(model_dir))
    return Served(engine, frontend, info, load_s, recorder)


def capture_recorder(model, capture, served_name: str, model_dir: Path):
    """The recorder `model` hands its layers' decode queries and latents to: the CSA layers'
    as always, and what the fidelity of the parts beyond C4 records reads (every layer's
    window latents, HCA layers' C128 latents, the indexer's inputs, bf16-state twins)."""
    import dataclasses

    from remnant.calibration.capture_recorder import CaptureRecorder
    from remnant.records.provenance import sources

    settings = dataclasses.replace(capture, model_id=capture.model_id or served_name)
    params = {"server": "remnant-serve", "engine": "remnant-embedded", "weights_seed": model.args.seed,
              "model_dir": str(model_dir), "heads": model.args.num_attention_heads,
              "sources": sources(), "compress_ratios": list(model.args.compress_ratios),
              "window_size": model.args.window_size, "index_topk": model.args.index_topk}
    ratios = dict(enumerate(model.args.compress_ratios))
    recorder = CaptureRecorder(settings, params, layers=sorted(ratios), ratios=ratios)
    model.recorder = recorder
    return recorder


def _flashmla_version(kernel: str) -> str | None:
    if kernel != "flashmla":
        return None
    from remnant.kernels.decode.flashmla import version

    return version()
