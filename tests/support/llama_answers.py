"""Comparing an answer through infx with llama.cpp's server's own answer to the same request."""

from __future__ import annotations

from typing import Any

#: What differs between two runs of one request.
VOLATILE = ("id", "created", "timings", "cached_tokens")


def stable(document: Any) -> Any:
    """``document`` (an answer as JSON) without what differs between two runs of one request."""
    if isinstance(document, dict):
        return {k: stable(v) for k, v in document.items() if k not in VOLATILE}
    if isinstance(document, list):
        return [stable(v) for v in document]
    return document


def messages(text: str) -> list[dict[str, str]]:
    """A short chat: a terse system prompt and ``text`` from the user."""
    return [{"role": "system", "content": "You are terse."}, {"role": "user", "content": text}]
