"""Write a kubeconfig file that points the official client (or kubectl) at a test API server."""

from __future__ import annotations

from pathlib import Path

import yaml


def write_kubeconfig(
    path: str | Path,
    server_url: str,
    *,
    token: str | None = None,
    namespace: str = "default",
    context: str = "infx-test",
) -> Path:
    """Write a one-cluster, one-user kubeconfig; ``token`` becomes a bearer token if given."""
    user: dict[str, str] = {"token": token} if token else {}
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": context, "cluster": {"server": server_url}}],
        "users": [{"name": context, "user": user}],
        "contexts": [{"name": context, "context": {
            "cluster": context, "user": context, "namespace": namespace,
        }}],
        "current-context": context,
    }
    path = Path(path)
    path.write_text(yaml.safe_dump(config))
    return path
