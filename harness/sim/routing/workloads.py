"""Clients of the routing simulation: what they send, in OpenAI JSON and as runtime tokens.

A message renders to the runtime as its role token and its content tokens,
and a prompt ends with the assistant's role token (a chat template's
generation prompt), so a conversation's next turn starts with exactly the
tokens of the turn before and its answer. The JSON content is the tokens
written out, so the gateway's hints and the runtime's cache see the same text.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

SYSTEM, USER, ASSISTANT = 1, 2, 3
ROLES = {SYSTEM: "system", USER: "user", ASSISTANT: "assistant"}


def words(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(1000, 60000) for _ in range(count)]


@dataclass
class Request:
    body: dict[str, Any]
    prompt: list[int]
    output: list[int]
    group: str
    sent: float = 0.0  # when the client sent it (the simulation sets it)


@dataclass
class SimConversation:
    """Messages so far as (role, tokens)."""

    messages: list[tuple[int, list[int]]] = field(default_factory=list)

    def request(self, output: list[int], group: str, user: str | None = None) -> Request:
        prompt = [t for role, content in self.messages for t in [role, *content]] + [ASSISTANT]
        body: dict[str, Any] = {
            "model": "m", "stream": True,
            "messages": [{"role": ROLES[role], "content": " ".join(map(str, content))} for role, content in self.messages],
        }
        if user:
            body["user"] = user
        return Request(body, prompt, output, group)


class SharedPrefixClient:
    """A user of one of a few applications, each with its own long system prompt."""

    think = 0.5

    def __init__(self, rng: random.Random, system: list[int], group: str = "shared") -> None:
        self.rng, self.system, self.group = rng, system, group

    def next(self) -> Request:
        conversation = SimConversation([(SYSTEM, self.system), (USER, words(self.rng, self.rng.randint(40, 80)))])
        return conversation.request(words(self.rng, self.rng.randint(48, 80)), self.group)

    def done(self, request: Request) -> None:
        pass


class MultiTurnClient:
    """A user asking about a document: it opens the conversation (800 to 1,600 tokens), then
    4 to 8 turns of short questions and answers, each turn repeating the whole history."""

    think = 0.5

    def __init__(self, rng: random.Random, system: list[int], group: str = "chat") -> None:
        self.rng, self.system, self.group = rng, system, group
        self._new()

    def _new(self) -> None:
        self.turns_left = self.rng.randint(4, 8)
        self.conversation = SimConversation([(SYSTEM, self.system)])

    def next(self) -> Request:
        opening = len(self.conversation.messages) == 1
        length = self.rng.randint(800, 1600) if opening else self.rng.randint(30, 80)
        self.conversation.messages.append((USER, words(self.rng, length)))
        return self.conversation.request(words(self.rng, self.rng.randint(40, 80)), self.group)

    def done(self, request: Request) -> None:
        self.conversation.messages.append((ASSISTANT, request.output))
        self.turns_left -= 1
        if self.turns_left == 0:
            self._new()


@dataclass
class SimWorkload:
    """Clients, and for each the interval in which it sends (None: the whole run)."""

    clients: list[Any]
    active: list[tuple[float, float] | None]


def make(name: str, seed: int, scale: float = 1.0) -> SimWorkload:
    """``shared-prefix``, ``multi-turn``, ``bursty`` (chat users and a tenant's burst of
    shared-prefix requests from 20 s to 40 s) or ``bursty-baseline`` (the chat users alone)."""
    rng = random.Random(seed)
    n = max(8, int(256 * scale))
    if name == "shared-prefix":
        systems = [words(rng, 2000) for _ in range(24)]
        return SimWorkload([SharedPrefixClient(random.Random(rng.random()), systems[i % 24]) for i in range(n)], [None] * n)
    chat_system = words(rng, 12)
    if name == "multi-turn":
        n //= 2
        return SimWorkload([MultiTurnClient(random.Random(rng.random()), chat_system) for _ in range(n)], [None] * n)
    if name in ("bursty", "bursty-baseline"):
        steady = [MultiTurnClient(random.Random(rng.random()), chat_system, "steady") for _ in range(n // 2)]
        clients: list[Any] = list(steady)
        active: list[tuple[float, float] | None] = [None] * len(steady)
        if name == "bursty":
            burst_system = words(rng, 2000)
            for _ in range(n):
                client = SharedPrefixClient(random.Random(rng.random()), burst_system, "burst")
                client.think = 0.0
                clients.append(client)
                active.append((20.0, 40.0))
        return SimWorkload(clients, active)
    raise ValueError(f"unknown workload {name!r}")


WORKLOADS = ("shared-prefix", "multi-turn", "bursty", "bursty-baseline")
