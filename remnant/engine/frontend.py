"""Between the HTTP routes and the engine thread, as SGLang's tokenizer manager is.

`Frontend.submit` hands a validated request (remnant.engine.api.EngineInput) to the
engine and returns a `Generation`, whose `outputs()` are SGLang's out dicts ({"text",
"output_ids", "meta_info"}, text cumulative), one per engine event, and whose `final()` is
the last of them alone. Text is decoded incrementally (the tokens since the last frame,
as SGLang's detokenizer does), and in full once, at the end. A request id that is
already in flight is refused, as SGLang refuses it ("Duplicate request ID detected"); an
id is free again once its generation is closed (finished, or its client gone).
Everything here runs on the server's event loop.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import AsyncIterator

from fastapi import Request as HttpRequest

from remnant.engine.api import BadRequest, EngineInput, ModelLimits
from remnant.engine.engine import Engine, Request, SamplingParams, TokenEvent


class Frontend:
    """What the routes share: the engine, its tokenizer and limits, the in-flight ids."""

    def __init__(self, engine: Engine, tokenizer, limits: ModelLimits, served_model_name: str,
                 chat_template=None, weight_version: str = "default"):
        self.engine = engine
        self.tokenizer = tokenizer
        self.limits = limits
        self.served_model_name = served_model_name
        self.chat_template = chat_template
        self.weight_version = weight_version
        self._live: dict[str, Generation] = {}

    def submit(self, inp: EngineInput) -> Generation:
        rid = uuid.uuid4().hex if inp.rid is None else inp.rid
        if rid in self._live:
            raise BadRequest(f"Duplicate request ID detected: {rid}", param="rid")  # tokenizer_manager.py
        gen = Generation(self, rid, inp)
        self._live[rid] = gen
        loop = asyncio.get_running_loop()
        gen.request = Request(rid, inp.ids, inp.params, lambda ev: loop.call_soon_threadsafe(gen.queue.put_nowait, ev))
        self.engine.submit(gen.request)
        return gen

    def forget(self, gen: Generation) -> None:
        """Free `gen`'s request id (unless a later request took it already)."""
        if self._live.get(gen.rid) is gen:
            del self._live[gen.rid]

    def health_check(self, bos_token_id: int) -> Generation:
        """A one-token request under a fresh id (SGLang's HEALTH_CHECK_ rids)."""
        return self.submit(EngineInput([bos_token_id], SamplingParams(1, 0.0, True), f"HEALTH_CHECK_{uuid.uuid4().hex}"))


class Generation:
    """One request in the engine: its out dicts, and `close()` to let it go."""

    def __init__(self, frontend: Frontend, rid: str, inp: EngineInput):
        self.frontend = frontend
        self.rid = rid
        self.prompt_tokens = len(inp.ids)
        self.skip_special_tokens = inp.skip_special_tokens
        self.queue: asyncio.Queue[TokenEvent] = asyncio.Queue()
        self.request: Request | None = None
        self.t_recv = time.perf_counter()
        self._text = ""
        # Incremental decoding: _text is the decoded ids[:_read]; ids[_prefix:_read] were
        # decoded last, and are decoded again ahead of new ids (a token's text may depend
        # on the one before it).
        self._prefix = self._read = 0
        self._closed = False

    async def outputs(self) -> AsyncIterator[dict]:
        """SGLang out dicts as the engine reports tokens; the last has a finish_reason."""
        while True:
            ev = await self.queue.get()
            yield self.out(ev)
            if ev.finish_reason is not None:
                return

    async def final(self, http: HttpRequest | None = None) -> dict | None:
        """The finished out dict; None if the client disconnects first. The events before
        the last are dropped undecoded."""

        async def last() -> dict:
            while True:
                ev = await self.queue.get()
                if ev.finish_reason is not None:
                    return self.out(ev)

        return await until_disconnect(last(), http)

    def close(self) -> None:
        """Stop the request if it still runs (its client left) and free its id; idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.request is not None:
            self.frontend.engine.abort(self.request)  # a no-op once it finished
        self.frontend.forget(self)

    def out(self, ev: TokenEvent) -> dict:
        """An engine event as SGLang's tokenizer manager reports it (meta_info keys as
        tokenizer_manager.py sets them for a plain request)."""
        meta = {
            "id": self.rid,
            "finish_reason": ev.finish_reason,
            "prompt_tokens": self.prompt_tokens,
            "weight_version": self.frontend.weight_version,
            "num_retractions": 0,
            "reasoning_tokens": 0,
            "completion_tokens": len(ev.output_ids),
            "cached_tokens": ev.cached_tokens,
            "cached_tokens_details": None,
            "dp_rank": 0,
        }
        if ev.finish_reason is not None:
            meta["e2e_latency"] = time.perf_counter() - self.t_recv
            meta["response_sent_to_client_ts"] = time.time()
            self._text = self._decode(ev.output_ids)
        else:
            self._decode_new(ev.output_ids)
        return {"text": self._text, "output_ids": ev.output_ids, "meta_info": meta}

    def _decode(self, ids: list[int]) -> str:
        return self.frontend.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _decode_new(self, ids: list[int]) -> None:
        """Extend _text by the ids after _read. A trailing incomplete UTF-8 character (the
        decoded text ends in U+FFFD) is held back, as SGLang's detokenizer holds it, so
        each frame's text extends the previous one."""
        before = self._decode(ids[self._prefix : self._read])
        now = self._decode(ids[self._prefix :])
        if len(now) > len(before) and not now.endswith("\ufffd"):
            self._text += now[len(before) :]
            self._prefix, self._read = self._read, len(ids)


async def until_disconnect(awaitable, http: HttpRequest | None):
    """The result of `awaitable`, or None if the client disconnects first (Starlette does
    not cancel a handler whose client left, so the connection is polled)."""
    task = asyncio.ensure_future(awaitable)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.5)
            if done:
                return task.result()
            if http is not None and await http.is_disconnected():
                return None
    finally:
        task.cancel()
