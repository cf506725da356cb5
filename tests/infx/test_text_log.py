"""A one-process gateway's text log: twistd's own lines, from the observer twistd would have made."""

from __future__ import annotations

import io
import signal

from twisted.application import service
from twisted.logger import FileLogObserver, ILogObserver, Logger, LogLevel, LogPublisher, formatEventAsClassicLogText
from twisted.python.failure import Failure
from twisted.python.logfile import LogFile

from infx.supervisor.logs import CachedTime
from infx.text_log import TextLog, classic_line, text_log_observer


def events() -> list[dict]:
    collected: list[dict] = []
    log = Logger(namespace="infx.request_log", observer=LogPublisher(collected.append))
    log.info("{text}", text="request r1 chat/completions status=200\nsecond line", status=200)
    log.info("{text}", text="")
    log.info("{text}", text=42)
    log.info("{text}", text="legacy system", log_system="HTTPChannel,3,127.0.0.1")
    log.warn("engine {engine_id} gone: {reason!r}", engine_id="gpu-0", reason="lost")
    try:
        1 / 0
    except ZeroDivisionError:
        log.failure("{text}", Failure(), text="the gateway failed")
    collected.append({"log_format": "{text}", "text": "no level, no namespace, no time"})
    return collected


def test_every_line_is_twisteds_own_text():
    when = CachedTime()
    for event in events():
        assert classic_line(dict(event), when) == formatEventAsClassicLogText(event)


def test_the_observer_is_twistds_own_choice_of_file(tmp_path, monkeypatch):
    monkeypatch.setattr(signal, "getsignal", lambda _: None)
    installed = []
    monkeypatch.setattr(signal, "signal", lambda signum, handler: installed.append(signum))
    path = tmp_path / "gw.log"
    observer = text_log_observer({"logfile": str(path), "nodaemon": True})
    assert isinstance(observer, FileLogObserver) and installed == [signal.SIGUSR1]
    assert isinstance(observer._outFile, LogFile)
    for event in events():
        observer(event)
    observer._outFile.close()
    text = path.read_text()
    assert "[infx.request_log#info] request r1 chat/completions status=200\n\tsecond line\n" in text
    assert "ZeroDivisionError" in text
    # Standard output in the foreground; nothing where twistd logs elsewhere or refuses.
    assert text_log_observer({"logfile": None, "nodaemon": True})._outFile is __import__("sys").stdout
    assert text_log_observer({"logfile": "-", "nodaemon": True}) is not None
    assert text_log_observer({"logfile": "-", "nodaemon": False}) is None
    assert text_log_observer({"syslog": True, "nodaemon": True}) is None
    assert text_log_observer({"logger": "my.factory", "nodaemon": True}) is None
    assert text_log_observer(None) is None


def test_the_application_gets_the_observer_when_the_service_joins_it():
    application = service.Application("infx")
    inner = service.Service()
    top = TextLog(inner, {"logfile": None, "nodaemon": True})
    top.setServiceParent(application)
    observer = application.getComponent(ILogObserver)
    assert isinstance(observer, FileLogObserver)
    assert inner.parent is top and list(service.IServiceCollection(application)) == [top]
    out = io.StringIO()
    observer._outFile = out
    observer({"log_format": "{text}", "text": "hello", "log_level": LogLevel.info, "log_namespace": "n"})
    assert out.getvalue() == "- [n#info] hello\n"
