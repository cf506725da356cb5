"""infx: the Twisted side of the inference exchange.

Sockets, timers, threads and processes live here; the decisions they act on
are made by the pure machines in :mod:`protocol`.

The entry points are at this level (``tap``: ``twistd infx``; ``engine_tap``: ``twistd
infx-engine``; ``service``, ``config``, ``cli``); each concern is a subpackage named as its pure
side is: ``transport`` (gRPC on Twisted), ``http`` (the OpenAI API), ``gateway`` (the core's
owner, engine streams, keys, metrics), ``exchange`` (peer streams), ``discovery``, ``agent``
(the engine agent), ``scaling``.
"""

#: The one place the version is written (setup.cfg reads it; ``twistd infx --version`` prints it).
__version__ = "0.1.0"
