"""SGLang plugin, capture mode: a native server records calibration captures.

With REMNANT_MODE=native and REMNANT_CAPTURE=<file> (remnant.calibration.capture_recorder's
CaptureSettings; `python -m remnant.cli.sglang_launch --remnant-capture FILE`), `register`
registers these hooks (TARGETS) and no others, so the server stores and attends exactly as
stock SGLang does; the hooks only copy:

- DeepseekV4AttnBackend.forward (AROUND): on decode batches, the query of each CSA layer
  (compress_ratio 4) as attention receives it (after RoPE), [n, H, 512] for the n real
  requests of the batch, goes to the recorder; then the stock forward runs unchanged and
  its result is returned as is.
- CompressorBackendMixin._forward_compress_all_in_one (AROUND): for the C4 compressor of a
  CSA layer (not the indexer's) it names the layer, found by the C4 buffer the call writes,
  for the store below, then runs the stock call unchanged.
- compressor_v2.compress_norm_rope_store (AROUND), inside that call: SGLang's fused
  kernel runs once as stock (norm, RoPE, FP8 quantization, store into the C4 pool), and
  once more on the same compressed rows with its own bf16_store path into a scratch, row i
  for token i. That kernel reads its input without writing it, and its FP8 path quantizes
  the bf16 rounding of the very values bf16_store writes, so the scratch holds the latents
  as the quantizer saw them, while the stock call and the compressor's state (written by
  compress_forward, which runs once) stay untouched. Rows whose C4 location is not 0
  (SGLang's null slot: the token closes no record) are the new records; they go to the
  recorder, prefill and decode alike.
- ServerArgs.check_server_args (AFTER): capture needs CUDA graphs off (a replay runs no
  Python, so the hooks would miss decode steps), torch.compile off, no speculative
  decoding (the target model then runs no decode batches), one pipeline stage, and no
  data-parallel replicas outside attention DP (each has a TP rank 0 writing the file).

Only TP rank 0 records (with attention data parallelism that is attention-DP rank 0,
attention-TP rank 0): its queries are its own head shard, which the file's params name.
The recorder is made at the first hook call, when the rank is known, and writes the file
when every CSA layer has its budget. Short of it, Scheduler.flush_cache (AFTER) writes what
it has when the run asks (a marker file beside the capture, then /flush_cache: SGLang
stops its schedulers with SIGKILL, which runs no exit handler); an exit handler covers a
scheduler that exits normally.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import threading

from remnant.calibration.capture_recorder import ENV_CAPTURE, CaptureRecorder, CaptureSettings, write_requested
from remnant.config_errors import ConfigError
from remnant.kv.formats import CSA_RATIO
from remnant.sglang.layers import stage_csa_layers

logger = logging.getLogger(__name__)

_COMPRESSOR_MODULE = "sglang.srt.layers.attention.dsv4.compressor_v2"
_COMPRESSOR = f"{_COMPRESSOR_MODULE}.CompressorBackendMixin"
_BACKEND = "sglang.srt.layers.attention.deepseek_v4_backend.DeepseekV4AttnBackend"
_SERVER_ARGS = "sglang.srt.server_args.ServerArgs"
_SCHEDULER = "sglang.srt.managers.scheduler.Scheduler"

_settings: CaptureSettings | None = None
_recorder: CaptureRecorder | None = None
_made = False
_lock = threading.Lock()
#: The CSA layer (and recorder) whose C4 compressor call is running in this thread, set
#: by compress_capture for the store call inside it.
_current = threading.local()
#: id(token pool) -> (pool, {data_ptr of a C4 layer's buffer: model layer index}).
_c4_buffers: dict[int, tuple[object, dict[int, int]]] = {}
_warned: set[str] = set()


def configure(capture: CaptureSettings | None) -> None:
    """Set the capture settings the hooks act on and drop this process's recorder (if
    any, unwritten); register() does this from the environment."""
    global _settings, _recorder, _made
    with _lock:
        _settings, _recorder, _made = capture, None, False
        _c4_buffers.clear()
        _warned.clear()


def settings() -> CaptureSettings:
    if _settings is None:
        raise RuntimeError("the Remnant capture hooks are not configured (REMNANT_CAPTURE is not set)")
    return _settings


def targets() -> list[tuple[str, object, object]]:
    """(dotted target, hook, HookType) of every capture hook, as HookRegistry.register takes them."""
    from sglang.srt.plugins.hook_registry import HookType

    kinds = {"around": HookType.AROUND, "after": HookType.AFTER}
    return [(target, hook, kinds[kind]) for target, hook, kind in TARGETS]


# ---------------------------------------------------------------------------------------
# The recorder of this process


def ranks() -> dict:
    """This process's place in SGLang's parallel groups: tp_rank, tp_size and, where
    attention data parallelism is set up, attn_tp_* and attn_dp_*. Groups not set up (one
    process, as in tests) count as rank 0 of 1."""
    from sglang.srt.runtime_context import get_parallel

    p = get_parallel()
    out = {}
    for name, default in (("tp_rank", 0), ("tp_size", 1), ("attn_tp_rank", None), ("attn_tp_size", None),
                          ("attn_dp_rank", None), ("attn_dp_size", None)):
        try:
            out[name] = int(getattr(p, name))
        except (AssertionError, AttributeError, RuntimeError, TypeError):
            if default is not None:
                out[name] = default
    return out


def make_recorder(capture: CaptureSettings, pool=None, where: dict | None = None) -> CaptureRecorder | None:
    """A recorder for this process, or None unless it is TP rank 0 (`where`: ranks(), by
    default read from SGLang). pool: the DeepSeek-V4 token pool, whose CSA layers a
    complete capture covers."""
    from importlib.metadata import version

    from remnant.records.provenance import sources

    where = ranks() if where is None else where
    if where.get("tp_rank", 0) != 0:
        logger.info("remnant capture: TP rank %s of %s records nothing (TP rank 0 records)",
                    where.get("tp_rank"), where.get("tp_size"))
        return None
    params = {"server": "sglang", "sglang_version": version("sglang"), "sources": sources(), "ranks": where,
              "settings": dataclasses.asdict(capture),
              "queries": "decode queries of CSA layers as attention receives them (after RoPE), TP rank 0 only",
              "latents": "C4 latents (K = V) of every new record, prefill and decode, as SGLang's fused "
                         "kernel rounds them to bf16 before FP8 quantization (its bf16_store path)"}
    rec = CaptureRecorder(capture, params, stage_csa_layers(pool) if pool is not None else None)
    logger.warning("remnant capture: recording up to %d decode queries and %d latents per CSA layer into %s",
                   capture.tokens, capture.records, capture.path)
    return rec


def recorder(backend=None) -> CaptureRecorder | None:
    """This process's recorder, made at the first call (None on ranks that do not record)."""
    global _recorder, _made
    if _made:
        return _recorder
    with _lock:
        if not _made:
            _recorder = make_recorder(settings(), getattr(backend, "token_to_kv_pool", None))
            _made = True
    return _recorder


@atexit.register
def _close_at_exit() -> None:
    # Fallback to the write at budget; an exception here must not hide the server's own.
    rec = _recorder
    if rec is not None:
        try:
            rec.close()
        except Exception as e:  # noqa: BLE001 - interpreter shutdown: log, never raise
            logger.error("remnant capture: could not write %s at exit: %s", rec.settings.path, e)


def _warn_once(key: str, message: str, *args) -> None:
    if key not in _warned:
        _warned.add(key)
        logger.warning(message, *args)


# ---------------------------------------------------------------------------------------
# Hooks


def real_rows(q, forward_batch) -> int:
    """Rows of q that are requests of this decode batch, not padding (DP-attention or
    CUDA-graph padding follow them)."""
    n = getattr(forward_batch, "_original_batch_size", None) or getattr(forward_batch, "batch_size", None)
    return q.shape[0] if n is None else min(int(n), q.shape[0])


def attention_capture(original, backend, q, k, v, layer, forward_batch, compress_ratio, *args, **kwargs):
    """DeepseekV4AttnBackend.forward: record the decode query of a CSA layer, then the stock
    forward, whose result is returned unchanged."""
    if compress_ratio == CSA_RATIO and forward_batch.forward_mode.is_decode():
        rec = recorder(backend)
        if rec is not None and rec.wants(layer.layer_id, "queries"):
            # Under attention TP, DeepSeek-V4 pads each rank's heads to 64 with unwritten
            # memory (deepseek_v4.py, q_padded); the layer's tp_q_head_num are the real ones.
            heads = int(getattr(layer, "tp_q_head_num", None) or q.shape[-2])
            queries = q.reshape(q.shape[0], q.shape[-2], q.shape[-1])[: real_rows(q, forward_batch), :heads]
            if "query_heads" not in rec.params:
                tp = rec.params.get("ranks", {})
                shard = tp.get("attn_tp_size", tp.get("tp_size", 1))
                rec.params["query_heads"] = {"heads": heads, "first": 0, "of": heads * int(shard),
                                             "note": "TP rank 0's head shard: model heads 0..heads-1"}
            rec.add_queries(layer.layer_id, queries)
    return original(backend, q, k, v, layer, forward_batch, compress_ratio, *args, **kwargs)


def c4_layer_of(pool, kv_cache) -> int | None:
    """Model layer index of the CSA layer whose C4 buffer `kv_cache` is (any view of it), or
    None (another buffer: the indexer's, C128's, a unified KV layout)."""
    entry = _c4_buffers.get(id(pool))
    if entry is None:
        found = {}
        for i, item in enumerate(getattr(pool, "layer_mapping", None) or []):
            if item is not None and item.compress_ratio == CSA_RATIO and item.compress_kv_pool is not None:
                found[pool.get_extra_key_buffer(i).data_ptr()] = i
        entry = _c4_buffers[id(pool)] = (pool, found)
    return entry[1].get(kv_cache.data_ptr())


def compress_capture(original, backend, **kwargs):
    """CompressorBackendMixin._forward_compress_all_in_one: name the CSA layer for
    store_capture, then the stock call (see the module doc)."""
    layer = rec = None
    if not kwargs.get("is_indexer") and kwargs.get("compress_ratio") == CSA_RATIO:
        rec = recorder(backend)
        if rec is not None:
            # (A bf16_store call writes no paged C4 buffer either: the warning below names it.)
            layer = None if kwargs.get("bf16_store") else c4_layer_of(backend.token_to_kv_pool, kwargs["kv_cache"])
            if layer is None:
                _warn_once("layer", "remnant capture: the C4 compressor writes no paged C4 buffer of the token pool "
                                    "(unified KV layout?); no latents are captured")
    if layer is None or not rec.wants(layer, "latents"):
        return original(backend, **kwargs)
    _current.target = (rec, layer)
    try:
        return original(backend, **kwargs)
    finally:
        _current.target = None


def store_capture(original, kv, plan, *args, out_loc, kvcache, page_size, bf16_store=False, **kwargs):
    """compress_norm_rope_store: the stock store, then the same kernel's bf16 store of the
    same rows into a scratch, whose new records go to the recorder (see the module doc)."""
    result = original(kv, plan, *args, out_loc=out_loc, kvcache=kvcache, page_size=page_size,
                      bf16_store=bf16_store, **kwargs)
    target = getattr(_current, "target", None)
    if target is None or bf16_store or kv.shape[-1] != 512 or kwargs.get("use_fp4"):
        return result
    _current.target = None  # one store per compressor call
    import torch

    rec, layer = target
    n = out_loc.shape[0]
    # NaN marks rows the kernel does not write (tokens that close no record).
    scratch = torch.full((n, 512), float("nan"), dtype=torch.bfloat16, device=kv.device)
    rows = torch.arange(n, dtype=out_loc.dtype, device=out_loc.device)
    original(kv, plan, *args, out_loc=rows, kvcache=scratch.view(torch.uint8), page_size=1, bf16_store=True,
             **kwargs)
    new = (out_loc != 0) & ~scratch.isnan().any(-1)
    if bool(new.any()):
        rec.add_latents(layer, scratch[new])
    return result


def flush_write(result, scheduler, *args, **kwargs):
    """Scheduler.flush_cache (AFTER): where the run asked for it (a marker file beside the
    capture: remnant.calibration.capture_recorder.write_request), write the capture now,
    short of its budget. SGLang stops its schedulers with SIGKILL, so a run asks before it
    stops the server; an ordinary /flush_cache (before each phase) writes nothing."""
    write_requested(_recorder)
    return result


def check_server_args(result, server_args, *args, **kwargs):
    """ServerArgs.check_server_args: what capture needs of the server (see the module doc)."""
    where = f"{ENV_CAPTURE}={settings().path}"
    graphs = getattr(server_args, "cuda_graph_config", None)
    on = {phase: getattr(getattr(graphs, phase, None), "backend", None) for phase in ("decode", "prefill")}
    on = {phase: backend for phase, backend in on.items() if backend not in (None, "disabled")}
    if on or (graphs is None and not getattr(server_args, "disable_cuda_graph", False)):
        got = ", ".join(f"{phase}={backend}" for phase, backend in on.items()) or "on"
        raise ConfigError(f"remnant: {where} needs CUDA graphs off ({got}); add SGLang's --disable-cuda-graph "
                          f"(a graph replay runs no Python, so capture would miss decode steps)")
    if getattr(server_args, "enable_torch_compile", False):
        raise ConfigError(f"remnant: {where} does not allow --enable-torch-compile; compiled code would bypass "
                          f"the capture hooks")
    if getattr(server_args, "speculative_algorithm", None):
        raise ConfigError(f"remnant: {where} does not allow --speculative-algorithm="
                          f"{server_args.speculative_algorithm}; the target model then runs no decode batches")
    if int(getattr(server_args, "dp_size", 1) or 1) > 1 and not getattr(server_args, "enable_dp_attention", False):
        raise ConfigError(f"remnant: {where} does not allow --dp-size={server_args.dp_size} without "
                          f"--enable-dp-attention; allowed: 1 (each data-parallel replica has its own TP rank 0, "
                          f"and they would write the same file)")
    if int(getattr(server_args, "pp_size", 1) or 1) > 1:
        raise ConfigError(f"remnant: {where} does not allow --pp-size={server_args.pp_size}; allowed: 1 "
                          f"(each pipeline stage would write its own layers to the same file)")


#: (target, hook, kind): everything capture mode patches.
TARGETS = [
    (f"{_BACKEND}.forward", attention_capture, "around"),
    (f"{_COMPRESSOR}._forward_compress_all_in_one", compress_capture, "around"),
    (f"{_COMPRESSOR_MODULE}.compress_norm_rope_store", store_capture, "around"),
    (f"{_SCHEDULER}.flush_cache", flush_write, "after"),
    (f"{_SERVER_ARGS}.check_server_args", check_server_args, "after"),
]
