"""What ``twistd infx`` and ``twistd infx-engine`` show an operator: one line per error, ``--version``.

twistd prints its whole help text before a usage error and a traceback for
anything raised while it builds the service; here every error the operator
can fix is one line on stderr and a non-zero exit code:

- :data:`EXIT_USAGE` (2): the command line, the config file or a file it
  names (API keys, TLS, Kubernetes config) is wrong; nothing was started.
- :data:`EXIT_CANNOT_LISTEN` (1): a port could not be bound; the ports that
  did bind are closed again and nothing else was started.

The options classes of the tap modules (``GatewayOptions``, ``AgentOptions``) keep raising ``UsageError`` (tests
and embedding applications parse them); the plugin stub hands twistd the
``CommandLineOptions`` built here on top of them.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable, NoReturn

from twisted.application.service import IService, MultiService
from twisted.logger import Logger
from twisted.python import usage

from infx import __version__

EXIT_USAGE = 2
EXIT_CANNOT_LISTEN = 1

log = Logger()


class VersionOption:
    """``--version``: infx's version (``twistd --version`` is Twisted's)."""

    def opt_version(self) -> None:
        """Print infx's version and exit."""
        print(f"infx {__version__}")
        raise SystemExit(0)


def one_line_errors(options_class: type[usage.Options], command: str) -> type[usage.Options]:
    """``options_class`` whose usage errors are one line on stderr and exit :data:`EXIT_USAGE`."""

    class CommandLineOptions(options_class):  # type: ignore[misc, valid-type]
        def parseOptions(self, options: Any = None) -> None:
            try:
                super().parseOptions(options)
            except usage.UsageError as e:
                fail(command, str(e))

    CommandLineOptions.__name__ = CommandLineOptions.__qualname__ = f"{options_class.__name__}CommandLine"
    CommandLineOptions.__doc__ = options_class.__doc__
    return CommandLineOptions


def fail(command: str, message: str, *, usage_hint: bool = True) -> NoReturn:
    """The one line, before twistd's logging begins (so stderr is still the terminal)."""
    hint = f" (twistd {command} --help lists the options)" if usage_hint else ""
    print(f"twistd {command}: {message}{hint}", file=sys.stderr)
    raise SystemExit(EXIT_USAGE)


class ExitIfCannotListen(MultiService):
    """Ends ``twistd`` with :data:`EXIT_CANNOT_LISTEN` when a port of ``gateway`` cannot be bound.

    Stock endpoints (tcp, ssl, unix) bind synchronously in
    ``privilegedStartService``, before the reactor runs: the process exits
    there, having logged the one line. When twistd daemonizes (no ``-n``),
    the error is raised instead, for twistd to hand the waiting parent
    through its status pipe (the parent prints it and exits 1; a bare exit
    would leave the parent waiting on that pipe forever). An endpoint that
    binds later stops the reactor, and the exit code is set once it has stopped.
    """

    def __init__(self, reactor: Any, gateway: Any, exit: Callable[[int], None] | None = None,
                 daemon: bool = False) -> None:
        super().__init__()
        self.reactor = reactor
        self.gateway = gateway
        self._exit = exit or exit_after_shutdown
        self._daemon = daemon
        gateway.setServiceParent(self)

    def privilegedStartService(self) -> None:
        super().privilegedStartService()
        failure = self.gateway.listen_failure
        if failure is not None:
            if self._daemon:
                raise failure
            raise SystemExit(EXIT_CANNOT_LISTEN)

    def startService(self) -> None:
        super().startService()
        self.gateway.when_listening().addErrback(self._failed_later)

    def _failed_later(self, _: Any) -> None:
        self.reactor.addSystemEventTrigger("after", "shutdown", self._exit, EXIT_CANNOT_LISTEN)
        self.reactor.stop()


def exit_after_shutdown(code: int) -> None:
    """The process's exit code, from a shutdown trigger (twistd itself would exit 0)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def service_or_exit(command: str, build: Callable[[], IService]) -> IService:
    """``build()``, turning a configuration error found while building into the one line."""
    from infx.config import ConfigError
    from infx.gateway.auth import KeyFileError

    try:
        return build()
    except (ConfigError, KeyFileError) as e:
        fail(command, str(e), usage_hint=False)


__all__ = ["EXIT_CANNOT_LISTEN", "EXIT_USAGE", "ExitIfCannotListen", "VersionOption", "exit_after_shutdown", "fail", "one_line_errors",
           "service_or_exit"]
