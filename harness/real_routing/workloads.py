"""What the clients of the real-runtime routing benchmark send: scripted conversations, the same for every router.

A workload is a set of closed-loop clients. Each client holds at most
``open`` of its conversations at once and sends their turns one at a time
(round-robin among the open ones), waiting each turn's ``think`` seconds
after the client's previous answer (after its start, for its first request). A conversation's request is its messages so far: the system prompt,
then per turn what the turn adds (a user message; or, for a tool-using agent,
the tool call it made and the tool's result), with the *scripted* answer of
every earlier turn in between. A random-weight model answers gibberish, so
clients keep a scripted answer of known text in the history rather than the
model's: every router then gets byte-identical requests, and a simulation
knows every token (:func:`harness.gguf_models.tokenize`). The runtime still
generates ``max_tokens`` tokens per request. One consequence to know when
reading the figures: the runtime's cache holds what it generated, not the
scripted answer, so a later turn reuses its previous prompt but not the
answer (as with a real model whose answer is tokenized anew differently).

Text is random lowercase words from a seeded generator. Everything here is a
pure function of the workload's name, seed and scale.

Workloads (:data:`WORKLOADS`):

``chat``
    Multi-turn chat with think time: 6 clients, 3 conversations each in
    turn, 4 turns; a short common system prompt, a 500-token document in
    each conversation's first message, then 20-40-token questions; 0.3-1.5 s
    of think time before each later turn.
``shared``
    Many users on a few long shared system prompts: 24 conversations of 4
    turns over 4 system prompts of 600 tokens, 6 clients, no think time
    (the issue's basic workload).
``pressure``
    More conversations than the runtimes' caches hold: 30 conversations of
    4 turns, each a 250-token shared system prompt and a 250-token preamble
    of its own; 8 clients keeping 3 conversations open each, 0.2-1.0 s of
    think time; the runtimes get a small host prompt cache (``cache_tokens``:
    2,300 tokens, ``--cache-ram 24`` with the bench model: 4 conversations).
``tools``
    Tool-using agents with long tool schemas: 18 agents of 4 steps over 3
    toolsets of 4 functions (about 1,850 tokens with the template's own words),
    rendered in the system turn by the servers' template; each later step
    sends back the agent's tool call and a 50-token result after 0.1-0.5 s.
``bursty``
    A bursty tenant beside a steady one: 4 ``steady`` clients hold chat
    conversations (as ``chat``, 3 each), while from 2 s 6 ``burst`` clients
    send 12 one-turn questions each on a shared 600-token system prompt with
    no think time (a fixed count, not a time window: every router gets the
    same requests, whatever its speed).
"""

from __future__ import annotations

import json
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from harness.gguf_models import render_chat, tokenize

__all__ = ["WORKLOADS", "Client", "Conversation", "Turn", "Workload", "make"]

#: Letters of the words clients write (all of them: the vocabulary's merges apply as they would to prose).
_LETTERS = "abcdefghijklmnopqrstuvwxyz"


@dataclass(frozen=True)
class Turn:
    """What one turn adds to its conversation before the request goes out, and the answer kept after it."""

    messages: tuple[Mapping[str, Any], ...]
    answer: Mapping[str, Any]
    #: Seconds the client waits before sending it (after the previous answer; for a first turn, after start).
    think: float = 0.0


@dataclass(frozen=True)
class Conversation:
    """A session: its id (sent as ``x-session-id``), its tenant, its opening messages, its turns."""

    id: str
    group: str
    opening: tuple[Mapping[str, Any], ...]
    turns: tuple[Turn, ...]
    tools: tuple[Mapping[str, Any], ...] = ()

    def messages(self, turn: int) -> list[Mapping[str, Any]]:
        """The messages of turn ``turn``'s request: the opening, and every turn to ``turn`` with the
        answers of those before it."""
        out = list(self.opening)
        for i, step in enumerate(self.turns[:turn + 1]):
            out.extend(step.messages)
            if i < turn:
                out.append(step.answer)
        return out

    def body(self, turn: int, model: str, max_tokens: int) -> dict[str, Any]:
        """The chat completion request of turn ``turn``: streamed, greedy, usage in the last chunk."""
        body: dict[str, Any] = {
            "model": model, "messages": self.messages(turn), "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True},
        }
        if self.tools:
            body["tools"] = list(self.tools)
        return body

    def prompt_tokens(self, turn: int) -> list[int]:
        """Turn ``turn``'s prompt as the runtime tokenizes it."""
        return tokenize(render_chat(self.messages(turn), self.tools))


@dataclass(frozen=True)
class Client:
    """A closed-loop client: its conversations in order, at most ``open`` at once, sending from ``start``
    seconds until its conversations end."""

    name: str
    group: str
    conversations: tuple[Conversation, ...]
    open: int = 1
    start: float = 0.0


@dataclass(frozen=True)
class Workload:
    """The clients of one run and what the runtimes are started with."""

    name: str
    clients: tuple[Client, ...]
    max_tokens: int = 8
    #: Each runtime's host prompt cache in tokens of KV (``--cache-ram``, in MiB of the model's KV, at least 1;
    #: None: the server's default, 8 GiB).
    cache_tokens: int | None = None
    #: Whether the runtimes need the tools template (``--chat-template-file``).
    tools_template: bool = False
    groups: tuple[str, ...] = field(default=("chat",))

    def cache_ram(self, kv_bytes_per_token: int) -> int | None:
        """``--cache-ram`` (MiB) for a model whose KV takes ``kv_bytes_per_token``; None: the default."""
        if self.cache_tokens is None:
            return None
        return max(1, round(self.cache_tokens * kv_bytes_per_token / (1024 * 1024)))

    @property
    def requests(self) -> int:
        """Requests the workload sends: every turn of every conversation."""
        return sum(len(c.turns) for client in self.clients for c in client.conversations)

    def longest_prompt(self) -> int:
        """Tokens of the longest prompt any request carries (the runtimes' context must hold it)."""
        return max(len(c.prompt_tokens(len(c.turns) - 1)) for client in self.clients for c in client.conversations)


class _Text:
    """Seeded words, and messages made of them."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def words(self, tokens: int) -> str:
        """About ``tokens`` tokens of lowercase words (a word is about one token per letter, plus its space)."""
        out: list[str] = []
        size = 0
        while size < tokens:
            word = "".join(self.rng.choice(_LETTERS) for _ in range(self.rng.randint(2, 9)))
            out.append(word)
            size += len(word) + 1
        return " ".join(out)

    def between(self, low: int, high: int) -> str:
        return self.words(self.rng.randint(low, high))

    def think(self, low: float, high: float) -> float:
        return round(self.rng.uniform(low, high), 3)


def _user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def _answer(text: str) -> dict[str, str]:
    return {"role": "assistant", "content": text}


def _chat_conversation(text: _Text, cid: str, group: str, system: str, turns: int,
                       think: tuple[float, float]) -> Conversation:
    steps = [Turn((_user("Please read this document. " + text.words(500)),), _answer(text.words(30)),
                  think=text.think(0.0, 0.5))]
    steps += [Turn((_user(text.between(20, 40)),), _answer(text.words(30)), think=text.think(*think))
              for _ in range(turns - 1)]
    return Conversation(cid, group, ({"role": "system", "content": system},), tuple(steps))


def _chat(rng: random.Random, scale: float) -> Workload:
    text = _Text(rng)
    system = "You are a careful assistant. " + text.words(60)
    return Workload("chat", _chat_clients(text, "chat", system, _n(6, scale)))


def _chat_clients(text: _Text, group: str, system: str, count: int) -> tuple[Client, ...]:
    """``count`` clients of ``group``, each holding three four-turn conversations under ``system``."""
    return tuple(Client(f"{group}-{c}", group, tuple(
        _chat_conversation(text, f"{group}-{c}-{i}", group, system, 4, (0.3, 1.5)) for i in range(3)))
        for c in range(count))


def _shared(rng: random.Random, scale: float) -> Workload:
    text = _Text(rng)
    systems = [f"You are assistant number {i}. " + text.words(600) for i in range(4)]
    conversations = []
    for c in range(_n(24, scale)):
        steps = tuple(Turn((_user(text.between(20, 40)),), _answer(text.words(30))) for _ in range(4))
        conversations.append(Conversation(f"shared-{c}", "chat", ({"role": "system", "content": systems[c % 4]},),
                                          steps))
    clients = _deal(conversations, _n(6, scale), "shared", "chat", open_=1)
    return Workload("shared", clients)


def _pressure(rng: random.Random, scale: float) -> Workload:
    text = _Text(rng)
    system = "You answer questions about the preamble. " + text.words(250)
    conversations = []
    for c in range(_n(30, scale)):
        opening = ({"role": "system", "content": system},
                   _user("Preamble: " + text.words(250)), _answer(text.words(20)))
        steps = tuple(Turn((_user(text.between(20, 40)),), _answer(text.words(30)), think=text.think(0.2, 1.0))
                      for _ in range(4))
        conversations.append(Conversation(f"pressure-{c}", "chat", opening, steps))
    clients = _deal(conversations, _n(8, scale), "pressure", "chat", open_=3)
    return Workload("pressure", clients, cache_tokens=2300)


def _tool(text: _Text, name: str) -> dict[str, Any]:
    properties = {text.words(6).split()[0]: {"type": "string", "description": text.words(12)} for _ in range(3)}
    return {"type": "function", "function": {
        "name": name, "description": text.words(20),
        "parameters": {"type": "object", "properties": properties, "required": sorted(properties)[:2]}}}


def _tools(rng: random.Random, scale: float) -> Workload:
    text = _Text(rng)
    toolsets = [tuple(_tool(text, f"tool_{s}_{i}") for i in range(4)) for s in range(3)]
    systems = [f"You are agent kind {s}. Use the tools. " + text.words(40) for s in range(3)]
    conversations = []
    for c in range(_n(18, scale)):
        kind = c % 3
        steps = [Turn((_user("Task: " + text.between(30, 60)),), {}, think=text.think(0.0, 0.3))]
        for step in range(1, 4):
            tool = toolsets[kind][rng.randrange(4)]["function"]
            call_id = f"call-{c}-{step}"
            arguments = json.dumps({key: text.words(6) for key in tool["parameters"]["required"]})
            call = {"role": "assistant", "content": "",
                    "tool_calls": [{"id": call_id, "type": "function",
                                    "function": {"name": tool["name"], "arguments": arguments}}]}
            steps[-1] = Turn(steps[-1].messages, call, steps[-1].think)
            steps.append(Turn(({"role": "tool", "tool_call_id": call_id, "content": text.words(50)},), {},
                              think=text.think(0.1, 0.5)))
        steps[-1] = Turn(steps[-1].messages, _answer(text.words(30)), steps[-1].think)
        conversations.append(Conversation(f"tools-{c}", "chat", ({"role": "system", "content": systems[kind]},),
                                          tuple(steps), tools=toolsets[kind]))
    clients = _deal(conversations, _n(6, scale), "tools", "chat", open_=1)
    return Workload("tools", clients, tools_template=True)


def _bursty(rng: random.Random, scale: float) -> Workload:
    text = _Text(rng)
    system = "You are a careful assistant. " + text.words(60)
    clients = list(_chat_clients(text, "steady", system, _n(4, scale)))
    burst_system = "You answer in one line. " + text.words(600)
    for c in range(_n(6, scale)):
        conversations = tuple(
            Conversation(f"burst-{c}-{i}", "burst", ({"role": "system", "content": burst_system},),
                         (Turn((_user(text.between(10, 20)),), _answer("ok")),))
            for i in range(12))
        clients.append(Client(f"burst-{c}", "burst", conversations, start=2.0))
    return Workload("bursty", tuple(clients), groups=("steady", "burst"))


def _n(count: int, scale: float) -> int:
    return max(1, round(count * scale))


def _deal(conversations: Sequence[Conversation], clients: int, name: str, group: str,
          open_: int) -> tuple[Client, ...]:
    """Conversations dealt to ``clients`` clients in turn."""
    return tuple(Client(f"{name}-{c}", group, tuple(conversations[c::clients]), open=open_) for c in range(clients))


_MAKERS = {"chat": _chat, "shared": _shared, "pressure": _pressure, "tools": _tools, "bursty": _bursty}
WORKLOADS = tuple(_MAKERS)


def make(name: str, seed: int, scale: float = 1.0) -> Workload:
    """Workload ``name`` (one of :data:`WORKLOADS`) for ``seed``; ``scale`` multiplies its clients and
    conversations (the quick mode's small runs)."""
    if name not in _MAKERS:
        raise ValueError(f"unknown workload {name!r}: one of {', '.join(WORKLOADS)}")
    return _MAKERS[name](random.Random(f"{name}:{seed}"), scale)
