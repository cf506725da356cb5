"""twistd plugins: ``twistd infx`` (the gateway) and ``twistd infx-engine`` (the engine agent).

Kept to names only, so that Twisted's plugin scan imports nothing heavy.
"""

from twisted.application.service import ServiceMaker
from twisted.python.reflect import namedAny


class _InfxCommand(ServiceMaker):
    """Hands twistd the tap module's ``CommandLineOptions``: its errors are one line, not the help text."""

    @property
    def options(self):
        return namedAny(self.module).CommandLineOptions


infx_gateway = _InfxCommand(
    "infx",
    "infx.tap",
    "OpenAI-compatible inference gateway that hands requests to engines over gRPC",
    "infx",
)

infx_engine = _InfxCommand(
    "infx-engine",
    "infx.engine_tap",
    "Engine agent: connects to an infx gateway and runs its tasks on a local runtime",
    "infx-engine",
)
