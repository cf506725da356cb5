"""``twistd infx --workers N``: N gateway processes sharing the listening ports, under one supervisor.

``supervisor`` (the twistd process: binds the ports, starts, watches, restarts and drains the
workers, relays their logs), ``worker`` (one worker process's entry point), ``role`` (what the
supervisor tells a worker), ``sockets`` (the shared and per-worker listening sockets), ``peers``
(a worker's peers: its siblings and every worker of each peer), ``metrics`` (``/metrics`` with
every worker's series). The decisions are :mod:`protocol.supervisor`'s. docs/workers.md is the
user's guide.
"""
