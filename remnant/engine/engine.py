"""Scheduler of the embedded engine: admission by free pool capacity, continuous batching,
chunked prefill, prefix cache.

One engine thread owns the model and the pools' contents. Each step it admits waiting
requests in arrival order while the pools have room for them (a request reserves the
pages of its prompt plus max_new_tokens, less what the prefix cache already holds, one
SWA block and one request slot; the cache gives up least-recently-used pages when short),
gives each running request either its next prefill chunk (at most one page of it, and at
most `chunked_prefill_size` prompt tokens per step over all requests) or one decode token, runs them as one batch, samples, and
reports tokens through each request's `emit` callback. A request that could never fit
is answered with an error; under pressure requests wait, they never crash the engine.

Whatever fails while the engine admits, steps or answers a request fails that request
alone: it is answered with an abort (status 500), whatever it held goes back (admission
takes nothing until everything fits and undoes what it took when something fails), and
the loop goes on serving. A batched forward that fails is run again one request at a
time, from the state before it (see `_step`), so only a request whose own step fails is
failed. A request whose answer cannot be delivered (its callback raises) is dropped.
Requests are validated at the HTTP edge (remnant.engine.api); these guards are for what
validation cannot foresee.

With `overlap_answers` (on for the GPU: remnant.engine.served) a step's answers go out
after the next decode step is launched, while the GPU runs it, not between the two
steps. The server's event loop turns each answer into a streamed frame (decoding, JSON,
the socket write), Python that shares the interpreter lock with this thread: between
steps it held up the next step's launch, and the GPU waited, for every stream's frame of
every token. Each answer then goes out one launch later (a decode step's launch returns
before the step runs: remnant.engine.graphs); their order is kept. Before a step with a
prefill chunk they go out first: its launch waits for the GPU (a blocking copy at its end).

With `launch_ahead` (on for the GPU) a decode step whose requests all decode greedily
(temperature 0, as benchmark clients ask) is not read back at once: its tokens are taken
on the device (argmax) and copied behind it, and the next decode step of the same requests
is launched with those tokens as its input before the host reads them, as SGLang's overlap
scheduler does. The host's work between two steps (reading the tokens, answering, building
and launching the next batch) then runs while the GPU computes, not while it waits. A
request whose length ends at the step is left out of the next one (its finish is known in
advance); one that stops at EOS there has already been launched for one more token, which
is dropped (its step writes only its own pages, and whatever reuses them is queued behind
that step on the device). A step that admits a request, prefills, or samples at a
temperature reads the held step first, as before.
"""

from __future__ import annotations

import logging
import math
import threading
import zlib
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch

from remnant.engine.capacity import C4_RING, C128_RING
from remnant.engine.model import Model
from remnant.engine.pools import KVPools
from remnant.engine.prefix_cache import PrefixCache, chain_key
from remnant.engine.sequence import Sequence

log = logging.getLogger(__name__)

#: Below this, temperature means greedy, as SGLang's sampling params treat it.
GREEDY_BELOW = 1e-6


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    ignore_eos: bool = False
    seed: int | None = None


@dataclass
class TokenEvent:
    """What a request has produced so far; `finish_reason` is set on its last event."""

    output_ids: list[int]
    finish_reason: dict | None
    cached_tokens: int = 0


@dataclass
class DeviceTokens:
    """A step's greedy tokens taken on the device, and their copy to the host queued behind
    the step (read_tokens waits for that copy, not for what is launched after it)."""

    tokens: torch.Tensor  # int64 [B] on the model's device: each row's greedy token
    host: torch.Tensor  # their copy on the host (pinned on cuda)
    copied: "torch.cuda.Event | None"  # recorded after that copy (None on cpu: already done)

    @classmethod
    def of(cls, logits: torch.Tensor) -> "DeviceTokens":
        tokens = logits.argmax(-1)
        if tokens.device.type != "cuda":
            return cls(tokens, tokens, None)
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        return cls(tokens, host, copied)

    def read(self) -> list[int]:
        if self.copied is not None:
            self.copied.synchronize()
        return self.host.tolist()


@dataclass
class _Held:
    """A greedy decode step launched and not yet read (launch_ahead)."""

    requests: list["Request"]
    tokens: DeviceTokens


@dataclass(eq=False)
class Request:
    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    emit: Callable[[TokenEvent], None]
    seq: Sequence | None = None
    prefilled: int = 0
    cached_tokens: int = 0
    output_ids: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None
    aborted: bool = False
    #: prefix-cache keys this request pins (matched pages, then pages it completed)
    keys: list[bytes] = field(default_factory=list)
    cached_pages: set[int] = field(default_factory=set)
    #: hash keys of the prompt's pages, computed once (see PrefixCache.resume_keys)
    prompt_keys: list[bytes] | None = None


class Engine:
    def __init__(
        self,
        model: Model,
        eos_token_id: int,
        pools: KVPools,
        cache: PrefixCache | None = None,
        chunked_prefill_size: int = 512,
        overlap_answers: bool = False,
        launch_ahead: bool = False,
    ):
        self.model = model
        self.eos_token_id = eos_token_id
        self.pools = pools
        self.cache = cache or PrefixCache(pools, enabled=False)
        self.chunked_prefill_size = chunked_prefill_size
        self.overlap_answers = overlap_answers
        self.launch_ahead = launch_ahead
        #: The step launched ahead and not yet read (launch_ahead).
        self._held: _Held | None = None
        #: (request, event) answers held for the next launch (overlap_answers), in order.
        self._answers: list[tuple[Request, TokenEvent]] = []
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []
        self._cv = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="remnant-engine", daemon=True)
        self.steps = 0
        self.generated_tokens = 0
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.error: str | None = None

    # Thread-safe API ------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join(timeout=10)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, request: Request) -> None:
        with self._cv:
            if self.error is not None or not self._thread.is_alive():
                request.emit(TokenEvent([], self._abort_reason(self.error or "the engine is not running", 503)))
                return
            self._waiting.append(request)
            self._cv.notify()

    def abort(self, request: Request) -> None:
        """Stop a request (its client went away): a waiting one leaves the queue now, a running
        one is dropped at the next step."""
        with self._cv:
            request.aborted = True
            if request in self._waiting:
                self._waiting.remove(request)
            self._cv.notify()

    def flush_cache(self) -> tuple[bool, str]:
        """Empty the prefix cache; refused while requests run or wait (as SGLang)."""
        with self._cv:
            if self._running or self._waiting:
                return False, f"{len(self._running)} running and {len(self._waiting)} waiting requests"
            freed = self.cache.flush()
            return True, f"freed {freed} pages"

    def stats(self) -> dict:
        with self._cv:
            usage = self.pools.usage()
            evictable = self.cache.evictable_pages()
            return {
                **usage,
                "pages_cached": len(self.cache.entries),
                # SWA blocks held as window checkpoints: idle, free + cached = total
                "swa_blocks_cached": sum(1 for e in self.cache.entries.values() if e.window is not None),
                "pages_evictable": evictable,
                "token_usage": 1.0 - (usage["pages_free"] + evictable) / max(usage["pages_total"], 1),
                "num_running_reqs": len(self._running),
                "num_waiting_reqs": len(self._waiting),
                "prompt_tokens": self.prompt_tokens,
                "cached_tokens": self.cached_tokens,
                "generated_tokens": self.generated_tokens,
                "cache_hit_rate": self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
                "engine_steps": self.steps,
            }

    # Engine thread ----------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            while True:
                batch: list[Request] = []
                try:
                    if not self._running:
                        self._send_answers()  # no step to launch: they go out now
                    with self._cv:
                        while not self._stop and not self._waiting and not self._running:
                            self._cv.wait()
                        if self._stop:
                            if self._held is not None:
                                self._read_held()
                            self._send_answers()
                            return
                        for r in [r for r in self._running if r.aborted]:
                            self._release_quietly(r)
                        self._admit()
                        batch = list(self._running)
                        if not batch and self._waiting:
                            self._cv.wait(timeout=0.05)  # pools full of nothing: cannot happen; be safe
                    if batch:
                        self._step(batch)
                except Exception as exc:  # noqa: BLE001 - outside the per-request guards: a bug
                    # Fail the batch this iteration stepped, keep the queue, keep serving.
                    log.exception("engine iteration failed")
                    with self._cv:
                        for r in [r for r in batch if r in self._running]:
                            self._fail(r, f"engine error: {exc!r}")
                    self._send_answers()
                    if not batch:
                        with self._cv:
                            self._cv.wait(timeout=0.05)  # nothing to blame: do not spin on it
        except BaseException as exc:  # the loop must never die silently: answer everyone
            self.error = f"engine loop died: {exc!r}"
            log.exception("engine loop died")
            with self._cv:
                for r in (*self._waiting, *self._running):
                    self._emit(r, TokenEvent(list(r.output_ids), self._abort_reason(self.error, 500)))
                self._waiting.clear()
                self._running.clear()
            self._send_answers()
            raise

    @staticmethod
    def _abort_reason(message: str, status: int, err_type: str = "EngineError") -> dict:
        return {"type": "abort", "message": message, "status_code": status, "err_type": err_type}

    def _admit(self) -> None:
        """Move waiting requests to running while the pools have room (arrival order)."""
        while self._waiting:
            r = self._waiting[0]
            if r.aborted:
                self._waiting.popleft()
                continue
            try:
                verdict = self._reserve(r)
            except Exception as exc:  # noqa: BLE001 - this request fails, the queue moves on
                log.exception("admitting request %s failed", r.rid)
                self._waiting.popleft()
                self._fail(r, f"engine error while admitting the request: {exc!r}")
                continue
            if verdict is None:
                return  # wait for capacity
            self._waiting.popleft()
            if verdict:
                self._running.append(r)

    def _reserve(self, r: Request) -> bool | None:
        """Give `r` its pages, SWA block and slot: True; refuse it for good: False; wait: None.

        Nothing is taken before everything fits, and a failure while taking gives back what
        was taken (pages, block, slot, pinned prefix) before it propagates, so a request
        that fails here holds nothing."""
        pools, size = self.pools, self.pools.page_size
        if r.generator is None:
            # First, before anything is allocated: the seed is the request's own value
            # (torch takes -2**63 .. 2**64-1; the HTTP edge allows int64).
            seed = r.sampling.seed if r.sampling.seed is not None else zlib.crc32(r.rid.encode())
            r.generator = torch.Generator().manual_seed(seed)
        total = len(r.input_ids) + r.sampling.max_new_tokens
        pages_needed = math.ceil(total / size)
        if pages_needed > pools.num_pages or pools.slots.n == 0:
            self._emit(r, TokenEvent([], self._abort_reason(
                f"the request needs {total} tokens of KV ({len(r.input_ids)} prompt + "
                f"{r.sampling.max_new_tokens} new); the pool holds {pools.num_pages * size} tokens",
                400, "CapacityError")))
            return False
        if pools.slots.free == 0:
            return None
        if r.prompt_keys is None:  # a request waiting for room is matched again each step
            r.prompt_keys = self.cache.resume_keys(r.input_ids) if self.cache.enabled else []
        hit, keys = self.cache.match(r.prompt_keys)
        if not self._pages_fit(keys, pages_needed):
            return None  # evicting would not make room: wait, and keep the cache
        if pools.swa_blocks.free == 0:
            # A window checkpoint gives way. It may be the one this request would resume
            # from: match again, so that a checkpoint gone is a shorter match (or a miss).
            self.cache.evict_windows(1)
            hit, keys = self.cache.match(r.prompt_keys)
            if pools.swa_blocks.free == 0 or not self._pages_fit(keys, pages_needed):
                return None
        fresh = pages_needed - len(keys)
        matched = self.cache.pin(keys)
        taken: list[tuple] = []  # (free list, ids) to give back if what follows fails
        try:
            if pools.pages.free < fresh:
                self.cache.evict_pages(fresh - pools.pages.free)
            for free_list, count in ((pools.pages, fresh), (pools.swa_blocks, 1), (pools.slots, 1)):
                ids = free_list.alloc(count)
                if ids is None:
                    raise RuntimeError(f"{count} {free_list.name}(s) were counted free but could not be allocated")
                taken.append((free_list, ids))
            (_, pages), (_, (block,)), (_, (slot,)) = taken
            seq = Sequence(matched + pages, block, slot)
            if hit:
                checkpoint = self.cache.window_of(keys[-1])
                if checkpoint is None:
                    raise RuntimeError("the window checkpoint of the matched prefix is gone")
                pools.swa.copy_block(block, checkpoint)
                seq.length = hit
                seq.token_ids = list(r.input_ids[:hit])
        except BaseException:
            for free_list, ids in taken:
                free_list.release(ids)
            self.cache.unpin(keys)
            raise
        r.seq, r.prefilled, r.cached_tokens = seq, hit, hit
        r.keys = list(keys)
        r.cached_pages = set(matched)
        self.prompt_tokens += len(r.input_ids)
        self.cached_tokens += hit
        return True

    def _pages_fit(self, keys: list[bytes], pages_needed: int) -> bool:
        """Whether a request of `pages_needed` pages, `keys` of them matched in the cache,
        finds the rest among free pages and cached pages nobody uses (its own excluded)."""
        self.cache.pin(keys)
        try:
            return self.pools.pages.free + self.cache.evictable_pages() >= pages_needed - len(keys)
        finally:
            self.cache.unpin(keys)

    def _release(self, r: Request) -> None:
        """Give back everything `r` holds; its completed pages stay in the prefix cache."""
        if r in self._running:
            self._running.remove(r)
        seq, r.seq = r.seq, None
        if seq is None:
            return
        self.cache.unpin(r.keys)
        self.pools.pages.release([p for p in seq.pages if p not in r.cached_pages])
        self.pools.swa_blocks.release([seq.swa_block])
        self.pools.slots.release([seq.slot])

    def _step(self, running: list[Request]) -> None:
        if self._held is not None:
            if not self._go_ahead(running):
                # The next batch differs (a request joined, prefills or samples, or none is
                # left to go on): the held step is read first and the loop plans again.
                self._read_held()
            return
        budget = self.chunked_prefill_size
        size = self.pools.page_size
        batch, chunks = [], []
        for r in running:
            remaining = len(r.input_ids) - r.prefilled
            if remaining > 0:
                if budget <= 0:
                    continue
                # At most to the next page end: every page of a prompt then ends a step, where
                # its window can be checkpointed for the prefix cache (a shared prefix may end
                # at any page). chunked_prefill_size bounds the tokens of all requests per step.
                take = min(remaining, budget, size - r.prefilled % size)
                budget -= take
                chunks.append(r.input_ids[r.prefilled : r.prefilled + take])
                r.prefilled += take
            else:
                chunks.append([r.output_ids[-1]])
            batch.append(r)
        if not batch:
            self._send_answers()
            return
        # A prefill chunk of several tokens overwrites window and compressor state that
        # it reads itself; keep them, so that its step can run again alone if the batch
        # fails (a decode token's writes are idempotent: it rewrites what it wrote).
        kept = [self._state_of(r.seq) if len(batch) > 1 and len(c) > 1 else None for r, c in zip(batch, chunks)]
        if any(len(c) > 1 for c in chunks):
            self._send_answers()  # a prefill's launch waits for the GPU: they would wait with it
        hold = False
        try:
            logits = self._forward(batch, chunks)
            hold = self._can_hold(batch, chunks)
            if not hold:
                self._send_answers()  # the last step's, while the device runs this one
                rows = list(zip(batch, logits.cpu()))
        except Exception as exc:  # noqa: BLE001 - a failed step must answer, not kill the loop
            log.exception("engine step of %d requests failed", len(batch))
            self._send_answers()
            rows = self._step_alone(batch, chunks, kept, exc)
        self.steps += 1
        if hold:
            # Outside the guard above: the step ran, so it must not run again alone (its
            # sequences have moved on); a failure here fails the batch (the loop's guard).
            self._held = self._hold(batch, logits)
            self._send_answers()
            return
        with self._cv:
            for r, row in rows:
                try:
                    self._advance(r, row)
                except Exception as exc:  # noqa: BLE001 - this request fails, the batch goes on
                    log.exception("request %s failed after the step", r.rid)
                    self._fail(r, f"engine error: {exc!r}")

    def _can_hold(self, batch: list[Request], chunks: list[list[int]]) -> bool:
        """Whether a step just launched may go unread until the next is launched: launch
        ahead is on, and every request decodes greedily (one token past its prompt)."""
        return self.launch_ahead and all(
            len(c) == 1 and r.prefilled == len(r.input_ids) and r.sampling.temperature < GREEDY_BELOW
            for r, c in zip(batch, chunks))

    def _hold(self, batch: list[Request], logits: torch.Tensor) -> _Held:
        """The step's greedy tokens taken on the device and copied to the host behind it."""
        return _Held(list(batch), DeviceTokens.of(logits))

    def _go_ahead(self, running: list[Request]) -> bool:
        """Launch the next decode step of the held step's requests on its tokens, then read
        the held step; False (nothing launched) where the next step is not that: a running
        request not in the held step (admitted since), or none left with a token to go."""
        held = self._held
        row_of = {id(r): i for i, r in enumerate(held.requests)}
        if any(id(r) not in row_of for r in running):
            return False
        # A request whose length ends at the held step is done there: no further step.
        ahead = [r for r in running if not r.aborted and len(r.output_ids) + 1 < r.sampling.max_new_tokens]
        if not ahead:
            return False
        # Pages the held step completed are cached now, while every token before it is known:
        # a page ending where it ended gets its window checkpoint (a copy queued before the
        # next step writes the ring), which reading it after the next launch would miss.
        with self._cv:
            for r in ahead:
                try:
                    self._cache_completed_pages(r)
                except Exception as exc:  # noqa: BLE001 - this request fails, the others go on
                    log.exception("request %s failed caching its pages", r.rid)
                    self._fail(r, f"engine error: {exc!r}")
        ahead = [r for r in ahead if r in self._running]
        if not ahead:
            return False
        rows = [row_of[id(r)] for r in ahead]
        tokens = held.tokens.tokens
        if rows != list(range(len(held.requests))):
            index = torch.tensor(rows, dtype=torch.long)
            if tokens.device.type == "cuda":
                index = index.pin_memory()  # a pageable copy would wait for the held step
            tokens = tokens.index_select(0, index.to(tokens.device, non_blocking=True))
        try:
            with torch.inference_mode():
                logits = self.model.forward([r.seq for r in ahead], tokens, self.pools)
        except Exception:  # noqa: BLE001 - read the held step; the plain path runs it again
            log.exception("the decode step launched ahead of %d requests failed; running it after the last", len(ahead))
            return False
        self.steps += 1
        self._read_held(went_ahead=ahead)
        self._held = self._hold(ahead, logits)
        return True

    def _read_held(self, went_ahead: list[Request] = ()) -> None:
        """Read the held step's tokens (waiting for that step only) and advance its requests
        with them; `went_ahead`: those already launched on them, whose sequences hold
        UNREAD_TOKEN for it. Their answers go out now: the GPU runs the next step meanwhile."""
        held, self._held = self._held, None
        tokens = held.tokens.read()
        launched = {id(r) for r in went_ahead}
        with self._cv:
            for r, token in zip(held.requests, tokens):
                if r not in self._running:
                    continue  # aborted, failed or released since its step was launched
                try:
                    if id(r) in launched:
                        r.seq.token_ids[-1] = token
                    self._advance(r, token=token)
                except Exception as exc:  # noqa: BLE001 - this request fails, the batch goes on
                    log.exception("request %s failed after the step", r.rid)
                    self._fail(r, f"engine error: {exc!r}")
        self._send_answers()

    def _forward(self, batch: list[Request], chunks: list[list[int]]) -> torch.Tensor:
        """float32 [len(batch), vocab] logits on the model's device, the step launched (on
        cuda it may still run); the caller copies them to the CPU, where the requests'
        generators live."""
        with torch.inference_mode():
            return self.model.forward([r.seq for r in batch], chunks, self.pools)

    def _step_alone(self, batch: list[Request], chunks: list[list[int]], kept: list, exc: Exception) -> list:
        """After a batched forward failed: each request's step again, alone, so that only a
        request whose own step fails is failed. Returns (request, logits row) of the rest."""
        if len(batch) == 1:
            with self._cv:
                self._fail(batch[0], f"engine error: {exc}", type(exc).__name__)
            return []
        rows = []
        for r, chunk, state in zip(batch, chunks, kept):
            if state is not None:
                for view, saved in state:
                    view.copy_(saved)
            try:
                rows.append((r, self._forward([r], [chunk]).cpu()[0]))
            except Exception as own:  # noqa: BLE001 - the culprit fails, the others go on
                log.exception("request %s failed its step alone", r.rid)
                with self._cv:
                    self._fail(r, f"engine error: {own}", type(own).__name__)
        return rows

    def _state_of(self, seq: Sequence) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(view, copy) of what a step of `seq` reads and overwrites in place: its window
        ring in every layer and its compressor state rows. Its records go to fresh places."""
        pools = self.pools
        views = pools.swa.block_views(seq.swa_block)
        for states, ring in ((pools.c4_state, C4_RING), (pools.c4_index_state, C4_RING),
                             (pools.c128_state, C128_RING)):
            views += [t[seq.slot * ring : (seq.slot + 1) * ring] for t in states.values()]
        return [(v, v.clone()) for v in views]

    def _advance(self, r: Request, row: torch.Tensor | None = None, token: int | None = None) -> None:
        """After a step: cache `r`'s completed pages, sample its next token from its logits
        `row` (or take `token`, one taken on the device), answer it."""
        self._cache_completed_pages(r)
        if r.prefilled < len(r.input_ids):
            return  # mid-prompt chunk: nothing to sample yet
        if r.sampling.max_new_tokens == 0:
            self._finish(r, {"type": "length", "length": 0})
            return
        try:
            token = self._sample(r, row) if token is None else token
        except (RuntimeError, ValueError) as exc:
            self._finish(r, self._abort_reason(f"sampling failed: {exc}", 400, "SamplingError"))
            return
        r.output_ids.append(token)
        self.generated_tokens += 1
        finish = None
        if not r.sampling.ignore_eos and token == self.eos_token_id:
            finish = {"type": "stop", "matched": token}
        elif len(r.output_ids) >= r.sampling.max_new_tokens:
            finish = {"type": "length", "length": r.sampling.max_new_tokens}
        if finish:
            self._finish(r, finish)
        else:
            self._emit(r, TokenEvent(list(r.output_ids), None, r.cached_tokens))

    def _cache_completed_pages(self, r: Request) -> None:
        """Offer the pages the last step completed to the prefix cache; the page ending
        where the step ended gets a window checkpoint (the ring holds that window)."""
        seq, size = r.seq, self.pools.page_size
        if not self.cache.enabled:
            return
        while len(r.keys) < min(seq.length // size, len(seq.pages)):
            done = len(r.keys) + 1
            parent = r.keys[-1] if r.keys else None
            key = chain_key(parent, seq.token_ids[(done - 1) * size : done * size])
            window = self._checkpoint(seq) if done * size == seq.length else None
            page = seq.pages[done - 1]
            if self.cache.insert(key, parent, page, window):
                r.cached_pages.add(page)
            else:
                # Another request cached the same prefix first: follow its chain (our own
                # copy of the page stays private), and lend it our window if it has none.
                if window is not None and not self.cache.adopt_window(key, window):
                    self.pools.swa_blocks.release([window])
                self.cache.pin([key])
            r.keys.append(key)

    def _checkpoint(self, seq: Sequence) -> int | None:
        pools = self.pools
        if pools.swa_blocks.free == 0 and self.cache.evict_windows(1) == 0:
            return None
        block = pools.swa_blocks.alloc()[0]
        pools.swa.copy_block(block, seq.swa_block)
        return block

    def _sample(self, r: Request, logits: torch.Tensor) -> int:
        if r.sampling.temperature < GREEDY_BELOW:
            return int(logits.argmax())
        probs = torch.softmax(logits / r.sampling.temperature, dim=-1)
        return int(torch.multinomial(probs, 1, generator=r.generator))

    def _finish(self, r: Request, reason: dict) -> None:
        """Called with the lock held: release, then answer."""
        self._release(r)
        self._emit(r, TokenEvent(list(r.output_ids), reason, r.cached_tokens))

    def _fail(self, r: Request, message: str, err_type: str = "EngineError") -> None:
        """Called with the lock held: answer `r` with an engine error (500), giving back
        whatever it holds; nothing here may raise, so one request cannot stop the loop."""
        if r in self._running:
            self._running.remove(r)
        self._release_quietly(r)
        self._emit(r, TokenEvent(list(r.output_ids), self._abort_reason(message, 500, err_type), r.cached_tokens))

    def _release_quietly(self, r: Request) -> None:
        try:
            self._release(r)
        except Exception:  # noqa: BLE001 - its pages may stay lost; the engine keeps serving
            log.exception("releasing request %s failed", r.rid)

    def _emit(self, r: Request, ev: TokenEvent) -> None:
        """Answer `r`: now, or with overlap_answers after the next launch (_send_answers)."""
        if self.overlap_answers:
            self._answers.append((r, ev))
        else:
            self._deliver(r, ev)

    def _send_answers(self) -> None:
        """Deliver the held answers in the order they were made (engine thread only). One
        at a time off the list: should a delivery raise past _deliver (a BaseException),
        the rest stay held for the death path to send."""
        while self._answers:
            r, ev = self._answers.pop(0)
            self._deliver(r, ev)

    @staticmethod
    def _deliver(r: Request, ev: TokenEvent) -> None:
        """A callback that raises (its event loop closed) cannot be answered again: the
        request is dropped at the next step, as if its client had left."""
        try:
            r.emit(ev)
        except Exception:  # noqa: BLE001
            log.exception("answering request %s failed; dropping it", r.rid)
            r.aborted = True
