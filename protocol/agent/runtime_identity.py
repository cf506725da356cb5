"""What a runtime says it is: its name and version, read from the endpoint each one has; pure.

No I/O. The engine agent asks, once each time its runtime turns ready, the
paths of :data:`IDENTITY_PATHS` in order and stops at the first answer
:func:`identity_of` reads (``EngineStatus.infx_runtime`` then carries it, for
operators; routing never reads it):

- llama.cpp's server: ``GET /props`` has ``build_info`` (``b6000-1a2b3c4d``);
- SGLang: ``GET /get_server_info`` has ``version``;
- vLLM: ``GET /version`` is ``{"version": "0.11.0"}``;
- Ollama: ``GET /api/version`` is ``{"version": "0.12.3"}``.

A runtime that has none of them (llama-cpp-python's server) stays unnamed
(its kind is the agent's ``openai``, or its load source).
"""

from __future__ import annotations

import json

__all__ = ["IDENTITY_PATHS", "identity_of"]

#: Asked in this order: the first two are specific to one runtime; ``/version`` is vLLM's.
IDENTITY_PATHS: tuple[str, ...] = ("/props", "/get_server_info", "/version", "/api/version")

_FIELDS = {"/props": ("llama.cpp", "build_info"), "/get_server_info": ("sglang", "version"),
           "/version": ("vllm", "version"), "/api/version": ("ollama", "version")}
#: A version longer than this is not a version.
_MAX_VERSION = 100


def identity_of(path: str, status: int, body: bytes) -> tuple[str, str] | None:
    """(kind, version) from the answer to ``GET path``, or None if it does not say."""
    known = _FIELDS.get(path)
    if known is None or status != 200:
        return None
    try:
        document = json.loads(body)
    except ValueError:
        return None
    kind, field = known
    version = document.get(field) if isinstance(document, dict) else None
    if not isinstance(version, str) or not version.strip() or len(version) > _MAX_VERSION:
        return None
    return kind, version.strip()
