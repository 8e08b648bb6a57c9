"""frame_fields (meta_info alone where it can) against parse_frame (the whole frame)."""

from __future__ import annotations

import json

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from remnant.client import frames
from remnant.client.frames import JSONDecodeError, frame_fields, parse_frame

WANTED = ("error", "meta_info", "output_ids")


def _expected(data: bytes) -> dict:
    """What the client reads of a frame, from the reference parse."""
    doc = parse_frame(data)
    out = {k: doc[k] for k in ("error", "meta_info") if k in doc}
    meta = doc.get("meta_info")
    if not (isinstance(meta, dict) and "completion_tokens" in meta) and "output_ids" in doc:
        out["output_ids"] = doc["output_ids"]
    return out


def _read(data: bytes, pad: bytes = b"") -> dict:
    """frame_fields on data placed inside a larger buffer, as the stream reader passes it."""
    buf = pad + data + pad
    got = frame_fields(buf, len(pad), len(pad) + len(data))
    return {k: got[k] for k in WANTED if k in got and (k != "output_ids" or "output_ids" in _expected(data))}


def _sglang(text: str, ids: list[int], meta: dict, spaced: bool) -> bytes:
    doc = {"text": text, "output_ids": ids, "meta_info": meta}
    return json.dumps(doc).encode() if spaced else orjson.dumps(doc)


def test_the_fast_path_reads_meta_info_alone(monkeypatch):
    calls = []
    monkeypatch.setattr(frames, "parse_frame", lambda data: calls.append(data) or parse_frame(data))
    meta = {"id": "r", "finish_reason": None, "prompt_tokens": 3, "completion_tokens": 2, "cached_tokens": 1}
    for spaced in (False, True):
        data = _sglang(' say "meta_info": {} and "error" \\', [5, 6], meta, spaced)
        assert frame_fields(data, 0, len(data)) == {"meta_info": meta}
    assert calls == []  # a raw `"error"` inside a string is escaped: no fallback needed
    # The skipped text is not validated (documented): the reference would raise here.
    broken = b'{"text":"\xff\xfe","output_ids":[1,,],"meta_info":{"completion_tokens":1}}'
    assert frame_fields(broken, 0, len(broken)) == {"meta_info": {"completion_tokens": 1}}
    with pytest.raises(JSONDecodeError):
        parse_frame(broken)


@pytest.mark.parametrize("data", [
    b'{"error": {"message": "too long", "code": 400}}',
    b'{"error": "x", "meta_info": {"completion_tokens": 1}}',
    b'{"meta_info": {"completion_tokens": 1}, "error": "after"}',
    b'{"text": "a", "meta_info": {"completion_tokens": 1, "x": {"meta_info": {"completion_tokens": 9}}}}',
    b'{"text": "a", "x": {"meta_info": {"completion_tokens": 9}}}',
    b'{"text": "a", "output_ids": [1, 2, 3], "meta_info": {"prompt_tokens": 4}}',
    b'{"text": "a", "output_ids": [1], "meta_info": null}',
    b'{"meta_info": {"completion_tokens": 1}, "meta_info": {"completion_tokens": 2}}',
    b'  {"text":"a","meta_info":{"completion_tokens":3}}  \r',
], ids=["error-only", "error-first", "error-after", "nested-meta-last", "nested-meta-only", "no-completion-tokens",
        "meta-null", "duplicate-meta", "whitespace"])
def test_every_layout_reads_as_the_reference_does(data):
    assert _read(data, b"xx\n") == _expected(data)


@pytest.mark.parametrize("data", [b'{"text": "a", "meta_info": {"completion_tokens": 1}', b"[1, 2]", b"nope"])
def test_malformed_frames_raise_as_the_reference_does(data):
    with pytest.raises(ValueError):  # JSONDecodeError is one
        frame_fields(data, 0, len(data))


_scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6), st.text(max_size=12))
_meta = st.dictionaries(
    st.sampled_from(["id", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens", "meta_info",
                     "error"]),
    st.one_of(_scalars, st.dictionaries(st.sampled_from(["type", "meta_info", "error"]), _scalars, max_size=2)),
    max_size=6)
_text = st.lists(st.sampled_from(list('ab "\\{}:,\n\u00e9') + ['"error"', '"meta_info":']), max_size=12).map("".join)


@settings(max_examples=400, deadline=None)
@given(text=_text, ids=st.lists(st.integers(0, 200000), max_size=6), meta=_meta,
       extra=st.dictionaries(st.sampled_from(["error", "x", "output_ids"]), _scalars, max_size=2),
       spaced=st.booleans(), data=st.data())
def test_random_frames_read_as_the_reference_does(text, ids, meta, extra, spaced, data):
    items = [("text", text), ("output_ids", ids), ("meta_info", meta), *extra.items()]
    doc = dict(data.draw(st.permutations(items)))
    raw = json.dumps(doc).encode() if spaced else orjson.dumps(doc)
    assert _read(raw, b"data: ") == _expected(raw)
