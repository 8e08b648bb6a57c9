"""Reading SGLang's streamed /generate frames: the fields the load client needs, cheaply.

A frame is the JSON after `data: `: `{"text": ..., "output_ids": [...], "meta_info": {...}}`,
text and output_ids cumulative by SGLang's default, so a 512-token answer's frames average
about 2.8 kB and parsing all of them costs O(n^2) per request. The client reads only
`meta_info` (completion_tokens, prompt_tokens, cached_tokens, finish_reason) and a top-level
`error`, and `output_ids` only where meta_info has no completion_tokens.

`frame_fields` parses only the `meta_info` value when the frame ends with it (as SGLang and
remnant-serve write every frame) and has no `"error"` before it; otherwise it parses the
whole frame, as `parse_frame` (the plain reference) does. Both give the same `error`,
`meta_info` and `output_ids` wherever the fast path applies; tests/client/test_frames.py
checks that on random frames. The fast path does not validate the bytes it skips (the text
and the ids): a frame whose skipped part is malformed JSON is read by its meta_info, where
the reference would raise.
"""

from __future__ import annotations

import orjson

_loads = orjson.loads
#: What a frame that is not JSON raises: orjson's, a subclass of json.JSONDecodeError.
JSONDecodeError = orjson.JSONDecodeError

_META = b'"meta_info":'
_ERROR = b'"error"'
_SPACE = b" \t\r\n"


def parse_frame(data: bytes) -> dict:
    """The whole frame, parsed (the reference). Raises JSONDecodeError on bad JSON and
    ValueError when the frame is not a JSON object."""
    doc = _loads(data)
    if not isinstance(doc, dict):
        raise ValueError(f"a frame must be a JSON object, got {type(doc).__name__}")
    return doc


def frame_fields(buf: bytes, start: int, end: int) -> dict:
    """The frame in buf[start:end]: a dict with the frame's `error`, `meta_info` and, where
    meta_info lacks completion_tokens, `output_ids` (top-level keys, as parse_frame gives
    them). Raises as parse_frame does where it falls back to it."""
    j = buf.rfind(_META, start, end)
    if j > start:
        e = end
        while e > j and buf[e - 1] in _SPACE:
            e -= 1
        s = start
        while s < j and buf[s] in _SPACE:
            s += 1
        # meta_info is the last member: the frame closes right after its value. A raw
        # `"error"` cannot sit inside a JSON string, so none before meta_info means no
        # top-level error key (a nested one only costs the full parse).
        if buf[s] == 123 and buf[e - 1] == 125 and buf.find(_ERROR, s, j) < 0:  # "{", "}"
            try:
                meta = _loads(buf[j + len(_META) : e - 1])
            except JSONDecodeError:
                meta = None  # not the last member after all: the reference decides
            if isinstance(meta, dict) and "completion_tokens" in meta:
                return {"meta_info": meta}
    return parse_frame(buf[start:end])
