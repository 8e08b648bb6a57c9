"""A JSON decode error as a sentence a reader can act on.

json's messages read as prefixes of a location ("Expecting ',' delimiter", "Unterminated
string starting at"), and `str(exc)` adds "(char N)"; gluing "at line" after them gave
"starting at at line". Here the location follows the message once."""

from __future__ import annotations

import json


def describe_json_error(exc: json.JSONDecodeError) -> str:
    """e.g. "Unterminated string starting at line 3 column 17", "Expecting value at line 1
    column 1"."""
    msg = exc.msg[: -len(" at")] if exc.msg.endswith(" at") else exc.msg
    return f"{msg} at line {exc.lineno} column {exc.colno}"
