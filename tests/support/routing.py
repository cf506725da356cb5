"""Conversations as routing hints and a fixed set of engines, for routing tests."""

from __future__ import annotations

import json

from protocol.routing.hints import hints_from_json


ENGINES = [f"e{i}" for i in range(8)]


def conversation(n, turns=1, user_words=60):
    messages = [{"role": "system", "content": "Be brief."}]
    for t in range(turns):
        messages.append({"role": "user", "content": f"conversation {n} turn {t} " * user_words})
        if t < turns - 1:
            messages.append({"role": "assistant", "content": f"answer {n}.{t} " * user_words})
    return hints_from_json("chat/completions", json.dumps({"model": "m", "messages": messages}), {})
