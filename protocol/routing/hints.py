"""What a request tells the router about where it is best served; pure, no I/O.

Rules this file keeps: a function of the client's JSON and headers only
(no state, no clock), bounded work per request whatever its size, the same
answer in every process (hashes are keyed BLAKE2b, never Python's seeded
``hash``), and it never refuses a request: a body it cannot read gives no
hints, and the request is routed by load alone.

Prefix blocks: the prompt is written out canonically in the order a chat
template renders it (the request's tool definitions first, as templates put
them in or before the system turn; then each chat message as compact JSON
with sorted keys, in order; a legacy ``prompt``; the Responses API's
``tools``, ``instructions`` and ``input``), so that requests whose rendered
prompts share a beginning share blocks: agents of one toolset share the
schemas' blocks whatever they ask. It is cut into ``block_bytes`` blocks, and
each block's hash is chained on the previous one (the first on the model).
A block hash therefore names the whole prompt up to its end, and the next
turn of a conversation, which repeats the earlier messages, shares every
full block of the turn before. Only the first ``max_blocks`` are hashed.

Home key: what every gateway hashes onto the same engine (see
:mod:`protocol.routing.router`). A system prompt (with the tool definitions)
of at least one block is worth sharing between users, so it is the key, and
``home_blocks`` says how many leading blocks it fills (what every engine the
key is spread to comes to hold); otherwise the session (``user`` or a
session header), else the opening of the conversation (system and first
user message), so all turns of one conversation share it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["HintsConfig", "RoutingHints", "hints_from_json"]

#: Endpoints whose requests carry a prompt a runtime can cache.
PROMPT_ENDPOINTS = frozenset({"chat/completions", "completions", "responses"})


@dataclass(frozen=True)
class HintsConfig:
    """How prompts are cut into blocks.

    block_bytes: bytes of canonical prompt text per block (about 64 tokens
        at 256); a prompt shorter than one block has no block and is routed
        by its home key alone.
    max_blocks: blocks hashed per request, bounding the work and the
        router's index entries per request (prefixes longer than
        ``block_bytes * max_blocks`` are told apart by nothing beyond).
    session_headers: request headers (lower case) that name a session, in
        order of preference, after the body's ``user`` field.
    """

    block_bytes: int = 256
    max_blocks: int = 64
    session_headers: tuple[str, ...] = ("x-session-id",)

    def __post_init__(self) -> None:
        if self.block_bytes < 16:
            raise ValueError("block_bytes must be >= 16")
        if self.max_blocks < 1:
            raise ValueError("max_blocks must be >= 1")


@dataclass(frozen=True, slots=True)
class RoutingHints:
    """Hashed prefix blocks, home key, session and adapter of one request.

    ``blocks`` are chained 64-bit block hashes, shortest prefix first;
    ``home`` is the 64-bit key rendezvous routing hashes; ``session`` is the
    client's session name ("" for none); ``adapter`` is the requested model,
    which routing prefers on engines that hold it loaded as a LoRA adapter;
    ``home_blocks`` is how many of ``blocks`` the home key's text fills (0
    unless the key is a shared system prompt); ``continues``: the prompt holds
    an earlier answer (an assistant or tool turn), so it is a later turn of a
    conversation whose earlier prompt an engine already holds; ``opening``:
    a 64-bit hash of the conversation's opening (its system part and first
    message), which every turn of it repeats, so that any gateway names a
    conversation alike even where its first turn adds less than a block past
    the system part (0: no message past the system part).
    """

    blocks: tuple[int, ...]
    home: int
    session: str = ""
    adapter: str = ""
    home_blocks: int = 0
    continues: bool = False
    opening: int = 0


def _digest(data: bytes, key: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8, key=key).digest(), "big")


#: ``json.dumps`` with these arguments builds an encoder per call; one, made once, writes the same text.
_CANONICAL = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _canonical(value: Any) -> bytes:
    return _CANONICAL.encode(value).encode("utf-8", "replace")


def _chain(model: bytes, text: bytes, config: HintsConfig) -> tuple[int, ...]:
    size = config.block_bytes
    count = min(len(text) // size, config.max_blocks)
    previous = _digest(model, b"infx-model")
    blocks = []
    for i in range(count):
        previous = _digest(text[i * size:(i + 1) * size], previous.to_bytes(8, "big"))
        blocks.append(previous)
    return tuple(blocks)


def _session(obj: Mapping[str, Any], headers: Mapping[str, Sequence[str]], config: HintsConfig) -> str:
    user = obj.get("user")
    if isinstance(user, str) and user:
        return user
    for name in config.session_headers:
        values = headers.get(name)
        if values and values[0]:
            return values[0]
    return ""


def _tools(obj: Mapping[str, Any]) -> list[bytes]:
    """The request's tool definitions as the first canonical piece (none: no piece)."""
    tools = obj.get("tools")
    return [_canonical({"tools": tools}) + b"\n"] if isinstance(tools, list) and tools else []


#: Chat roles and Responses item types that only a conversation's earlier turns put in a prompt.
_ANSWER_ROLES = frozenset({"assistant", "tool", "function"})
_ANSWER_ITEMS = frozenset({"function_call", "function_call_output", "reasoning"})


def _is_answer(item: Any) -> bool:
    if not isinstance(item, dict):
        return False
    role, kind = item.get("role"), item.get("type")
    return (isinstance(role, str) and role in _ANSWER_ROLES) or (isinstance(kind, str) and kind in _ANSWER_ITEMS)


def _prompt_parts(endpoint: str, obj: Mapping[str, Any]) -> tuple[list[bytes], int, bool] | None:
    """The canonical pieces of the prompt in the order a template renders them, how many of
    them open the conversation as a system turn does (tool definitions and leading system
    messages), and whether it holds an earlier answer; None if there is no prompt."""
    if endpoint == "chat/completions":
        messages = obj.get("messages")
        if not isinstance(messages, list) or not messages:
            return None
        tools = _tools(obj)
        parts = tools + [_canonical(m) + b"\n" for m in messages]
        system = 0
        while system < len(messages) and isinstance(messages[system], dict) \
                and messages[system].get("role") in ("system", "developer"):
            system += 1
        return parts, len(tools) + system, any(_is_answer(m) for m in messages)
    if endpoint == "completions":
        prompt = obj.get("prompt")
        return ([_canonical(prompt)], 0, False) if prompt is not None else None
    if endpoint == "responses":
        parts = _tools(obj)
        opening = len(parts)
        instructions = obj.get("instructions")
        if isinstance(instructions, str) and instructions:
            parts.append(_canonical({"instructions": instructions}) + b"\n")
            opening += 1
        items = obj.get("input")
        continues = False
        if isinstance(items, list):
            parts += [_canonical(item) + b"\n" for item in items]
            continues = any(_is_answer(item) for item in items)
        elif items is not None:
            parts.append(_canonical(items) + b"\n")
        return (parts, opening, continues) if parts else None
    return None


def hints_from_json(
    endpoint: str,
    body: bytes | Mapping[str, Any],
    headers: Mapping[str, Sequence[str]],
    config: HintsConfig = HintsConfig(),
) -> RoutingHints | None:
    """Routing hints for a request to ``endpoint`` ("chat/completions", "completions",
    "responses"), or None when it has no prompt worth routing by (other endpoints,
    a body that is not a JSON object: the gateway's parser answers those)."""
    if endpoint not in PROMPT_ENDPOINTS:
        return None
    if isinstance(body, Mapping):
        obj: Any = body
    else:
        try:
            obj = json.loads(body)
        except (ValueError, RecursionError):
            return None
    if not isinstance(obj, dict):
        return None
    found = _prompt_parts(endpoint, obj)
    if found is None:
        return None
    parts, system, continues = found
    model = obj.get("model")
    model_name = model if isinstance(model, str) else ""
    model_bytes = model_name.encode("utf-8", "replace")
    limit = config.block_bytes * config.max_blocks
    text = bytearray()
    for part in parts:  # never more than ``limit`` bytes, however long the prompt
        text += part[: limit - len(text)]
        if len(text) >= limit:
            break
    session = _session(obj, headers, config)
    system_bytes = sum(len(p) for p in parts[:system])
    blocks = _chain(model_bytes, bytes(text), config)
    opening_text = b"opening:" + bytes(text[:min(sum(len(p) for p in parts[:system + 1]), limit)])
    home_blocks = 0
    if system and system_bytes >= config.block_bytes:
        home_text = b"system:" + bytes(text[:min(system_bytes, limit)])
        home_blocks = min(system_bytes // config.block_bytes, len(blocks))
    elif session:
        home_text = b"session:" + session.encode("utf-8", "replace")
    else:
        home_text = opening_text
    return RoutingHints(
        blocks=blocks,
        home=_digest(model_bytes + b"\0" + home_text, b"infx-home"),
        session=session,
        adapter=model_name,
        home_blocks=home_blocks,
        continues=continues,
        opening=_digest(model_bytes + b"\0" + opening_text, b"infx-open") if len(parts) > system else 0,
    )
