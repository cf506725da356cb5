"""llama.cpp's slots kept for conversations: the ``openai`` runtime with :mod:`protocol.agent.slot_keeper`.

With ``--runtime-slot-files N`` (``twistd infx-engine``), each chat or completions task runs in
the slot the keeper picks: the request goes to the runtime with ``"id_slot": SLOT`` put first in
its JSON body (the rest of the client's body byte for byte; a body that names its own ``id_slot``
is left alone and runs where the runtime puts it), after ``POST /slots/SLOT?action=restore`` when
the keeper restores the conversation's saved context; after a task the slot is saved with
``POST /slots/SLOT?action=save``. The runtime must be started with ``--slot-save-path`` and be
this agent's alone (another client's requests take slots the keeper thinks it holds: that costs
hits, never answers, since the server reuses only the tokens a prompt shares with what a slot
holds). A runtime that refuses a slot action (no ``--slot-save-path``) turns keeping off, logged
once; tasks then run as without it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable

from twisted.internet.defer import Deferred
from twisted.logger import Logger

from infx.agent.runtime_client import RuntimeFailure
from infx.agent.runtimes import OpenAIRuntime, RunningTask, TaskSink
from protocol.agent.runtime_metrics import total_slots_from_props
from protocol.agent.slot_keeper import Plan, SlotKeeper, shared_prompt, worth_saving
from protocol.pb import status_pb2, worker_pb2
from protocol.routing.hints import hints_from_json

__all__ = ["SlotKeepingRuntime"]

log = Logger(namespace="infx.slot_keeping")

#: The endpoints whose prompts a slot keeps, by the path the runtime is asked at.
_KEPT_PATHS = {"/v1/chat/completions": "chat/completions", "/v1/completions": "completions"}
_JSON_FIELDS = b"Content-Type: application/json\r\n"
#: What llama.cpp's server allows in a slot file's name.
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")


class _Call:
    """A side request's answer (``/props``, a slot action): status and body, or status 0 and why not."""

    def __init__(self) -> None:
        self.done: Deferred[tuple[int, bytes]] = Deferred()
        self.status = 0
        self.body: list[bytes] = []

    def response_started(self, status: int, reason: bytes, fields: list[tuple[bytes, bytes]]) -> None:
        self.status = status

    def body_received(self, data: bytes) -> None:
        self.body.append(data)

    def response_ended(self, framed: bool) -> None:
        self.done.callback((self.status, b"".join(self.body)))

    def response_broken(self, detail: str) -> None:
        self.done.callback((0, detail.encode("utf-8", "replace")))

    def request_failed(self, failure: RuntimeFailure, detail: str) -> None:
        self.done.callback((0, detail.encode("utf-8", "replace")))


class SlotKeepingRuntime:
    """``runtime`` (the ``openai`` runtime of a llama.cpp server) with its slots kept in ``files``
    files named after ``engine_id``; ``slots``: the server's slots if known (else read from ``/props``)."""

    def __init__(self, runtime: OpenAIRuntime, files: int, engine_id: str, slots: int | None = None) -> None:
        self.runtime = runtime
        self.files = files
        self.prefix = "infx-" + _UNSAFE.sub("_", engine_id) + "-"
        self.keeper: SlotKeeper | None = SlotKeeper(slots, files, self.prefix) if slots else None
        #: Set once the runtime refused a slot action or its slots could not be learnt: tasks run as they come.
        self.off = False
        self._sizing: Deferred[None] | None = None
        self._placed: dict[str, _KeptTask] = {}
        #: Told the keeper's counts whenever they may have changed (the agent's status carries them).
        self.report: Callable[[status_pb2.EngineStatus.SlotKeeping], None] = lambda counts: None

    def start(self, task: worker_pb2.Task, sink: TaskSink) -> RunningTask:
        return _KeptTask(self, task, sink)

    def changed(self) -> None:
        """Report what the keeper did so far, and whether keeping is off."""
        counts = self.keeper.counts() if self.keeper is not None else status_pb2.EngineStatus.SlotKeeping()
        counts.off = self.off
        self.report(counts)

    # -- what tasks ask of it ------------------------------------------------------------------

    def call(self, method: bytes, path: bytes, body: bytes = b"") -> Deferred[tuple[int, bytes]]:
        handler = _Call()
        runtime = self.runtime
        fields = _JSON_FIELDS
        key = runtime.key()
        if key is not None:
            fields += b"Authorization: Bearer " + key.encode("latin-1") + b"\r\n"
        runtime.client.request(method, runtime.path_prefix + path, fields, body, handler)
        return handler.done

    def when_sized(self) -> Deferred[None]:
        """Fires once the keeper exists (the runtime's slots read from ``/props``) or keeping is off."""
        if self._sizing is None:
            self._sizing = Deferred()
            self.call(b"GET", b"/props").addCallback(self._sized)
        waiting: Deferred[None] = Deferred()
        self._sizing.addCallback(lambda _: waiting.callback(None))
        return waiting

    def _sized(self, answer: tuple[int, bytes]) -> None:
        status, body = answer
        slots = total_slots_from_props(body) if status == 200 else None
        sizing, self._sizing = self._sizing, None
        if slots:
            self.keeper = SlotKeeper(slots, self.files, self.prefix)
            log.info("keeping the {slots} slots of the runtime at {url} in up to {files} files",
                     slots=slots, url=self.runtime.root, files=self.files, event="slots_kept")
        elif status == 200 or 400 <= status < 500:
            # Not llama.cpp's server (or one too old to say): there is nothing to keep.
            self.off = True
            log.warn("the runtime at {url} does not say its slots (GET /props: {status}); slots are not kept",
                     url=self.runtime.root, status=status, event="slot_keeping_off")
        else:
            # A server not up yet (503 while it loads, or unreachable): the next task asks again.
            log.warn("the runtime at {url} did not say its slots (GET /props: {status}): tasks run unkept for now",
                     url=self.runtime.root, status=status or body.decode("utf-8", "replace"), event="slots_unknown")
        self.changed()
        if sizing is not None:
            sizing.callback(None)

    def failed(self, action: str, slot: int, status: int, body: bytes) -> None:
        """A slot action failed: a refusal (4xx, 501: no ``--slot-save-path``) turns keeping off; anything
        else costs that conversation its file (the keeper forgets it) and is logged."""
        if 400 <= status < 500 or status == 501:
            self.refused(status, body)
        else:
            log.info("the runtime at {url} failed to {action} slot {slot} ({status}: {body})", url=self.runtime.root,
                     action=action, slot=slot, status=status, body=body[:200].decode("utf-8", "replace"),
                     event="slot_action_failed")

    def refused(self, status: int, body: bytes) -> None:
        if not self.off:
            self.off = True
            log.warn("the runtime at {url} refused a slot action ({status}: {body}); slots are no longer kept "
                     "(is it started with --slot-save-path?)", url=self.runtime.root, status=status,
                     body=body[:200].decode("utf-8", "replace"), event="slot_keeping_off")
            self.changed()

    def run_plans(self, plans: list[Plan]) -> None:
        """Run the waiting tasks the keeper placed after a task or a save ended, and report its counts."""
        self.changed()
        for plan in plans:
            kept = self._placed.pop(plan.task, None)
            if kept is not None:
                kept.run(plan)

    def wait_for_slot(self, kept: _KeptTask) -> None:
        self._placed[kept.task_id] = kept

    def forget(self, kept: _KeptTask) -> None:
        self._placed.pop(kept.task_id, None)


class _KeptTask:
    """One task: placed by the keeper, its context restored, run in its slot, the slot saved after."""

    def __init__(self, runtime: SlotKeepingRuntime, task: worker_pb2.Task, sink: TaskSink) -> None:
        self.runtime = runtime
        self.task = task
        self.task_id = task.id
        self.sink = sink
        self.key = 0
        self.save = False
        self.shares = 0
        #: "new", "waiting" (for the keeper's slots, or for them to be learnt), "restoring", "running", "done".
        self.state = "new"
        self.slot = -1
        self.ok = False
        self.inner: RunningTask | None = None
        endpoint, body = self._kept_request(task)
        if endpoint is None or runtime.off:
            self._pass_through()
            return
        hints = hints_from_json(endpoint, body, {})
        if hints is not None:
            self.key = hints.opening
            self.save = worth_saving(hints)
            self.shares = shared_prompt(hints)
        if runtime.keeper is None:
            self.state = "waiting"
            runtime.when_sized().addCallback(lambda _: self._place())
        else:
            self._place()

    @staticmethod
    def _kept_request(task: worker_pb2.Task) -> tuple[str | None, bytes]:
        """The endpoint of a request whose slot may be kept, and its body (None: not such a request)."""
        if not task.request.HasField("http_request"):
            return None, b""
        http = task.request.http_request
        endpoint = _KEPT_PATHS.get(http.path)
        body = bytes(http.body)
        if endpoint is None or (http.method or "POST") != "POST" or not body.lstrip().startswith(b"{") \
                or b'"id_slot"' in body:
            return None, b""
        return endpoint, body

    def _pass_through(self) -> None:
        self.state = "running"
        self.inner = self.runtime.runtime.start(self.task, self.sink)

    def _place(self) -> None:
        if self.state == "done":
            return
        runtime = self.runtime
        if runtime.keeper is None or runtime.off:
            self._pass_through()
            return
        plan = runtime.keeper.start(self.task_id, self.key, self.save, self.shares)
        runtime.changed()
        if plan is None:
            self.state = "waiting"
            runtime.wait_for_slot(self)
        else:
            self.run(plan)

    def run(self, plan: Plan) -> None:
        self.slot = plan.slot
        if self.state == "done":  # aborted while it waited: the slot it got is free again
            self._release(False)
            return
        if plan.restore is None:
            self._send()
            return
        self.state = "restoring"
        body = json.dumps({"filename": plan.restore}).encode()
        self.runtime.call(b"POST", b"/slots/%d?action=restore" % plan.slot, body).addCallback(self._restored)

    def _restored(self, answer: tuple[int, bytes]) -> None:
        status, body = answer
        keeper = self.runtime.keeper
        if status != 200 and keeper is not None:
            keeper.restore_failed(self.slot, self.task_id)
            self.runtime.failed("restore", self.slot, status, body)
            self.runtime.changed()
        if self.state == "done":
            self._release(False)
        else:
            self._send()

    def _send(self) -> None:
        self.state = "running"
        kept = worker_pb2.Task()
        kept.CopyFrom(self.task)
        http = kept.request.http_request
        head, _, rest = bytes(http.body).partition(b"{")
        # The slot is named first; the client's own fields follow unchanged.
        http.body = head + b'{"id_slot":%d%s' % (self.slot, b"" if rest.lstrip().startswith(b"}") else b",") + rest
        self.inner = self.runtime.runtime.start(kept, _Watch(self))

    def ended(self) -> None:
        """The runtime's answer is over (the inner task finished its sink)."""
        if self.state == "running" and self.slot >= 0:
            self._release(self.ok)
        self.state = "done"

    def _release(self, ok: bool) -> None:
        keeper = self.runtime.keeper
        if keeper is None or self.slot < 0:
            return
        slot, self.slot = self.slot, -1
        save, plans = keeper.ended(self.task_id, ok)
        if save is not None:
            body = json.dumps({"filename": save.file}).encode()
            self.runtime.call(b"POST", b"/slots/%d?action=save" % slot, body).addCallback(self._saved, keeper, slot)
        self.runtime.run_plans(plans)

    def _saved(self, answer: tuple[int, bytes], keeper: SlotKeeper, slot: int) -> None:
        status, body = answer
        if status != 200:
            self.runtime.failed("save", slot, status, body)
        self.runtime.run_plans(keeper.save_ended(slot, status == 200))

    # -- RunningTask

    def abort(self) -> None:
        state, self.state = self.state, "done"
        if state == "waiting":
            self.runtime.forget(self)
            if self.runtime.keeper is not None:
                self.runtime.keeper.cancel(self.task_id)
        elif state == "running":
            if self.inner is not None:
                self.inner.abort()
            self._release(False)
        # "restoring": the slot is released when the restore's answer comes


class _Watch:
    """The inner task's sink: results pass on; the answer's status says whether the slot holds the prompt."""

    def __init__(self, kept: _KeptTask) -> None:
        self.kept = kept
        self.sink = kept.sink

    def send(self, result: worker_pb2.TaskResult) -> None:
        if result.WhichOneof("message") == "http_response":
            self.kept.ok = 200 <= result.http_response.status_code < 300
        self.sink.send(result)

    def event(self, data: bytes) -> None:
        self.sink.event(data)

    def when_writable(self) -> Deferred[None] | None:
        return self.sink.when_writable()

    def finish(self) -> None:
        self.sink.finish()
        self.kept.ended()
