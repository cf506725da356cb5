"""infx's pure core: state machines with no I/O, no threads and no clock reads.

Everything here takes bytes, values and the current time as arguments and
returns events and effects as values; the Twisted layer in :mod:`infx` owns
sockets and timers. A test can drive any machine here without a reactor.

One subpackage per concern, named as its Twisted side in :mod:`infx` is: ``grpc`` (gRPC over
h2), ``openai`` (OpenAI JSON and the typed wire), ``processor`` (tasks and engines),
``routing``, ``exchange`` (the streams between gateways), ``gateway`` (the core that joins
them), ``agent`` (the engine agent), ``scaling``, ``discovery``; ``pb`` holds the generated
messages, and ``errors``, ``backoff`` and ``repeats`` are shared by all.
"""
