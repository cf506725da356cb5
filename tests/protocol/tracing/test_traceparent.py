"""W3C traceparent/tracestate: read as the specification says; malformed input reads as none, never raises."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from protocol.tracing.traceparent import (
    TraceParent, form_traceparent, form_tracestate, header_values, parse_traceparent, parse_tracestate,
)

GOOD = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def test_a_valid_traceparent_gives_the_callers_trace_span_and_flags():
    parent = parse_traceparent([GOOD])
    assert parent == TraceParent(0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331, 1)
    assert parent.sampled
    assert not parse_traceparent(["00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00"]).sampled


def test_forming_and_parsing_round_trip():
    assert form_traceparent(0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331, 1) == GOOD
    assert parse_traceparent([form_traceparent(1, 2, 0)]) == TraceParent(1, 2, 0)


@pytest.mark.parametrize("value", [
    "",
    "00",
    GOOD.upper(),  # upper-case hex is invalid
    GOOD[:-1],  # one character short
    GOOD + "-extra",  # version 00 has nothing after the flags
    GOOD + "0",
    "ff" + GOOD[2:],  # version ff is forbidden
    "0g" + GOOD[2:],
    "00-00000000000000000000000000000000-b7ad6b7169203331-01",  # all-zero trace id
    "00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01",  # all-zero span id
    "00-0af7651916cd43dd8448eb211c80319x-b7ad6b7169203331-01",
    "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-0z",
    "00_0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
    "00-0af7651916cd43dd8448eb211c80319c_b7ad6b7169203331-01",
    "01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01x",  # a later version's extra needs a '-'
])
def test_a_malformed_traceparent_reads_as_none(value):
    assert parse_traceparent([value]) is None


def test_a_later_version_may_carry_more_fields_and_blanks_around_are_dropped():
    assert parse_traceparent(["cc" + GOOD[2:] + "-what-comes-next"]) is not None
    assert parse_traceparent([" \t" + GOOD + " "]) is not None


def test_no_header_or_two_read_as_none():
    assert parse_traceparent([]) is None
    assert parse_traceparent([GOOD, GOOD]) is None


def test_forming_refuses_ids_that_cannot_be_sent():
    for trace_id, span_id, flags in ((0, 1, 0), (1, 0, 0), (1 << 128, 1, 0), (1, 1 << 64, 0), (1, 1, 256)):
        with pytest.raises(ValueError):
            form_traceparent(trace_id, span_id, flags)


def test_tracestate_members_in_order_across_headers_empty_ones_skipped():
    assert parse_tracestate(["rojo=00f067aa0ba902b7, congo=t61rcWkgMzE", ",,tenant@vendor=x y"]) == (
        ("rojo", "00f067aa0ba902b7"), ("congo", "t61rcWkgMzE"), ("tenant@vendor", "x y"))
    assert parse_tracestate(["a=1 \t"]) == (("a", "1"),)  # blanks around a member are the list's, not the value's
    assert form_tracestate((("a", "1"), ("b", "2"))) == "a=1,b=2"
    assert parse_tracestate([]) == ()


@pytest.mark.parametrize("value", [
    "Upper=1",  # keys are lower case
    "a=1,a=2",  # a key twice
    "a",  # no '='
    "a=b,c",
    "a=x=y",  # '=' inside a value
    "a=" + "x" * 257,  # value too long
    "a=",  # an empty value
    "a=\x7f",  # not printable
    "a=caf\u00e9",  # not ASCII
    "@v=1",
    "k" * 257 + "=1",
    ",".join(f"k{i}=v" for i in range(33)),  # more than 32 members
])
def test_a_malformed_tracestate_reads_as_none(value):
    assert parse_tracestate([value]) is None


def test_header_values_are_found_whatever_the_case_of_their_key():
    assert header_values({"traceparent": [GOOD]}, "traceparent") == [GOOD]
    assert header_values({"TraceParent": [GOOD], "x": ["1"]}, "traceparent") == [GOOD]
    assert header_values({}, "traceparent") == []


@given(st.lists(st.text(max_size=80), max_size=3))
def test_no_header_value_raises(values):
    parse_traceparent(values)
    parse_tracestate(values)


@given(st.integers(1, (1 << 128) - 1), st.integers(1, (1 << 64) - 1), st.integers(0, 255))
def test_every_formed_traceparent_parses_back(trace_id, span_id, flags):
    assert parse_traceparent([form_traceparent(trace_id, span_id, flags)]) == TraceParent(trace_id, span_id, flags)
