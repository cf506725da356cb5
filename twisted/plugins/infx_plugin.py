"""twistd plugins: ``twistd infx`` (the gateway) and ``twistd infx-engine`` (the engine agent).

Kept to names only, so that Twisted's plugin scan imports nothing heavy.
"""

from twisted.application.service import ServiceMaker

infx_gateway = ServiceMaker(
    "infx",
    "infx.tap",
    "OpenAI-compatible inference gateway that hands requests to engines over gRPC",
    "infx",
)

infx_engine = ServiceMaker(
    "infx-engine",
    "infx.engine_tap",
    "Engine agent: connects to an infx gateway and runs its tasks on a local runtime",
    "infx-engine",
)
