"""The operator's side of the HTTP port: ``/admin/status``, its live form ``/admin/events``, and the page.

- ``GET /admin/status`` answers the cluster as this gateway sees it
  (:mod:`infx.gateway.cluster_status`, every field in ``docs/admin.md``);
  ``?request=ID`` adds the search for one request's route.
- ``GET /admin/events`` is the same document as server-sent events: one
  ``status`` event at once, then one a second, while the client reads
  (a client that stops reading gets no more until it reads again, so a
  stalled page holds no growing buffer here); its key is checked again before
  every event, so a key removed from the key file ends the stream.
- ``GET /admin/`` is the page (one HTML, one script, one style sheet, served
  from the package: nothing is loaded from elsewhere). It holds no data and
  needs no key; it reads ``status`` and ``events`` with the admin key as a
  bearer header, which the operator types once and the browser keeps in
  ``sessionStorage`` (never in a URL).

Both data endpoints take an admin key when auth is on (401 without a known
key, 403 for a key without ``admin``) and show a tenant's admin its tenant
alone; ``admin: cluster`` sees every tenant.
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

from twisted.internet import task
from twisted.internet.interfaces import IPushProducer
from twisted.web import resource, server
from zope.interface import implementer

__all__ = ["EVENT_INTERVAL", "AdminTree"]

#: Seconds between two status events on ``/admin/events``.
EVENT_INTERVAL = 1.0
#: What the page's files may do: load what this gateway serves, nothing else.
CONTENT_SECURITY_POLICY = (b"default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                           b"img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
_PAGE_FILES = {b"": ("index.html", b"text/html; charset=utf-8"),
               b"admin.js": ("admin.js", b"text/javascript; charset=utf-8"),
               b"admin.css": ("admin.css", b"text/css; charset=utf-8")}


def _header(request: server.Request, name: bytes) -> str | None:
    value = request.getHeader(name)
    if value is None:
        return None
    return value.decode("latin-1") if isinstance(value, bytes) else value


class _AdminResource(resource.Resource):
    """A leaf of /admin that takes GET (and HEAD); any other method is a JSON 405."""

    isLeaf = True
    endpoint = "admin"

    def __init__(self, gateway: Any) -> None:
        super().__init__()
        self.gateway = gateway

    def render(self, request: server.Request) -> Any:
        if request.method not in (b"GET", b"HEAD"):
            request.setHeader(b"allow", b"GET, HEAD")
            return self.gateway.refuse(request, self.endpoint, 405, "Invalid method for URL; it takes GET, HEAD.",
                                       code="method_not_allowed")
        return self.render_GET(request)

    def render_GET(self, request: server.Request) -> Any:
        raise NotImplementedError

    def principal(self, request: server.Request) -> tuple[Any, bytes | None]:
        """The admin calling, or None and the refusal to answer (401: no known key, 403: not an admin)."""
        principal = self.gateway.keys.client(_header(request, b"authorization"))
        if principal is None or not principal.admin:
            status = 401 if principal is None else 403
            return None, self.gateway.refuse(
                request, self.endpoint, status, "An admin API key is required.",
                code="invalid_api_key" if principal is None else "admin_key_required",
                tenant=principal.tenant if principal is not None else "")
        return principal, None

    def document(self, principal: Any, request_id: str | None = None) -> dict[str, Any]:
        # A tenant's admin sees its tenant; the cluster (every tenant) takes a key with admin: cluster.
        scope = None if principal.cluster_admin else principal.tenant
        builder = self.gateway.cluster_status
        if builder is None:
            return dict(self.gateway.runner.status(scope))
        return dict(builder.status(scope, request_id))


class AdminStatus(_AdminResource):
    """``/admin/status``: the document as JSON; ``?request=ID`` adds that request's search."""

    endpoint = "admin/status"

    def render_GET(self, request: server.Request) -> bytes:
        principal, refusal = self.principal(request)
        if refusal is not None:
            return refusal
        asked = request.args.get(b"request")
        request_id = asked[0].decode("utf-8", "replace") if asked else None
        request.setHeader("content-type", "application/json")
        request.setHeader("cache-control", "no-store")
        return json.dumps(self.document(principal, request_id), sort_keys=True, default=str).encode()


@implementer(IPushProducer)
class _EventStream:
    """One client's ``/admin/events``: a status event at once and every ``EVENT_INTERVAL`` while it reads."""

    def __init__(self, owner: AdminEvents, request: server.Request, principal: Any) -> None:
        self.owner = owner
        self.request = request
        self.principal = principal
        self.authorization = _header(request, b"authorization")
        self.paused = False
        self.loop = task.LoopingCall(self.tick)
        self.loop.clock = owner.gateway.clock
        request.registerProducer(self, True)
        request.notifyFinish().addBoth(self.stop)

    def start(self) -> None:
        self.loop.start(EVENT_INTERVAL, now=True)

    def tick(self) -> None:
        gateway = self.owner.gateway
        if gateway.keys.client(self.authorization) != self.principal or gateway.shutting_down:
            self.end()  # the key was removed or changed in the key file, or the gateway stops
            return
        if self.paused:
            return  # the client is behind: it gets the state of the moment it reads again
        self.request.write(self.owner.event(self.principal))

    def end(self) -> None:
        self.stop(None)
        if not self.request.finished and not self.request._disconnected:
            self.request.unregisterProducer()
            self.request.finish()

    def stop(self, _: object) -> None:
        if self.loop.running:
            self.loop.stop()
        self.owner.streams.discard(self)

    # IPushProducer
    def pauseProducing(self) -> None:
        self.paused = True

    def resumeProducing(self) -> None:
        self.paused = False

    def stopProducing(self) -> None:
        self.stop(None)


class AdminEvents(_AdminResource):
    """``/admin/events``: the status document as server-sent events (see the module docstring)."""

    endpoint = "admin/events"

    def __init__(self, gateway: Any) -> None:
        super().__init__(gateway)
        self.streams: set[_EventStream] = set()
        # The last event made for each scope (a tenant, or None: the cluster), and when: streams of one
        # scope ticking within the same half second share it (the document costs milliseconds per
        # hundred engines, see tools/bench/admin_status_bench.py).
        self._made: dict[str | None, tuple[float, bytes]] = {}

    def event(self, principal: Any) -> bytes:
        """A ``status`` event for ``principal``'s scope."""
        scope = None if principal.cluster_admin else principal.tenant
        now = self.gateway.clock.seconds()
        made = self._made.get(scope)
        if made is None or now - made[0] >= EVENT_INTERVAL / 2:
            data = json.dumps(self.document(principal), sort_keys=True, default=str).encode()
            made = self._made[scope] = (now, b"event: status\ndata: " + data + b"\n\n")
        return made[1]

    def render_GET(self, request: server.Request) -> Any:
        principal, refusal = self.principal(request)
        if refusal is not None:
            return refusal
        request.setHeader("content-type", "text/event-stream")
        request.setHeader("cache-control", "no-store")
        request.setHeader("x-accel-buffering", "no")
        if request.method == b"HEAD":
            return b""
        request.write(b"retry: 2000\n\n")
        stream = _EventStream(self, request, principal)
        self.streams.add(stream)
        stream.start()
        return server.NOT_DONE_YET


class PageFile(_AdminResource):
    """One file of the page, from the package, with a policy that lets it load nothing from elsewhere."""

    def __init__(self, gateway: Any, name: str, content_type: bytes) -> None:
        super().__init__(gateway)
        self.body = resources.files("infx.http").joinpath("admin_page").joinpath(name).read_bytes()
        self.content_type = content_type

    def render_GET(self, request: server.Request) -> bytes:
        request.setHeader(b"content-type", self.content_type)
        request.setHeader(b"content-security-policy", CONTENT_SECURITY_POLICY)
        request.setHeader(b"x-content-type-options", b"nosniff")
        request.setHeader(b"referrer-policy", b"no-referrer")
        request.setHeader(b"cache-control", b"no-cache")
        return self.body


class AdminTree(resource.Resource):
    """``/admin``: redirects to ``/admin/`` (the page, whose files name their neighbours relatively);
    its children are the page's files, ``status`` and ``events``; any other is an OpenAI-style 404."""

    endpoint = "admin"

    def __init__(self, gateway: Any) -> None:
        super().__init__()
        self.gateway = gateway
        for path, (name, content_type) in _PAGE_FILES.items():
            self.putChild(path, PageFile(gateway, name, content_type))
        self.putChild(b"status", AdminStatus(gateway))
        self.events = AdminEvents(gateway)
        self.putChild(b"events", self.events)

    def getChild(self, path: bytes, request: server.Request) -> resource.Resource:
        return _Unknown(self.gateway)

    def render(self, request: server.Request) -> bytes:
        if request.method not in (b"GET", b"HEAD"):
            return _Unknown(self.gateway).render(request)
        request.redirect(b"admin/")
        return b""


class _Unknown(resource.Resource):
    isLeaf = True

    def __init__(self, gateway: Any) -> None:
        super().__init__()
        self.gateway = gateway

    def render(self, request: server.Request) -> bytes:
        path = request.path.decode("latin-1")[:200]
        return self.gateway.refuse(request, "unknown", 404, f"Unknown path {path}.", code="unknown_url")
