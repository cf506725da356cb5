"""Every logger of infx/ and the namespace it logs under: the names operators filter and alert on.

They are the modules' paths from before infx/ was split into subpackages, pinned where a module
moved, so that a log line reads as it always did. A new logger needs a line here.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

from twisted.logger import Logger

ROOT = Path(__file__).resolve().parents[2]

#: Where each logger is made -> its namespace.
NAMESPACES = {
    "infx/cli.py": "infx.cli",
    "infx/service.py": "infx.service",
    "infx/transport/server.py": "infx.transport.server",
    "infx/http/api.py": "infx.gateway",
    "infx/http/resources.py": "infx.gateway",
    "infx/http/request_log.py": "infx.request_log",
    "infx/http/site.py": "infx.gateway_site",
    "infx/http/lean.py": "infx.gateway_site",
    "infx/gateway/dispatcher.py": "infx.dispatcher",
    "infx/gateway/key_reload.py": "infx.key_reload",
    "infx/gateway/workers.py": "infx.workers",
    "infx/gateway/in_process.py": "infx.gateway.in_process",
    "infx/gateway/runtime_engines.py": "infx.gateway.runtime_engines",
    "infx/exchange/exchanger.py": "infx.exchanger",
    "infx/exchange/peer_tls.py": "infx.peer_tls",
    "infx/discovery/kube.py": "infx.kube",
    "infx/agent/engine.py": "infx.engine",
    "infx/agent/runtimes.py": "infx.runtimes",
    "infx/agent/runtime_watch.py": "infx.runtime_watch",
    "infx/agent/slot_keeping.py": "infx.slot_keeping",
    "infx/agent/runtime_load_watch.py": "infx.runtime_load_watch",
    "infx/agent/upstream_key.py": "infx.upstream_key",
    "infx/scaling/scaler.py": "infx.scaler.InferenceScaler",
    "infx/scaling/lease.py": "infx.scaler_lease.LeaseElector",
    "infx/supervisor/supervisor.py": "infx.supervisor",
    "infx/supervisor/worker.py": "infx.supervisor.worker",
    "infx/tracing/__init__.py": "infx.tracing",
}


def _loggers_made() -> dict[str, str]:
    """Each ``Logger(...)`` call in infx/: its file -> the namespace it names, or the module's own."""
    made: dict[str, str] = {}
    for path in sorted((ROOT / "infx").rglob("*.py")):
        name = path.relative_to(ROOT).as_posix()
        for node in ast.walk(ast.parse(path.read_text(), name)):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "Logger":
                assert name not in made, f"{name} makes two loggers"
                given = [k.value for k in node.keywords if k.arg == "namespace"]
                made[name] = given[0].value if given else name[:-3].replace("/", ".")
    return made


def test_every_logger_of_infx_logs_under_the_namespace_operators_know():
    assert _loggers_made() == NAMESPACES


def test_no_logger_is_a_class_attribute_whose_namespace_would_follow_the_module():
    """A class-level ``Logger()`` takes ``module.Class`` when used, so a move would rename it."""
    for path in sorted((ROOT / "infx").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                for statement in node.body:
                    assert not (isinstance(statement, ast.Assign) and isinstance(statement.value, ast.Call)
                                and getattr(statement.value.func, "id", None) == "Logger"), (path, node.name)


def test_the_module_level_loggers_log_under_those_namespaces():
    for path, namespace in NAMESPACES.items():
        module = importlib.import_module(path[:-3].replace("/", "."))
        logger = getattr(module, "log", None)
        if isinstance(logger, Logger):
            assert logger.namespace == namespace, path


def test_the_scaler_and_the_lease_elector_log_under_their_classes_old_paths():
    from twisted.internet import task

    from infx.scaling.lease import LeaseElector
    from infx.scaling.scaler import InferenceScaler

    elector = LeaseElector(task.Clock(), store=object(), identity="me")
    scaler = InferenceScaler(task.Clock(), service_query=object())
    assert (elector.log.namespace, elector.log.source) == (NAMESPACES["infx/scaling/lease.py"], elector)
    assert (scaler.log.namespace, scaler.log.source) == (NAMESPACES["infx/scaling/scaler.py"], scaler)
