"""infx's pure core: state machines with no I/O, no threads and no clock reads.

Everything here takes bytes, values and the current time as arguments and
returns events and effects as values; the Twisted layer in :mod:`infx` owns
sockets and timers. A test can drive any machine here without a reactor.
"""
