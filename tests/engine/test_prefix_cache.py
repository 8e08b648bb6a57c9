"""Prefix cache and admission: hits change no answer, pressure queues and evicts, every
page comes back."""

from __future__ import annotations

import contextlib
import dataclasses
import queue
from collections.abc import Iterator

import pytest
import torch

from remnant.config import ModelConfig
from remnant.engine.capacity import size_pools
from remnant.engine.engine import Engine, Request, SamplingParams, TokenEvent
from remnant.engine.model import Model, ModelArgs
from remnant.engine.pools import KVPools, geometry_of
from remnant.engine.prefix_cache import PrefixCache

EOS = 257


@pytest.fixture(scope="module")
def model() -> Model:
    return Model(ModelArgs.from_hf_config(dataclasses.asdict(ModelConfig())))


@contextlib.contextmanager
def _engine(model: Model, pages: int, slots: int = 4) -> Iterator[Engine]:
    """A started engine whose pools hold exactly `pages` pages; stopped on exit."""
    geometry = dataclasses.replace(geometry_of(model, max_running_requests=slots), swa_ratio=1.0)
    per_token = sum(geometry.bytes_per_full_token().values())
    budget = int(pages * 256 * per_token) + geometry.c128_state_fixed_bytes() + 1
    pools = KVPools(geometry, size_pools(geometry, budget))
    assert pools.num_pages == pages
    e = Engine(model, EOS, pools, PrefixCache(pools), chunked_prefill_size=256)
    e.start()
    try:
        yield e
    finally:
        e.stop()


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _submit(engine: Engine, rid: str, ids: list[int], n: int) -> "queue.Queue[TokenEvent]":
    q: queue.Queue = queue.Queue()
    engine.submit(Request(rid, ids, SamplingParams(n, 0.0, True), q.put))
    return q


def _final(q: "queue.Queue[TokenEvent]") -> TokenEvent:
    while True:
        ev = q.get(timeout=120)
        if ev.finish_reason is not None:
            return ev


def _drained(engine: Engine) -> None:
    ok, _ = engine.flush_cache()
    assert ok
    usage = engine.pools.usage()
    assert usage["pages_free"] == usage["pages_total"]
    assert usage["swa_blocks_free"] == usage["swa_blocks_total"]
    assert usage["request_slots_free"] == usage["request_slots_total"]
    assert engine.cache.entries == {}


def test_a_hit_gives_the_same_answer(model):
    with _engine(model, pages=16) as engine:
        prompt = _ids(700, 1)
        cold = _final(_submit(engine, "cold", prompt, 12))
        warm = _final(_submit(engine, "warm", prompt, 12))
        assert cold.cached_tokens == 0 and warm.cached_tokens == 512  # two full pages, a token left
        assert warm.output_ids == cold.output_ids
        extended = prompt + cold.output_ids + _ids(300, 2)  # a next turn extends the conversation
        turn = _final(_submit(engine, "turn", extended, 4))
        assert turn.cached_tokens == 512
        stats = engine.stats()
        assert stats["cache_hit_rate"] == pytest.approx((512 + 512) / (700 + 700 + len(extended)))
        _drained(engine)


def test_a_prompt_of_whole_pages_hits_all_but_its_last_page(model):
    with _engine(model, pages=16) as engine:
        prompt = _ids(1024, 9)  # exactly 4 pages: a repeat resumes after 3 (a token must be left)
        cold = _final(_submit(engine, "cold", prompt, 5))
        warm = _final(_submit(engine, "warm", prompt, 5))
        assert warm.cached_tokens == 768 and warm.output_ids == cold.output_ids
        _drained(engine)


@pytest.mark.slow
def test_a_prefix_shorter_than_the_prompts_resume_point_hits(model):
    with _engine(model, pages=24) as engine:
        prefix = _ids(512, 11)  # prompts of 812 tokens resume after 768; the shared part is 512
        events = [_final(_submit(engine, f"u{i}", prefix + _ids(300, 20 + i), 3)) for i in range(3)]
        assert [e.cached_tokens for e in events] == [0, 512, 512]
        unaligned = _ids(1000, 12)  # 1000 shared tokens: 3 whole pages (768) can be reused
        events = [_final(_submit(engine, f"v{i}", unaligned + _ids(64, 30 + i), 3)) for i in range(3)]
        assert [e.cached_tokens for e in events] == [0, 768, 768]
        _drained(engine)


@pytest.mark.slow
def test_concurrent_identical_prompts_share_one_chain(model):
    with _engine(model, pages=24, slots=4) as engine:
        prompt = _ids(900, 13)
        queues = [_submit(engine, f"c{i}", prompt, 3) for i in range(3)]  # computed side by side
        cold = [_final(q) for q in queues]
        warm = _final(_submit(engine, "after", prompt, 3))
        assert warm.cached_tokens == 768 and warm.output_ids == cold[0].output_ids
        assert len(engine.cache.entries) == 3  # one chain of 3 pages, not three
        _drained(engine)


@pytest.mark.slow
def test_shared_prefix_hits_across_suffixes(model):
    with _engine(model, pages=24) as engine:
        prefix = _ids(512, 3)
        events = [_final(_submit(engine, f"s{i}", prefix + _ids(100, 10 + i), 3)) for i in range(4)]
        assert [e.cached_tokens for e in events] == [0, 512, 512, 512]
        _drained(engine)


@pytest.mark.slow
def test_overload_queues_evicts_and_drains(model):
    with _engine(model, pages=8, slots=3) as engine:
        # 12 requests of 2 pages each against 8 pages and 3 slots: most must wait.
        queues = [_submit(engine, f"b{i}", _ids(400, 100 + i), 60) for i in range(12)]
        finals = [_final(q) for q in queues]
        assert all(f.finish_reason == {"type": "length", "length": 60} for f in finals)
        assert len(engine.cache.entries) <= 8  # the cache was evicted to make room
        _drained(engine)


def test_a_request_that_can_never_fit_is_answered(model):
    with _engine(model, pages=4) as engine:
        ev = _final(_submit(engine, "huge", _ids(900, 5), 200))  # 5 pages > 4
        assert ev.finish_reason["type"] == "abort" and ev.finish_reason["status_code"] == 400
        assert "needs 1100 tokens of KV" in ev.finish_reason["message"]
        assert "the pool holds 1024 tokens" in ev.finish_reason["message"]
        assert len(_final(_submit(engine, "ok", _ids(100, 6), 3)).output_ids) == 3  # still serving
        _drained(engine)


@pytest.mark.slow
def test_flush_refused_while_running(model):
    with _engine(model, pages=8) as engine:
        q = _submit(engine, "long", _ids(50, 7), 400)
        q.get(timeout=60)  # first token: it runs
        ok, detail = engine.flush_cache()
        assert not ok and "1 running" in detail
        _final(q)
        _drained(engine)
