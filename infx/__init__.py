"""infx: the Twisted side of the inference exchange.

Sockets, timers, threads and processes live here; the decisions they act on
are made by the pure machines in :mod:`protocol`.
"""
