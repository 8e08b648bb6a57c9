"""The continuous-batching loop: batching does not change answers, prefill is chunked
so decodes keep flowing, and a bad request or an abort never stops the engine."""

from __future__ import annotations

import dataclasses
import queue
import threading

import pytest
import torch

from remnant.config import ModelConfig
from remnant.engine.engine import Engine, Request, SamplingParams, TokenEvent
from remnant.engine.model import Model, ModelArgs
from remnant.engine.pools import scratch_pools
from remnant.engine.prefix_cache import PrefixCache

EOS = 257


@pytest.fixture(scope="module")
def model() -> Model:
    return Model(ModelArgs.from_hf_config(dataclasses.asdict(ModelConfig())))


@pytest.fixture
def engine(model):
    pools = scratch_pools(model, 2048, sequences=8)
    e = Engine(model, EOS, pools, PrefixCache(pools), chunked_prefill_size=128)
    e.start()
    yield e
    e.stop()


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class Collector:
    def __init__(self, engine: Engine | None = None):
        self.events: queue.Queue[TokenEvent] = queue.Queue()
        self.steps: list[int] = []
        self.engine = engine
        self.first = threading.Event()

    def __call__(self, ev: TokenEvent) -> None:
        if self.engine is not None:
            self.steps.append(self.engine.steps)
        self.first.set()
        self.events.put(ev)

    def final(self, timeout: float = 60) -> TokenEvent:
        while True:
            ev = self.events.get(timeout=timeout)
            if ev.finish_reason is not None:
                return ev


def _run(engine: Engine, rid: str, ids: list[int], n: int, collector=None) -> Collector:
    c = collector or Collector()
    engine.submit(Request(rid, ids, SamplingParams(n, 0.0, True), c))
    return c


def test_batched_answers_equal_alone(engine):
    prompts = [_ids(n, s) for s, n in enumerate((5, 130, 301, 64))]
    alone = [_run(engine, f"a{i}", p, 6).final().output_ids for i, p in enumerate(prompts)]
    together = [_run(engine, f"b{i}", p, 6) for i, p in enumerate(prompts)]
    assert [c.final().output_ids for c in together] == alone
    assert all(len(o) == 6 for o in alone)


def test_long_prefill_does_not_stall_decodes(engine):
    decoding = Collector(engine)
    _run(engine, "dec", _ids(16, 1), 40, decoding)
    assert decoding.first.wait(30)
    long = _run(engine, "long", _ids(1500, 2), 1)  # 12 chunks of 128 tokens
    long.final()
    done = decoding.final()
    assert len(done.output_ids) == 40
    gaps = [b - a for a, b in zip(decoding.steps, decoding.steps[1:])]
    assert max(gaps) == 1, gaps  # the decode got a token in every engine step


def test_finish_reasons(engine):
    ev = _run(engine, "len", _ids(8, 3), 3).final()
    assert ev.finish_reason == {"type": "length", "length": 3}
    ev = _run(engine, "zero", _ids(8, 3), 0).final()
    assert ev.finish_reason == {"type": "length", "length": 0} and ev.output_ids == []
    # Seeded sampling at a high temperature reaches EOS; with EOS allowed the request stops
    # there and the finish carries the matched id; ignore_eos runs past it.
    c = Collector()
    engine.submit(Request("eos", _ids(8, 4), SamplingParams(200, 5.0, False, seed=1), c))
    ev = c.final()
    assert ev.finish_reason == {"type": "stop", "matched": EOS} and ev.output_ids[-1] == EOS
    n = len(ev.output_ids)
    c = Collector()
    engine.submit(Request("eos2", _ids(8, 4), SamplingParams(n + 5, 5.0, True, seed=1), c))
    ev2 = c.final()
    assert ev2.output_ids[:n] == ev.output_ids and len(ev2.output_ids) == n + 5
    assert ev2.finish_reason == {"type": "length", "length": n + 5}


def test_bad_request_answers_abort_and_engine_lives(engine):
    bad = _run(engine, "bad", [10**6], 2).final()  # id outside the embedding table
    assert bad.finish_reason["type"] == "abort" and "engine error" in bad.finish_reason["message"]
    assert engine.alive
    assert len(_run(engine, "after", _ids(8, 5), 2).final().output_ids) == 2


def _pages_free(engine: Engine) -> int:
    # Every request below has finished, so only the prefix cache holds pages; flush it too.
    assert engine.flush_cache()[0]
    return engine.stats()["pages_free"]


def test_a_seed_torch_refuses_fails_that_request_alone(engine):
    """A seed outside torch's range (the HTTP edge refuses it; the engine must not rely on
    that) used to raise in admission, outside the step's guard, and end the loop."""
    free = _pages_free(engine)
    c = Collector()
    engine.submit(Request("seed", _ids(8, 8), SamplingParams(2, 1.0, True, seed=2**70), c))
    ev = c.final()
    assert ev.finish_reason["type"] == "abort" and ev.finish_reason["status_code"] == 500
    assert "admitting" in ev.finish_reason["message"]
    assert engine.alive and engine.error is None
    assert len(_run(engine, "after-seed", _ids(8, 9), 3).final().output_ids) == 3
    assert _pages_free(engine) == free


def test_an_answer_callback_that_raises_fails_that_request_alone(engine):
    """A request whose answers cannot be delivered (its event loop closed) is dropped with
    its pages given back; the requests batched with it finish."""
    free = _pages_free(engine)

    def broken(ev: TokenEvent) -> None:
        raise RuntimeError("Event loop is closed")

    neighbour = Collector()
    engine.submit(Request("neighbour", _ids(40, 10), SamplingParams(12, 0.0, True), neighbour))
    engine.submit(Request("broken", _ids(40, 11), SamplingParams(12, 0.0, True), broken))
    assert len(neighbour.final().output_ids) == 12
    for _ in range(500):
        if engine.stats()["num_running_reqs"] == 0:
            break
        threading.Event().wait(0.01)
    assert engine.alive and engine.stats()["num_running_reqs"] == 0
    assert _pages_free(engine) == free
    assert len(_run(engine, "after-broken", _ids(8, 12), 2).final().output_ids) == 2


def test_abort_drops_request(engine):
    c = Collector()
    gone = Request("gone", _ids(8, 6), SamplingParams(10_000, 0.0, True), c)
    engine.submit(gone)
    assert c.first.wait(30)
    engine.abort(gone)
    for _ in range(200):
        if (engine.stats()["num_running_reqs"], engine.stats()["num_waiting_reqs"]) == (0, 0):
            break
        threading.Event().wait(0.01)
    assert (engine.stats()["num_running_reqs"], engine.stats()["num_waiting_reqs"]) == (0, 0)


def test_a_dead_engine_answers_at_once(model):
    pools = scratch_pools(model, 512, sequences=2)
    e = Engine(model, EOS, pools, PrefixCache(pools))
    e.start()
    e.stop()  # the loop has ended: a request must not wait for it
    ev = _run(e, "late", _ids(8, 7), 2).final(timeout=5)
    assert ev.finish_reason["type"] == "abort" and ev.finish_reason["status_code"] == 503
