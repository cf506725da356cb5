"""The upper bounds on a real run's cached share (harness/real_routing/bounds.py), from hand-made traces."""

from __future__ import annotations

import pytest

from harness.real_routing.bounds import common_prefix, reuse_bounds
from harness.real_routing.figures import Record

A0 = (1, 2, 3, 4)
A1 = A0 + (9, 9)
B0 = (5, 6, 7, 8, 10, 11, 12, 13, 14, 15)
B1 = B0 + (16,)
PROMPTS = {("a", 0): A0, ("a", 1): A1, ("b", 0): B0, ("b", 1): B1}


def record(conversation: str, turn: int, sent: float, first: float, ended: float) -> Record:
    tokens = PROMPTS[(conversation, turn)]
    return Record("c", "chat", conversation, turn, 0, sent, first, ended, 200, "", "e0", 0, len(tokens))


#: a's and b's contexts must both be kept from their first turn's end to their second's sending, at once.
TRACE = [record("a", 0, 0.0, 0.5, 1.0), record("b", 0, 0.0, 0.5, 1.2),
         record("a", 1, 2.0, 2.5, 3.0), record("b", 1, 2.1, 2.6, 3.2)]
TOTAL = len(A0) + len(A1) + len(B0) + len(B1)


def prompt(conversation: str, turn: int) -> tuple[int, ...]:
    return PROMPTS[(conversation, turn)]


def test_common_prefix_counts_leading_tokens_in_common():
    assert common_prefix((1, 2, 3), (1, 2, 4, 5)) == 2
    assert common_prefix((), (1,)) == 0 and common_prefix(A0, A1) == 4 and common_prefix(A1, A1) == 6


def test_one_cache_holding_every_earlier_prompt_reuses_each_later_turns_history():
    bounds = reuse_bounds(TRACE, prompt, engines=1, slots=0, host_tokens=None, generated=1)
    assert bounds.all == pytest.approx((4 + 10) / TOTAL) and bounds.capacity is None


def test_a_prompt_reuses_only_what_ended_before_its_first_token_and_computes_at_least_one_token():
    trace = [record("a", 0, 0.0, 4.0, 5.0), record("a", 1, 1.0, 1.5, 4.5), record("b", 0, 6.0, 6.5, 7.0),
             record("b", 1, 8.0, 8.5, 9.0)]
    PROMPTS[("b", 1)] = B0  # the same prompt again: all but its last token
    try:
        bounds = reuse_bounds(trace, prompt, engines=1, slots=0, host_tokens=None, generated=1)
    finally:
        PROMPTS[("b", 1)] = B1
    # Neither of a's turns ended before the other's first token (a trace no closed loop makes: the rule shows).
    assert bounds.all == pytest.approx(9 / (len(A0) + len(A1) + 2 * len(B0)))


def test_the_capacity_bound_keeps_the_contexts_that_reuse_most_when_not_all_fit():
    """Room for one context while both wait (host cache of 7 tokens, contexts of 4 and 10 tokens, no slot):
    b's, which its next turn reuses 10 tokens of; with room for two, both."""
    one = reuse_bounds(TRACE, prompt, engines=1, slots=0, host_tokens=7, generated=1)
    assert one.capacity == pytest.approx(10 / TOTAL) and one.all == pytest.approx(14 / TOTAL)
    two = reuse_bounds(TRACE, prompt, engines=1, slots=0, host_tokens=8, generated=1)
    assert two.capacity == pytest.approx(14 / TOTAL)


def test_an_idle_slot_keeps_a_context_and_a_slot_generating_an_answer_does_not():
    """One slot, no host cache to speak of: both wait over [1.2, 2.0) with the slot idle, so one is kept;
    with c generating in the slot all that time, none."""
    assert reuse_bounds(TRACE, prompt, engines=1, slots=1, host_tokens=1, generated=1).capacity == \
        pytest.approx(10 / TOTAL)
    PROMPTS[("c", 0)] = (20, 21)
    try:
        busy = reuse_bounds([*TRACE, record("c", 0, 0.0, 0.9, 2.2)], prompt, engines=1, slots=1, host_tokens=1,
                            generated=1)
    finally:
        del PROMPTS[("c", 0)]
    assert busy.capacity == pytest.approx(0.0)


def test_tokens_generated_after_a_prompt_and_a_warm_up_prompt_count_as_reusable():
    """A context keeps all but the last token generated after its prompt, which may match the next
    prompt's; and every engine ran the warm-up prompt first, which shares the template's first tokens."""
    bounds = reuse_bounds(TRACE, prompt, engines=1, slots=0, host_tokens=None, generated=3)
    assert bounds.all == pytest.approx((5 + 10) / TOTAL)  # a's second turn: 4 + 2, less the token it computes
    warm = reuse_bounds(TRACE, prompt, engines=1, slots=0, host_tokens=None, generated=1, preloaded=[(5, 6, 0)])
    assert warm.all == pytest.approx((4 + 10 + 2) / TOTAL)  # b's first turn starts as the warm-up did
