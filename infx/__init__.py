"""infx: the Twisted side of the inference exchange.

Sockets, timers, threads and processes live here; the decisions they act on
are made by the pure machines in :mod:`protocol`.
"""

#: The one place the version is written (setup.cfg reads it; ``twistd infx --version`` prints it).
__version__ = "0.1.0"
