"""The continuous-batching loop: batching does not change answers, prefill is chunked
so decodes keep flowing, and a bad request or an abort never stops the engine nor keeps
any of the pools' pages, SWA blocks or request slots once it has ended."""

from __future__ import annotations

import dataclasses
import queue
import threading

import pytest
import torch

from remnant.config import ModelConfig
from remnant.engine.engine import Engine, Request, SamplingParams, TokenEvent
from remnant.engine.capacity import size_pools
from remnant.engine.model import Model, ModelArgs
from remnant.engine.pools import KVPools, geometry_of, scratch_pools
from remnant.engine.prefix_cache import PrefixCache

EOS = 257


@pytest.fixture(scope="module")
def model() -> Model:
    return Model(ModelArgs.from_hf_config(dataclasses.asdict(ModelConfig())))


@pytest.fixture(params=[(False, False), (True, False), (True, True)],
                ids=["answers-between-steps", "answers-overlapped", "launched-ahead"])
def engine(model, request):
    """Every behaviour below holds whether a step's answers go out before the next step is
    launched or after it (overlap_answers), and whether greedy decode steps are launched
    before the last one is read (launch_ahead): the GPU's defaults."""
    pools = scratch_pools(model, 2048, sequences=8)
    overlap, ahead = request.param
    e = Engine(model, EOS, pools, PrefixCache(pools), chunked_prefill_size=128, overlap_answers=overlap,
               launch_ahead=ahead)
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
    if not engine.launch_ahead:
        assert max(gaps) == 1, gaps  # the decode got a token in every engine step
    else:
        # A step launched ahead is answered after the next launch, or before it where the
        # next step differs (a prefill joins, or none is left): each answer's step count is
        # its step's or one more, so a gap of 2 or 0 is that lag moving, and the steps from
        # the first answer to the last are as many as the tokens, less at most one.
        assert max(gaps) <= 2 and len(gaps) - 1 <= sum(gaps) <= len(gaps), gaps


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


def assert_pools_at_totals(engine: Engine) -> None:
    """Once every request has ended and the prefix cache is flushed, every page, SWA block
    and request slot is free again: nothing leaked."""
    assert engine.flush_cache()[0]
    s = engine.stats()
    held = {k: (s[f"{k}_free"], s[f"{k}_total"]) for k in ("pages", "swa_blocks", "request_slots")}
    assert all(free == total for free, total in held.values()), held


def _wait_idle(engine: Engine, within_s: float = 5.0) -> None:
    for _ in range(int(within_s / 0.01)):
        if (engine.stats()["num_running_reqs"], engine.stats()["num_waiting_reqs"]) == (0, 0):
            return
        threading.Event().wait(0.01)
    raise AssertionError(f"requests still held {within_s} s later: {engine.stats()}")


def test_a_seed_torch_refuses_fails_that_request_alone(engine):
    """A seed outside torch's range (the HTTP edge refuses it; the engine must not rely on
    that) used to raise in admission, outside the step's guard, and end the loop."""
    c = Collector()
    engine.submit(Request("seed", _ids(8, 8), SamplingParams(2, 1.0, True, seed=2**70), c))
    ev = c.final()
    assert ev.finish_reason["type"] == "abort" and ev.finish_reason["status_code"] == 500
    assert "admitting" in ev.finish_reason["message"]
    assert engine.alive and engine.error is None
    assert len(_run(engine, "after-seed", _ids(8, 9), 3).final().output_ids) == 3
    assert_pools_at_totals(engine)


def test_an_answer_callback_that_raises_fails_that_request_alone(engine):
    """A request whose answers cannot be delivered (its event loop closed) is dropped with
    everything it holds; the requests batched with it finish. It asked for 10,000 tokens:
    kept running, it would hold its slot long after its neighbour ended."""

    def broken(ev: TokenEvent) -> None:
        raise RuntimeError("Event loop is closed")

    neighbour = Collector()
    engine.submit(Request("neighbour", _ids(40, 10), SamplingParams(12, 0.0, True), neighbour))
    engine.submit(Request("broken", _ids(40, 11), SamplingParams(10_000, 0.0, True), broken))
    assert len(neighbour.final().output_ids) == 12
    _wait_idle(engine)
    assert engine.alive and engine.stats()["generated_tokens"] < 100
    assert_pools_at_totals(engine)
    assert len(_run(engine, "after-broken", _ids(8, 12), 2).final().output_ids) == 2


def test_a_failed_batch_fails_only_the_request_at_fault(engine):
    """A prompt token outside the embedding table makes the batched forward raise; the
    step runs again one request at a time, and only that request fails: the neighbour
    decoding beside it gets the answer it gets alone."""
    alone = _run(engine, "alone", _ids(16, 13), 30).final().output_ids
    neighbour = Collector()
    engine.submit(Request("beside", _ids(16, 13), SamplingParams(30, 0.0, True), neighbour))
    assert neighbour.first.wait(30)
    bad = _run(engine, "bad-id", [1, 10**6, 2], 2).final()
    assert bad.finish_reason["type"] == "abort" and bad.finish_reason["status_code"] == 500
    done = neighbour.final()
    assert done.finish_reason == {"type": "length", "length": 30} and done.output_ids == alone
    assert engine.alive and engine.error is None
    assert_pools_at_totals(engine)


class LaunchLog(Model):
    """The real model, whose every forward (a step's launch) is logged in `log`."""

    log: list

    def forward(self, seqs, chunks, pools):
        self.log.append("launch")
        return super().forward(seqs, chunks, pools)


L = "launch"


@pytest.mark.parametrize("overlap, requests, expected", [
    (False, [("A", 8, 4)], [L, "A1", L, "A2", L, "A3", L, "A4"]),
    # Each step's answer after the next launch; the last, with no step to launch, at once.
    (True, [("A", 8, 4)], [L, L, "A1", L, "A2", L, "A3", "A4"]),
    # B's 300-token prompt is prefilled in chunks of 120, 128, 8 (to its page's end) and 44
    # tokens beside A's decodes, steps whose launch waits for the GPU: the answers held
    # go out before them. Then decode-only steps: after the launch.
    (False, [("A", 8, 6), ("B", 300, 1)], [L, "A1", L, "A2", L, "A3", L, "A4", "B1", L, "A5", L, "A6"]),
    (True, [("A", 8, 6), ("B", 300, 1)], [L, "A1", L, "A2", L, "A3", L, L, "A4", "B1", L, "A5", "A6"]),
], ids=["decode-between-steps", "decode-overlapped", "prefill-between-steps", "prefill-overlapped"])
def test_overlapped_answers_go_out_after_the_next_decode_launch_in_order(overlap, requests, expected):
    model = LaunchLog(ModelArgs.from_hf_config(dataclasses.asdict(ModelConfig())))
    model.log = log = []
    pools = scratch_pools(model, 1024, sequences=2)
    engine = Engine(model, EOS, pools, PrefixCache(pools, enabled=False), chunked_prefill_size=128,
                    overlap_answers=overlap)
    engine.start()
    try:
        collectors = []
        with engine._cv:  # queued together: admitted in the same step
            for rid, prompt, new in requests:
                c = Collector()

                def answer(ev: TokenEvent, rid=rid, c=c) -> None:
                    log.append(f"{rid}{len(ev.output_ids)}")
                    c(ev)

                engine.submit(Request(rid, _ids(prompt, 40), SamplingParams(new, 0.0, True), answer))
                collectors.append((c, new))
        for c, new in collectors:
            assert c.final().finish_reason == {"type": "length", "length": new}
        assert log == expected
    finally:
        engine.stop()


class DyingModel(Model):
    """The real model, whose third forward raises past the engine's guards (SystemExit):
    the engine loop dies."""

    calls = 0

    def forward(self, seqs, chunks, pools):
        self.calls += 1
        if self.calls == 3:
            raise SystemExit("the third step")
        return super().forward(seqs, chunks, pools)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the death is the test
@pytest.mark.parametrize("overlap", [False, True], ids=["answers-between-steps", "answers-overlapped"])
def test_a_dying_loop_sends_the_answers_it_held_then_the_abort(overlap):
    """Where the loop dies, a request gets every token it was answered before the abort
    (the tokens of the last two steps were still held with overlap_answers)."""
    model = DyingModel(ModelArgs.from_hf_config(dataclasses.asdict(ModelConfig())))
    pools = scratch_pools(model, 512, sequences=2)
    engine = Engine(model, EOS, pools, PrefixCache(pools, enabled=False), overlap_answers=overlap)
    engine.start()
    c = Collector()
    engine.submit(Request("r", _ids(8, 50), SamplingParams(10, 0.0, True), c))
    events = [c.events.get(timeout=60)]
    while events[-1].finish_reason is None:
        events.append(c.events.get(timeout=60))
    assert [(len(ev.output_ids), ev.finish_reason is None) for ev in events] == [(1, True), (2, True), (2, False)]
    last = events[-1].finish_reason
    assert last["status_code"] == 500 and "engine loop died" in last["message"]
    engine._thread.join(10)
    assert not engine.alive and engine.error is not None


POISON = 256  # a token of the vocabulary (BOS), in no prompt of _ids


class PoisonedModel(Model):
    """The real model, whose forward raises in its second layer (after the first layers
    wrote the step's window, compressor state and records) when a prefill chunk of the
    step holds POISON: a failure in the middle of a step. It keeps the logits each step
    gave each sequence, by the tokens the sequence then held."""

    poisoned = False

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seen: dict[tuple[int, ...], torch.Tensor] = {}

    def forward(self, seqs, chunks, pools):
        self.poisoned = any(len(c) > 1 and POISON in c for c in chunks)
        out = super().forward(seqs, chunks, pools)
        for seq, row in zip(seqs, out):
            self.seen[tuple(seq.token_ids)] = row.detach().cpu().clone()
        return out

    def ffn(self, layer, h):
        if self.poisoned and layer is self.layers[1]:
            raise RuntimeError("poisoned prefill chunk")
        return super().ffn(layer, h)


@pytest.mark.parametrize("overlap", [False, True], ids=["answers-between-steps", "answers-overlapped"])
def test_a_step_that_fails_midway_is_run_again_alone_from_its_state(overlap):
    """The batched step failed after writing part of its KV; each request's step runs
    again alone, a prefill chunk from the window and compressor state it had before (it
    overwrites what it reads), so the requests beside the failing one get what they get
    alone: one in the middle of its prompt, one decoding. Without that state the long
    prompt's logits moved by ~0.02 (its greedy tokens did not), hence logits compared."""
    model = PoisonedModel(ModelArgs.from_hf_config(dataclasses.asdict(ModelConfig())))
    pools = scratch_pools(model, 2048, sequences=4)
    engine = Engine(model, EOS, pools, PrefixCache(pools, enabled=False), chunked_prefill_size=1024,
                    overlap_answers=overlap)
    engine.start()
    try:
        long_prompt, short_prompt = _ids(700, 22), _ids(8, 23)
        alone = [_run(engine, "long-alone", long_prompt, 5).final().output_ids,
                 _run(engine, "short-alone", short_prompt, 20).final().output_ids]
        alone_logits = dict(model.seen)
        model.seen.clear()
        # Queued together (the engine waits on its lock), the three share every step: step 1
        # prefills a page of each and the short prompt whole; step 2 holds the long prompt's
        # second page, the poisoned one's and the short request's first decode.
        long, short, bad = Collector(), Collector(), Collector()
        with engine._cv:
            engine.submit(Request("long", long_prompt, SamplingParams(5, 0.0, True), long))
            engine.submit(Request("poisoned", _ids(256, 20) + [POISON] + _ids(50, 21),
                                  SamplingParams(5, 0.0, True), bad))
            engine.submit(Request("short", short_prompt, SamplingParams(20, 0.0, True), short))
        ev = bad.final()
        assert ev.finish_reason["type"] == "abort" and "poisoned prefill chunk" in ev.finish_reason["message"]
        assert [long.final().output_ids, short.final().output_ids] == alone
        for tokens in (long_prompt, long_prompt + alone[0][:-1], short_prompt + alone[1][:-1]):
            torch.testing.assert_close(model.seen[tuple(tokens)], alone_logits[tuple(tokens)], atol=1e-4, rtol=0)
        assert engine.alive and engine.error is None
        assert_pools_at_totals(engine)
    finally:
        engine.stop()


@pytest.fixture(params=[False, True], ids=["answers-between-steps", "answers-overlapped"])
def small_engine(model, request):
    """10 pages of 256 tokens, 2 SWA blocks, 2 request slots."""
    geometry = geometry_of(model, 256, 0.1, 2)
    per_token = sum(geometry.bytes_per_full_token().values())
    pools = KVPools(geometry, size_pools(geometry, int(2560 * per_token) + geometry.c128_state_fixed_bytes() + 1))
    assert (pools.num_pages, pools.swa_blocks.n, pools.slots.n) == (10, 2, 2)
    e = Engine(model, EOS, pools, PrefixCache(pools), chunked_prefill_size=512, overlap_answers=request.param)
    e.start()
    yield e
    e.stop()


def test_a_request_whose_checkpoint_gives_way_misses_and_holds_nothing(small_engine):
    """B would resume from A's cached 512-token prefix, whose window checkpoint holds the
    last free SWA block while C runs. Admission gives that checkpoint up to make room for
    B's own window: B used to copy from the checkpoint just freed, fail with a 500 and
    keep 3 pages, an SWA block and a slot for ever. Now B misses and is served."""
    e = small_engine
    prompt = _ids(600, 30)
    assert _run(e, "A", prompt, 2).final().finish_reason["type"] == "length"
    c = Collector()
    e.submit(Request("C", [5] * 10, SamplingParams(60, 0.0, True), c))
    assert c.first.wait(30)
    s = e.stats()
    assert (s["swa_blocks_free"], s["swa_blocks_cached"]) == (0, 1)  # C's window, A's checkpoint
    b = _run(e, "B", prompt[:512] + [7] * 50, 4).final()
    assert b.finish_reason == {"type": "length", "length": 4} and b.cached_tokens == 0
    assert c.final().finish_reason["type"] == "length"
    assert_pools_at_totals(e)
    again = _run(e, "B-cold", prompt[:512] + [7] * 50, 4).final()
    assert again.output_ids == b.output_ids and again.cached_tokens == 0
    assert_pools_at_totals(e)


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


class EosAtLength(Model):
    """The real model, whose logits make EOS the greedy token of a sequence whose step
    brings it to `at` tokens, and which logs whether each forward got its tokens on the
    device (a step launched ahead of reading the last)."""

    at = 13

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.ahead: list[bool] = []

    def forward(self, seqs, chunks, pools):
        self.ahead.append(isinstance(chunks, torch.Tensor))
        out = super().forward(seqs, chunks, pools)
        for i, seq in enumerate(seqs):
            if seq.length == self.at:
                out[i, EOS] = 1e9
        return out


def test_a_greedy_stop_at_eos_while_the_next_step_runs_drops_that_token():
    """With launch_ahead, A's step that ends at EOS has already been followed by A's next
    step, launched on the device's tokens: A stops at EOS all the same, its extra token
    dropped; B beside it, which goes on alone from there (a subset of the step's rows),
    gets what it gets alone; nothing stays held."""
    model = EosAtLength(ModelArgs.from_hf_config(dataclasses.asdict(ModelConfig())))
    pools = scratch_pools(model, 1024, sequences=2)
    engine = Engine(model, EOS, pools, PrefixCache(pools), chunked_prefill_size=128, launch_ahead=True)
    engine.start()
    try:
        b_prompt = _ids(40, 60)
        alone = _run(engine, "b-alone", b_prompt, 12).final().output_ids
        a, b = Collector(), Collector()
        with engine._cv:  # admitted in the same step
            engine.submit(Request("a", _ids(8, 61), SamplingParams(20, 0.0, False), a))
            engine.submit(Request("b", b_prompt, SamplingParams(12, 0.0, True), b))
        ev = a.final()
        # 8 prompt tokens, then outputs at lengths 8..13: the sixth is EOS.
        assert ev.finish_reason == {"type": "stop", "matched": EOS} and len(ev.output_ids) == 6
        assert ev.output_ids[-1] == EOS and EOS not in ev.output_ids[:-1]
        assert b.final().output_ids == alone
        assert any(model.ahead) and not all(model.ahead)  # steps launched ahead, and prefills not
        _wait_idle(engine)
        assert_pools_at_totals(engine)
    finally:
        engine.stop()


def _answers_with_and_without_launch_ahead(device: str) -> dict[bool, list[list[int]]]:
    """Four greedy requests queued together: a chunked prefill budget of 64 tokens lets the
    long prompts and the last request in over several steps while the others decode (each
    such step reads the held step first), and they end at different lengths (the held
    step's rows then a subset). Queued at once, the steps' batches do not depend on timing,
    so both runs take the same steps. Returns each run's outputs."""
    outputs = {}
    for ahead in (False, True):
        model = EosAtLength(ModelArgs.from_hf_config(dataclasses.asdict(ModelConfig())), device=device)
        model.at = -1  # no EOS forced: only the log of steps launched ahead
        pools = scratch_pools(model, 1024, sequences=4)
        engine = Engine(model, EOS, pools, PrefixCache(pools), chunked_prefill_size=64, launch_ahead=ahead)
        engine.start()
        try:
            collectors = []
            with engine._cv:
                for i, (n, new) in enumerate([(5, 9), (70, 4), (130, 7), (3, 11)]):
                    collectors.append(_run(engine, f"r{i}", _ids(n, 70 + i), new))
            outputs[ahead] = [c.final().output_ids for c in collectors]
            assert any(model.ahead) == ahead
            assert [len(o) for o in outputs[ahead]] == [9, 4, 7, 11]
            if model.graphs is not None:
                assert model.graphs.stats["replays"] > 0
        finally:
            engine.stop()
    return outputs


def test_launch_ahead_gives_the_answers_of_reading_each_step():
    """The same tokens with launch_ahead as without: only when the host reads them moves."""
    outputs = _answers_with_and_without_launch_ahead("cpu")
    assert outputs[True] == outputs[False]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_launch_ahead_on_cuda_gives_the_answers_of_reading_each_step():
    """On the GPU, where the launch is asynchronous: decode steps replayed from CUDA graphs
    on the device's tokens (padded into the graph's batch) and read through a pinned copy
    behind them give the tokens of steps read one by one."""
    outputs = _answers_with_and_without_launch_ahead("cuda")
    assert outputs[True] == outputs[False]
