"""protocol.openai.json reads JSON with one shared decoder: the same outcome as json.loads, always."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from protocol.openai.json import _loads, _reject_constant

json_texts = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=10,
).map(json.dumps)


def outcome(read: Any, data: bytes | str) -> tuple[str, Any]:
    try:
        return "value", read(data)
    except ValueError as exc:
        return type(exc).__name__, str(exc)


def reference(data: bytes | str) -> Any:
    return json.loads(data, parse_constant=_reject_constant)


@given(st.one_of(json_texts, st.text(max_size=30), st.sampled_from(["NaN", "[Infinity]", "\ufeff{}", "{\"a\": -Infinity}"])))
def test_text_reads_like_json_loads(text: str) -> None:
    assert outcome(_loads, text) == outcome(reference, text)


@given(st.one_of(json_texts.map(lambda t: t.encode("utf-8")), json_texts.map(lambda t: t.encode("utf-16")),
                 st.binary(max_size=30), st.just(b"\xef\xbb\xbf{\"a\": 1}")))
def test_bytes_read_like_json_loads_whatever_their_encoding(data: bytes) -> None:
    assert outcome(_loads, data) == outcome(reference, data)
