"""API keys: who is calling, which tenant they belong to, and their rate limit.

The key file is YAML, so it can be written by hand or mounted from a
Kubernetes Secret (one Secret key holding the whole file)::

    keys:                      # clients of the HTTP API
      - key: sk-team-a-1
        tenant: team-a
        name: team-a-ci                    # optional, names the key in logs and rate limits
        rate_limit: {rate: 5, burst: 10}   # optional, requests per second
        admin: true                        # optional: may read /admin/status for its tenant;
                                           #   admin: cluster, for every tenant
        criticality: standard              # optional: critical, standard (default) or sheddable
        weight: 1                          # optional: share of held requests' turns (0.001 to 1000)
    engine_keys:               # engines dialling the worker gRPC port
      - key: ek-team-a
        tenant: team-a

The schema is strict, because a typo here is a security mistake: an unknown
member (``tenat:``), an ``admin`` that is neither a YAML boolean (``"false"`` is a
string) nor ``cluster``, a malformed ``rate_limit``, a key listed twice or a YAML mapping with
a member given twice are errors, at start and when the file is read again
(:mod:`infx.gateway.key_reload`). :func:`parse_key_file` is pure: text in, tables out.

``criticality`` is the most a key's requests may claim (and their default;
the ``x-infx-criticality`` header may lower it, see
:func:`protocol.processor.fair_queue.requested_criticality`); ``weight`` is the key's
share when requests wait for an engine: keys with the same ``name`` share
one turn, as one caller.

Without a key file, authentication is off and every caller and engine is in
the default tenant. With one, it is on even if the file lists no key (then
every caller is refused), so that emptying the file never opens the gateway.
"""

from __future__ import annotations

import hashlib
import hmac
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import yaml

from protocol.gateway.ratelimit import RateLimit
from protocol.processor.fair_queue import Criticality, parse_criticality, weight_problem

DEFAULT_TENANT = "default"
#: The ``admin`` value of a key that may read every tenant's state in /admin/status.
CLUSTER_ADMIN = "cluster"


class KeyFileError(ValueError):
    """The key file is unreadable or malformed; the message names the file and the entry."""


@dataclass(frozen=True)
class Principal:
    """An authenticated caller."""

    tenant: str
    key_id: str
    #: May read /admin/status: its own tenant's, or with ``cluster_admin`` every tenant's.
    admin: bool = False
    cluster_admin: bool = False
    rate_limit: RateLimit | None = None
    criticality: Criticality = Criticality.STANDARD
    weight: float = 1.0


#: Every caller when auth is off: the gateway is open, /admin/status too (it logs so at start).
ANONYMOUS = Principal(tenant=DEFAULT_TENANT, key_id="anonymous", admin=True, cluster_admin=True)


@dataclass(frozen=True)
class KeyTables:
    """One parse of a key file: presented key -> principal, for clients and for engines."""

    clients: dict[str, Principal]
    engines: dict[str, Principal]


_SECTIONS = ("keys", "engine_keys")
_MEMBERS = {"keys": frozenset({"key", "tenant", "name", "admin", "rate_limit", "criticality", "weight"}),
            "engine_keys": frozenset({"key", "tenant", "name"})}
_RATE_MEMBERS = frozenset({"rate", "burst"})


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses a mapping giving one member twice (PyYAML keeps the last)."""


def _strict_mapping(loader: _StrictLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        member = loader.construct_object(key_node)
        if member in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"{member!r} is given twice in one mapping", key_node.start_mark)
        seen.add(member)
    return loader.construct_mapping(node)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _strict_mapping)


def parse_key_file(text: str, source: str = "<keys>") -> KeyTables:
    """The tables of a key file's text; raises :class:`KeyFileError` with one line naming
    ``source`` and the entry at fault."""
    from infx.config import yaml_problem

    try:
        data = yaml.load(text, Loader=_StrictLoader) or {}
    except yaml.YAMLError as e:
        raise KeyFileError(f"API key file {source} is not valid YAML: {yaml_problem(e)}") from None
    return parse_key_mapping(data, source)


def parse_key_mapping(data: Any, source: str = "<keys>") -> KeyTables:
    """The tables of an already loaded key file (see the module docstring for the schema)."""
    if not isinstance(data, dict):
        raise KeyFileError(f"{source}: expected a mapping with 'keys' and/or 'engine_keys'")
    unknown = [str(name) for name in data if name not in _SECTIONS]
    if unknown:
        raise KeyFileError(f"{source}: unknown sections {sorted(unknown)}; expected 'keys' and/or 'engine_keys'")
    clients = _entries(data.get("keys") or [], source, "keys")
    engines = _entries(data.get("engine_keys") or [], source, "engine_keys")
    return KeyTables(clients, engines)


class KeyStore:
    """Maps presented keys to principals; the gateway and the worker service share one.

    :meth:`replace` swaps the file's tables in place (a reload), so every
    request after it sees the new keys; keys added with
    :meth:`add_engine_key` (the built-in engine's) survive a reload.
    """

    def __init__(self, tables: KeyTables | None, source: str | None = None) -> None:
        """``tables`` None: auth is off."""
        self.enabled = tables is not None
        self.source = source
        self._tables = tables or KeyTables({}, {})
        self._added_engines: dict[str, Principal] = {}
        #: Called after :meth:`replace`, e.g. to end the streams of engines whose key was removed.
        self.on_replaced: list[Callable[[], None]] = []

    @classmethod
    def disabled(cls) -> KeyStore:
        return cls(None)

    @classmethod
    def from_file(cls, path: str) -> KeyStore:
        return cls(read_key_file(path), source=path)

    @classmethod
    def from_mapping(cls, data: Any, source: str = "<keys>") -> KeyStore:
        return cls(parse_key_mapping(data, source), source=source)

    def replace(self, tables: KeyTables) -> None:
        """Serve ``tables`` from now on (the file changed and parsed)."""
        if not self.enabled:
            raise ValueError("auth is off: there is no key file to reload")
        self._tables = tables
        for hook in list(self.on_replaced):
            hook()

    def counts(self) -> tuple[int, int]:
        """How many client and engine keys the file gave (the built-in engine's aside)."""
        return len(self._tables.clients), len(self._tables.engines)

    def add_engine_key(self, key: str, principal: Principal) -> None:
        """Admit one more engine key (the gateway's own built-in engine uses one)."""
        self._added_engines[key] = principal

    def client(self, authorization: str | None) -> Principal | None:
        """The principal of an HTTP ``Authorization`` header, or None if refused."""
        return self._lookup(self._tables.clients, authorization)

    def engine(self, authorization: str | None) -> Principal | None:
        """The principal of an engine's ``authorization`` metadata, or None if refused."""
        return (self._lookup(self._tables.engines, authorization)
                or (self._lookup(self._added_engines, authorization) if self.enabled else None))

    def _lookup(self, table: dict[str, Principal], authorization: str | None) -> Principal | None:
        if not self.enabled:
            return ANONYMOUS
        key = bearer_token(authorization)
        if key is None:
            return None
        found = None
        for candidate, principal in table.items():
            # Constant-time per comparison and no early exit, so a key cannot be guessed byte by byte.
            if hmac.compare_digest(candidate.encode(), key.encode()):
                found = principal
        return found


def read_key_file(path: str) -> KeyTables:
    """Read and parse the key file at ``path``; raises :class:`KeyFileError`."""
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise KeyFileError(f"cannot read API key file {path}: {getattr(e, 'strerror', None) or e}") from None
    return parse_key_file(text, path)


def bearer_token(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def key_fingerprint(key: str) -> str:
    """A stable, non-secret name for a key without one: a reload or reordering keeps it."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:12]


def _entries(items: Any, source: str, section: str) -> dict[str, Principal]:
    if not isinstance(items, list):
        raise KeyFileError(f"{source}: '{section}' must be a list of entries")
    table: dict[str, Principal] = {}
    for index, item in enumerate(items):
        where = f"{source}: {section}[{index}]"
        if not isinstance(item, dict):
            raise KeyFileError(f"{where}: expected a mapping such as {{key: ..., tenant: ...}}")
        unknown = sorted(str(member) for member in item if member not in _MEMBERS[section])
        if unknown:
            raise KeyFileError(f"{where}: unknown member {', '.join(map(repr, unknown))}; "
                               f"expected {', '.join(sorted(_MEMBERS[section]))}")
        key = item.get("key")
        if not isinstance(key, str) or not key.strip():
            raise KeyFileError(f"{where}: needs a non-empty 'key' string (quote a key YAML would read as a number)")
        if key != key.strip() or any(c.isspace() for c in key):
            raise KeyFileError(f"{where}: 'key' must not contain white space")
        if key in table:
            raise KeyFileError(f"{where}: duplicate key (also {section}[{list(table).index(key)}])")
        tenant = item.get("tenant", DEFAULT_TENANT)
        if not isinstance(tenant, str) or not tenant:
            raise KeyFileError(f"{where}: 'tenant' must be a non-empty string")
        name = item.get("name", key_fingerprint(key))
        if not isinstance(name, str) or not name:
            raise KeyFileError(f"{where}: 'name' must be a non-empty string")
        admin = item.get("admin", False)
        if not isinstance(admin, bool) and admin != CLUSTER_ADMIN:
            raise KeyFileError(f"{where}: 'admin' must be true or false (unquoted), or {CLUSTER_ADMIN}, got {admin!r}")
        criticality, weight = _share(item, where)
        table[key] = Principal(tenant=tenant, key_id=name, admin=admin is not False,
                               cluster_admin=admin == CLUSTER_ADMIN,
                               rate_limit=_rate_limit(item.get("rate_limit"), where),
                               criticality=criticality, weight=weight)
    return table


def _rate_limit(spec: Any, where: str) -> RateLimit | None:
    if spec is None:
        return None
    usage = "rate_limit must be a mapping {rate: R, burst: B}: R requests per second (> 0), B a whole number >= 1"
    if not isinstance(spec, dict):
        raise KeyFileError(f"{where}: {usage}, got {spec!r}")
    unknown = sorted(str(member) for member in spec if member not in _RATE_MEMBERS)
    if unknown or "rate" not in spec:
        raise KeyFileError(f"{where}: {usage}, got {spec!r}")
    rate = spec["rate"]
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not (rate > 0 and math.isfinite(rate)):
        raise KeyFileError(f"{where}: {usage}; rate {rate!r} is not a positive number")
    # Default burst: one second's worth, at least one request.
    burst = spec.get("burst", max(1, int(rate)))
    if isinstance(burst, bool) or not isinstance(burst, int) or burst < 1:
        raise KeyFileError(f"{where}: {usage}; burst {burst!r} is not a whole number >= 1")
    return RateLimit(rate=float(rate), burst=burst)


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
    problem = weight_problem(weight)
    if problem:
        raise KeyFileError(f"{where}: {problem}")
    return criticality, float(weight)
