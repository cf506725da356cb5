"""``twistd infx-engine``: command-line options and the engine agent's service tree."""

from twisted.application.service import IService, MultiService
from twisted.python import usage


class Options(usage.Options):
    """Options of ``twistd infx-engine``."""

    optParameters: list[list[str | None]] = []


def makeService(options: Options) -> IService:
    """Build the engine agent's service tree from validated options."""
    return MultiService()
