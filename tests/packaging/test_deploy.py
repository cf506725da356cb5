"""The deploy manifests and the Dockerfile, checked offline: every object validates strictly
against the Kubernetes schemas, container commands are accepted by infx's own option
parsers, every file the Dockerfile copies exists, and its command starts the gateway."""

from __future__ import annotations

import copy
import re
import shlex
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from twisted.python import usage

from infx import engine_tap, tap

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
MANIFESTS = sorted(DEPLOY.glob("*.yaml"))
#: The newest schema kubernetes-validate ships; manifests must be valid there, strictly.
K8S_VERSION = kubernetes_validate.latest_version()
#: Which options parser runs each plugin a container may start.
PLUGINS: dict[str, type[usage.Options]] = {"infx": tap.GatewayOptions, "infx-engine": engine_tap.AgentOptions}


def documents() -> list[tuple[str, dict[str, Any]]]:
    return [(f"{path.name}:{doc['kind']}/{doc['metadata']['name']}", doc)
            for path in MANIFESTS for doc in yaml.safe_load_all(path.read_text()) if doc]


def infx_containers() -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(id, container, pod spec) of every container that runs ``twistd``."""
    out = []
    for name, doc in documents():
        pod = doc.get("spec", {}).get("template", {}).get("spec")
        for container in (pod or {}).get("containers", []):
            if container.get("command", [""])[0] == "twistd":
                out.append((f"{name}:{container['name']}", container, pod))
    return out


def test_there_are_manifests_for_the_gateway_and_an_engine():
    kinds = {name.split(":")[1] for name, _ in documents()}
    assert {"Deployment/infx", "Service/infx", "Role/infx", "RoleBinding/infx", "ServiceAccount/infx"} <= kinds
    assert {c["command"][3] for _, c, _ in infx_containers()} == {"infx", "infx-engine"}


@pytest.mark.parametrize(("name", "doc"), documents(), ids=[n for n, _ in documents()])
def test_every_object_validates_strictly_against_the_kubernetes_schema(name, doc):
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_strict_validation_rejects_a_misspelled_field():
    """So that the test above can fail: an unknown field is an error, not ignored."""
    _, deployment = next((n, d) for n, d in documents() if d["kind"] == "Deployment")
    broken = copy.deepcopy(deployment)
    broken["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {"periodSeconds": 2}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)


def _expand(arg: str, env: dict[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion of container args (unknown references stay as they are)."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), arg)


def parsed(container: dict[str, Any], pod: dict[str, Any], tmp: Path) -> usage.Options:
    """The container's command as its plugin parses it, as the kubelet would run it: ``$(VAR)``
    references get placeholder values, and files under volume mounts are stood in for by valid
    key files under ``tmp``."""
    command = container["command"]
    assert command[:3] == ["twistd", "-n", "--pidfile="]
    options = PLUGINS[command[3]]()
    env = {item["name"]: f"placeholder-{item['name'].lower()}" for item in container.get("env", [])}
    mounts = {m["mountPath"]: tmp / m["name"] for m in container.get("volumeMounts", [])}
    assert {m["name"] for m in container.get("volumeMounts", [])} <= {v["name"] for v in pod.get("volumes", [])}
    args = []
    for arg in command[4:] + container.get("args", []):
        arg = _expand(arg, env)
        for mount, local in mounts.items():
            if arg.startswith(mount + "/"):
                arg = str(local / arg[len(mount) + 1:])
                Path(arg).parent.mkdir(parents=True, exist_ok=True)
                if arg.endswith(".yaml"):
                    Path(arg).write_text(yaml.safe_dump({"keys": [{"key": "sk-1", "tenant": "t"}]}))
                else:  # a secret of one line, as the Secret's file holds it
                    Path(arg).write_text("placeholder-secret\n")
        args.append(arg)
    options.parseOptions(args)
    return options


@pytest.mark.parametrize(("name", "container", "pod"), infx_containers(), ids=[n for n, _, _ in infx_containers()])
def test_container_commands_are_accepted_by_the_plugin_options(name, container, pod, tmp_path):
    parsed(container, pod, tmp_path)


@pytest.mark.parametrize(("name", "container", "pod"), infx_containers(), ids=[n for n, _, _ in infx_containers()])
def test_no_secret_is_on_a_command_line_where_ps_would_show_it(name, container, pod):
    """Issue 22 item 4: secrets come from files or the environment (``--internal-secret-file``,
    ``INFX_ENGINE_KEY``), never from ``args``, where ``$(VAR)`` would put them in ``ps``."""
    args = container["command"] + container.get("args", [])
    assert not {"--internal-secret", "--key"} & set(args), args
    assert not [arg for arg in args if "$(" in arg and ("SECRET" in arg or "KEY" in arg)], args


def gateway() -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    deployment = next(d for _, d in documents() if d["kind"] == "Deployment" and d["metadata"]["name"] == "infx")
    pod = deployment["spec"]["template"]["spec"]
    return deployment, pod, pod["containers"][0]


def test_the_gateway_is_configured_for_peer_discovery_probes_and_graceful_shutdown(tmp_path):
    deployment, pod, container = gateway()
    config = parsed(container, pod, tmp_path).config_value
    assert config.kube and config.internal_secret
    label_key, label_value = config.pod_label_pair
    assert deployment["spec"]["template"]["metadata"]["labels"][label_key] == label_value
    fields = {item["name"]: item.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") for item in container["env"]}
    assert fields["POD_NAME"] == "metadata.name" and fields["NAMESPACE"] == "metadata.namespace"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["internal-grpc"] == config.effective_peer_port
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert "preStop" in container["lifecycle"]
    assert pod["terminationGracePeriodSeconds"] > config.grace_period
    role = next(d for _, d in documents() if d["kind"] == "Role")
    pods_rule = next(r for r in role["rules"] if "pods" in r["resources"])
    assert {"get", "list", "watch"} <= set(pods_rule["verbs"])


def test_engines_present_a_key_when_the_gateway_requires_api_keys(tmp_path):
    _, pod, container = gateway()
    if not parsed(container, pod, tmp_path).config_value.api_keys:
        pytest.skip("the gateway runs without API keys")
    for name, engine, _ in infx_containers():
        if engine["command"][3] == "infx-engine":
            env = {item["name"] for item in engine.get("env", [])}
            assert "INFX_ENGINE_KEY" in env or any(a.startswith("--key") for a in engine.get("args", [])), name


def _dockerfile() -> list[tuple[str, str]]:
    """(instruction, rest) pairs, continuation lines joined."""
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            instruction, _, rest = line.partition(" ")
            out.append((instruction.upper(), rest.strip()))
    return out


def test_every_file_the_dockerfile_copies_exists():
    copies = [rest for instruction, rest in _dockerfile() if instruction in ("COPY", "ADD")]
    assert copies
    for rest in copies:
        parts = [p for p in shlex.split(rest) if not p.startswith("--")]
        for source in parts[:-1]:
            assert (ROOT / source).exists(), f"Dockerfile copies {source}, which does not exist"


@pytest.mark.e2e
def test_the_dockerfile_command_starts_the_gateway_in_the_venv(tmp_path: Path):
    from harness.twistd_processes import gateway_ports, supervisor_ports, wait_until

    cmd = next(yaml.safe_load(rest) for instruction, rest in _dockerfile() if instruction == "CMD")
    assert cmd[0] == "twistd"
    # Port 0 everywhere, read back from what it says: no port picked here could be taken first.
    argv = [str(Path(sys.executable).with_name("twistd")), *cmd[1:],
            *(f"--{option}=tcp:0:interface=127.0.0.1" for option in ("http", "worker-grpc", "internal-grpc"))]
    log = tmp_path / "gateway.log"
    with log.open("wb") as out:
        process = subprocess.Popen(argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    try:
        def http_port() -> int | None:
            assert process.poll() is None, log.read_text()
            said = log.read_text()
            # The command's --workers default is the cores: one process on one core, else a supervisor.
            bound = supervisor_ports(said) or gateway_ports(said)
            return bound[0] if bound else None

        http = wait_until(http_port, "the gateway's ports")

        def listens() -> bool:
            assert process.poll() is None, log.read_text()
            with socket.create_connection(("127.0.0.1", http), timeout=0.5):
                return True

        wait_until(listens, "the gateway to listen")
        process.send_signal(signal.SIGTERM)
        process.wait(15)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
