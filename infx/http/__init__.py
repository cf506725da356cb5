"""The gateway's OpenAI-compatible HTTP API on twisted.web.

``api`` is the resource tree and each call from admission to its one response (relay,
backpressure, errors), ``site`` the site that serves it (a body over the limit is refused with
413 before any resource runs), ``request_log`` one request's trace, ending in one log line and
its metrics.
"""
