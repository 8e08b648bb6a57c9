"""CUDA graphs of the batched decode step, captured per (batch rows, page-table width)
bucket and replayed with padding, as SGLang and nano-vllm capture decode per batch size.

A step of B sequences whose longest holds P pages replays the graph of the smallest batch
bucket >= B and the smallest page bucket (a power of two) >= P; its inputs are copied into
that graph's static DecodeBatch, padding rows and pages pointing at the pools' padding page,
block and slot (remnant.engine.pools), so they write only there. A bucket is captured the
first time a step needs it (capture writes only padding too: it runs an all-padding batch),
after one eager warm-up run that compiles the Triton kernels and fills FlashMLA's schedule
outside the capture. Batches above `max_batch` run eagerly. Graphs share one memory pool:
each replay's logits are copied out before the next replay.

`stats` is a dict kept current (buckets, what was captured and how long it took), which
/server_info shows; each capture is also logged.
"""

from __future__ import annotations

import logging
import time

import torch

from remnant.engine.decode_step import DecodeBatch, decode_step

log = logging.getLogger(__name__)


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every 8 to 64, every 16 to 256, every 64 beyond, up to max_batch (a
    padded row costs its share of a step, so buckets stay close together where steps are
    weight-bound and cheap)."""
    sizes = [1, 2, 4] + list(range(8, 65, 8)) + list(range(80, 257, 16)) + list(range(320, max_batch + 64, 64))
    return sorted({min(s, max_batch) for s in sizes if s <= max_batch} | {max_batch})


def page_bucket(pages: int) -> int:
    """The smallest power of two >= pages (>= 1)."""
    return 1 << max(pages - 1, 0).bit_length()


class DecodeGraphs:
    """Captured decode steps of one model (remnant.engine.model.Model) over one set of pools."""

    def __init__(self, model, max_batch: int):
        if max_batch < 1:
            raise ValueError(f"cuda_graph_max_bs={max_batch} must be >= 1")
        self.model = model
        self.buckets = batch_buckets(max_batch)
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, DecodeBatch, torch.Tensor]] = {}
        self._pool = None
        #: The pools the graphs were captured over: their buffers' addresses are baked in.
        self._pools = None
        self.stats = {"enabled": True, "batch_buckets": self.buckets, "page_buckets": "powers of two",
                      "captured": [], "capture_s": 0.0, "replays": 0, "eager_steps": 0}

    def run(self, seqs: list, tokens: "list[int] | torch.Tensor", pools) -> torch.Tensor:
        """The decode step of `seqs` extended by `tokens` (host ints or a device tensor:
        DecodeBatch.of): float32 logits [len(seqs), vocab]."""
        rows = next((b for b in self.buckets if b >= len(seqs)), None)
        if rows is None:
            self.stats["eager_steps"] += 1
            batch = DecodeBatch.of(seqs, tokens, pools, self.model.device)
            return decode_step(self.model, pools, batch, self.model.attention)
        if pools is not self._pools:
            self.clear()  # graphs of other pools would read and write their (maybe freed) buffers
            self._pools = pools
        pages = min(page_bucket(max(len(s.pages) for s in seqs)), page_bucket(pools.num_pages))
        key = (rows, pages)
        if key not in self._graphs:
            self._graphs[key] = self._capture(rows, pages, pools)
        graph, static, logits = self._graphs[key]
        DecodeBatch.of(seqs, tokens, pools, self.model.device, rows, pages).copy_into(static)
        graph.replay()
        self.stats["replays"] += 1
        return logits[: len(seqs)].clone()

    def clear(self) -> None:
        """Drop every captured graph (the next step of each bucket captures again): after
        the model's formats or weights change, or over new pools."""
        self._graphs.clear()
        self._pools = None
        # A fresh memory pool too: capturing into the pool of graphs since destroyed trips
        # the caching allocator (PyTorch 2.11: "use_count > 0 INTERNAL ASSERT FAILED").
        self._pool = None

    def _capture(self, rows: int, pages: int, pools):
        """Warm up, then capture, the step of an all-padding batch of `rows` rows and `pages`
        page-table columns; returns (graph, its static inputs, its static logits)."""
        t0 = time.perf_counter()
        static = DecodeBatch.of([], [], pools, self.model.device, rows, pages)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.inference_mode():
            decode_step(self.model, pools, static, self.model.attention)  # compiles, fills schedules
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(graph, pool=self._pool):
            logits = decode_step(self.model, pools, static, self.model.attention)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        self.stats["captured"].append({"batch": rows, "pages": pages, "seconds": round(seconds, 3)})
        self.stats["capture_s"] = round(self.stats["capture_s"] + seconds, 3)
        log.info("captured the decode step of batch %d, %d pages in a CUDA graph in %.2f s", rows, pages, seconds)
        return graph, static, logits
