"""Trace context between hops; pure, no I/O, no clock.

``traceparent`` reads and writes W3C Trace Context headers (``traceparent``, ``tracestate``) as
the gateway gets them from a client and passes them on in a task's headers. What makes spans and
exports them is on the Twisted side (:mod:`infx.tracing`).
"""
