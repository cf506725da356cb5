"""API keys: who is calling, which tenant they belong to, and their rate limit.

The key file is YAML, so it can be written by hand or mounted from a
Kubernetes Secret (one Secret key holding the whole file)::

    keys:                      # clients of the HTTP API
      - key: sk-team-a-1
        tenant: team-a
        rate_limit: {rate: 5, burst: 10}   # optional, requests per second
        admin: true                        # optional, may read /admin/status
        criticality: standard              # optional: critical, standard (default) or sheddable
        weight: 1                          # optional: share of held requests' turns (> 0)
    engine_keys:               # engines dialling the worker gRPC port
      - key: ek-team-a
        tenant: team-a

``criticality`` is the most a key's requests may claim (and their default;
the ``x-infx-criticality`` header may lower it, see
:func:`protocol.fair_queue.requested_criticality`); ``weight`` is the key's
share when requests wait for an engine: keys with the same ``name`` share
one turn, as one caller.

Without a key file, authentication is off and every caller and engine is in
the default tenant.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from protocol.fair_queue import Criticality, parse_criticality
from protocol.ratelimit import RateLimit

DEFAULT_TENANT = "default"


class KeyFileError(ValueError):
    """The key file is unreadable or malformed."""


@dataclass(frozen=True)
class Principal:
    """An authenticated caller."""

    tenant: str
    key_id: str
    admin: bool = False
    rate_limit: RateLimit | None = None
    criticality: Criticality = Criticality.STANDARD
    weight: float = 1.0


ANONYMOUS = Principal(tenant=DEFAULT_TENANT, key_id="anonymous", admin=True)


class KeyStore:
    """Maps presented keys to principals; an empty store means auth is off."""

    def __init__(self, clients: dict[str, Principal], engines: dict[str, Principal]) -> None:
        self._clients = clients
        self._engines = engines

    @classmethod
    def disabled(cls) -> KeyStore:
        return cls({}, {})

    @classmethod
    def from_file(cls, path: str) -> KeyStore:
        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except OSError as e:
            raise KeyFileError(f"cannot read API key file {path}: {e.strerror}") from None
        except yaml.YAMLError as e:
            raise KeyFileError(f"API key file {path} is not valid YAML: {e}") from None
        return cls.from_mapping(data, source=path)

    @classmethod
    def from_mapping(cls, data: Any, source: str = "<keys>") -> KeyStore:
        if not isinstance(data, dict):
            raise KeyFileError(f"{source}: expected a mapping with 'keys' and/or 'engine_keys'")
        unknown = set(data) - {"keys", "engine_keys"}
        if unknown:
            raise KeyFileError(f"{source}: unknown sections {sorted(unknown)}")
        clients = _entries(data.get("keys") or [], source, "keys")
        engines = _entries(data.get("engine_keys") or [], source, "engine_keys")
        return cls(clients, engines)

    def add_engine_key(self, key: str, principal: Principal) -> None:
        """Admit one more engine key (the gateway's own built-in engine uses one)."""
        self._engines[key] = principal

    @property
    def enabled(self) -> bool:
        return bool(self._clients or self._engines)

    def client(self, authorization: str | None) -> Principal | None:
        """The principal of an HTTP ``Authorization`` header, or None if refused."""
        return self._lookup(self._clients, authorization)

    def engine(self, authorization: str | None) -> Principal | None:
        """The principal of an engine's ``authorization`` metadata, or None if refused."""
        return self._lookup(self._engines, authorization)

    def _lookup(self, table: dict[str, Principal], authorization: str | None) -> Principal | None:
        if not self.enabled:
            return ANONYMOUS
        key = bearer_token(authorization)
        if key is None:
            return None
        for candidate, principal in table.items():
            # Constant-time per comparison, so a key cannot be guessed byte by byte.
            if hmac.compare_digest(candidate.encode(), key.encode()):
                return principal
        return None


def bearer_token(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def _entries(items: Any, source: str, section: str) -> dict[str, Principal]:
    if not isinstance(items, list):
        raise KeyFileError(f"{source}: '{section}' must be a list")
    table: dict[str, Principal] = {}
    for index, item in enumerate(items):
        where = f"{source}: {section}[{index}]"
        if not isinstance(item, dict) or not isinstance(item.get("key"), str) or not item["key"]:
            raise KeyFileError(f"{where}: needs a non-empty 'key'")
        tenant = item.get("tenant", DEFAULT_TENANT)
        if not isinstance(tenant, str) or not tenant:
            raise KeyFileError(f"{where}: 'tenant' must be a non-empty string")
        limit = None
        if item.get("rate_limit") is not None:
            spec = item["rate_limit"]
            try:
                limit = RateLimit(rate=float(spec["rate"]), burst=int(spec.get("burst", max(1, int(float(spec["rate"]))))))
            except (TypeError, KeyError, ValueError) as e:
                raise KeyFileError(f"{where}: rate_limit needs a positive 'rate' and optional 'burst' ({e})") from None
        criticality, weight = _share(item, where)
        if item["key"] in table:
            raise KeyFileError(f"{where}: duplicate key")
        table[item["key"]] = Principal(
            tenant=tenant,
            key_id=str(item.get("name", f"{section}[{index}]")),
            admin=bool(item.get("admin", False)),
            rate_limit=limit,
            criticality=criticality,
            weight=weight,
        )
    return table


def _share(item: dict[str, Any], where: str) -> tuple[Criticality, float]:
    """A key's ``criticality`` and ``weight`` members (see the module docstring)."""
    criticality = Criticality.STANDARD
    if item.get("criticality") is not None:
        if not isinstance(item["criticality"], str):
            raise KeyFileError(f"{where}: criticality must be critical, standard or sheddable")
        try:
            criticality = parse_criticality(item["criticality"])
        except ValueError as e:
            raise KeyFileError(f"{where}: {e}") from None
    weight = item.get("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 < weight < float("inf"):
        raise KeyFileError(f"{where}: weight must be a number > 0, got {weight!r}")
    return criticality, float(weight)
