"""``twistd infx``: command-line options and the gateway's service tree."""

from twisted.application.service import IService, MultiService
from twisted.python import usage


class Options(usage.Options):
    """Options of ``twistd infx``."""

    optParameters: list[list[str | None]] = []


def makeService(options: Options) -> IService:
    """Build the gateway's service tree from validated options."""
    return MultiService()
