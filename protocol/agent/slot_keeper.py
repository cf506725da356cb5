"""The runtime's slots kept for conversations: which slot a task runs in, what is saved and restored; pure.

llama.cpp's server keeps a conversation's context in the slot that served it and a few more in
its host cache (``--cache-ram``); with more conversations open than those hold, a later turn is
computed again whole, wherever a router sends it (docs/routing-real.md, part 5). Started with
``--slot-save-path``, the server also saves a slot's context to a file and restores it into any
idle slot (``POST /slots/{id}?action=save|restore``): 2,470 tokens of the bench model took 12 ms
to save and 8 ms to restore, against 2.8 s to compute (part 6). The keeper makes the agent use
that, as the runtime's one client:

- every task runs in a slot the agent names (``id_slot``): an idle slot that holds the task's
  conversation, else the idle slot used longest ago, into which the conversation's saved context
  is restored first when there is one; with every slot busy, tasks wait here in arrival order;
- a restore overwrites a slot's context without putting it in the server's host cache (a prompt
  that displaces it does, and every task the server starts caches the idle slots), so it goes only
  to a slot whose context is found elsewhere or worth little: none, a saved conversation's, one
  cached since it ended, or one whose system prompt no other conversation placed lately shares;
  with no such slot idle, the task runs without (the server keeps the slot's context in its host
  cache and looks there for the task's prompt), so a burst of one-question conversations keeps
  its shared system prompt;
- a task that ended well leaves its slot holding its conversation, and the slot is saved under
  the conversation's key before it takes another task, unless the caller said its prompt is not
  worth a file (:func:`worth_saving`); a failed one leaves the slot unknown;
- at most ``files`` contexts are kept on disk: files are named ``PREFIX0.bin`` ... and reused
  for the conversation saved longest ago, so the disk never holds more.

A conversation's key is a 64-bit hash of its opening (:attr:`protocol.routing.hints.RoutingHints.opening`),
which every turn repeats; 0 means none (the task runs in an idle slot, nothing is restored or saved).

Rules this file keeps: no I/O, no clock; the caller performs each :class:`Plan` and :class:`Save`
and reports how a task and a save ended, in any order the runtime's answers come.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

from protocol.errors import LocalUsageError
from protocol.pb import status_pb2
from protocol.routing.hints import RoutingHints

__all__ = ["Plan", "Save", "SlotKeeper", "SlotKeeperUsageError", "shared_prompt", "worth_saving"]

#: How many of the tasks placed last tell which system prompts other conversations share.
_RECENT = 16


def worth_saving(hints: RoutingHints) -> bool:
    """Whether a prompt leaves a context worth a file: at least one prefix block of its own past the
    system prompt it shares with other conversations (``hints.home_blocks``). A shared prompt the
    server's host cache keeps anyway; saving a one-question conversation (a burst of them) costs the
    server a save per request and pushes out the files of conversations that have more."""
    return len(hints.blocks) - hints.home_blocks >= 1


def shared_prompt(hints: RoutingHints) -> int:
    """The key of the system prompt a prompt shares with other conversations (0: none)."""
    return hints.home if hints.home_blocks else 0


class SlotKeeperUsageError(LocalUsageError):
    """The caller broke the keeper's protocol (a task started twice, a save reported for an unsaved slot)."""


@dataclass(frozen=True)
class Plan:
    """Run ``task`` in ``slot``, restoring the file ``restore`` into it first (None: nothing to restore)."""

    task: str
    slot: int
    restore: str | None


@dataclass(frozen=True)
class Save:
    """Save ``slot`` to the file ``file``; the slot takes no task until :meth:`SlotKeeper.save_ended`."""

    slot: int
    file: str


class _RuntimeSlot:
    __slots__ = ("task", "holds", "shares", "cached", "saving", "used")

    def __init__(self) -> None:
        #: The task running here ("" for none).
        self.task = ""
        #: The conversation whose context the slot holds (0: none known).
        self.holds = 0
        #: The key of the system prompt that context shares with other conversations (0: none).
        self.shares = 0
        #: Whether the server has put that context in its host cache (it does with each task it starts).
        self.cached = False
        #: The key being saved from here (0: no save running).
        self.saving = 0
        #: When it last took a task, in tasks started (the least recently used idle slot goes first).
        self.used = 0

    @property
    def idle(self) -> bool:
        return not self.task and not self.saving


class SlotKeeper:
    """The slots of one runtime (``slots``, its ``total_slots``) and up to ``files`` saved contexts."""

    def __init__(self, slots: int, files: int, prefix: str = "infx-") -> None:
        if slots < 1 or files < 1:
            raise SlotKeeperUsageError("a slot keeper needs at least one slot and one file")
        self._slots = [_RuntimeSlot() for _ in range(slots)]
        self._files_max = files
        self._prefix = prefix
        #: The file each saved conversation is in, the one saved longest ago first.
        self._files: OrderedDict[int, str] = OrderedDict()
        #: File names made so far (a name is made once, then reused), and those no conversation holds.
        self._named = 0
        self._free: list[str] = []
        #: Tasks waiting for a slot: each with its key, whether its slot is saved when it ends, and the
        #: key of the system prompt it shares.
        self._waiting: deque[tuple[str, int, bool, int]] = deque()
        #: The system prompt and conversation of the tasks placed last (which shared prompts are in use).
        self._recent: deque[tuple[int, int]] = deque(maxlen=_RECENT)
        #: Each running task's slot, key and whether its slot is saved when it ends.
        self._running: dict[str, tuple[int, int, bool]] = {}
        self._started = 0
        #: Tasks that found their conversation in a slot, restored it, or neither (its first turn).
        self.held = 0
        self.restored = 0
        self.cold = 0
        #: Saves and restores that failed.
        self.failed = 0

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def saved(self) -> int:
        """Conversations with a saved context."""
        return len(self._files)

    def counts(self) -> status_pb2.EngineStatus.SlotKeeping:
        """What the keeper did so far, as the engine's status reports it to operators."""
        return status_pb2.EngineStatus.SlotKeeping(held=self.held, restored=self.restored, cold=self.cold,
                                                   failed=self.failed, saved=self.saved)

    def start(self, task: str, key: int, save: bool = True, shares: int = 0) -> Plan | None:
        """``task`` of conversation ``key`` wants a slot: its plan, or None while every slot is busy
        (its plan comes from :meth:`ended` or :meth:`save_ended` once one frees); ``save``: its slot
        is saved when it ends well; ``shares``: the key of the system prompt it shares with other
        conversations (:func:`shared_prompt`)."""
        if task in self._running or any(entry[0] == task for entry in self._waiting):
            raise SlotKeeperUsageError(f"task {task!r} asked for a slot twice")
        if self._waiting or not any(slot.idle for slot in self._slots):
            self._waiting.append((task, key, save, shares))
            return None
        return self._place(task, key, save, shares)

    def cancel(self, task: str) -> None:
        """A task that waits for a slot is gone (its client left)."""
        self._waiting = deque(entry for entry in self._waiting if entry[0] != task)

    def ended(self, task: str, ok: bool) -> tuple[Save | None, list[Plan]]:
        """``task`` is done with its slot: ``ok``, its answer ended as the runtime meant (the slot holds
        its conversation), else it failed or was cut off (the slot's context is unknown). Returns the
        save to make, if any, and the plans of waiting tasks that can run now."""
        slot_id, key, saving = self._running.pop(task)
        slot = self._slots[slot_id]
        slot.task = ""
        slot.holds = key if ok else 0
        slot.shares = slot.shares if ok else 0
        slot.cached = False
        save = None
        if ok and key and saving:
            slot.saving = key
            save = Save(slot_id, self._file_for(key))
        return save, self._place_waiting()

    def save_ended(self, slot_id: int, ok: bool) -> list[Plan]:
        """The save from ``slot_id`` ended; if it failed, its conversation has no file any more."""
        slot = self._slots[slot_id]
        if not slot.saving:
            raise SlotKeeperUsageError(f"slot {slot_id} was not being saved")
        if not ok:
            self.failed += 1
            self._drop(slot.saving)
        slot.saving = 0
        return self._place_waiting()

    def restore_failed(self, slot_id: int, task: str) -> None:
        """The restore before ``task`` failed: its file is not trusted again, and the slot holds
        whatever the task leaves in it (the task runs all the same and computes its prompt)."""
        self.failed += 1
        self._drop(self._running[task][1])

    # -- choices ---------------------------------------------------------------------------

    def _place(self, task: str, key: int, save: bool, shares: int) -> Plan:
        idle = [i for i, slot in enumerate(self._slots) if slot.idle]
        holding = [i for i in idle if key and self._slots[i].holds == key]
        restore = None
        if holding:
            slot_id = holding[0]
            self.held += 1
        else:
            restore = self._files.get(key) if key else None
            spare = [i for i in idle if self._found_elsewhere(self._slots[i])]
            if restore is not None and spare:
                idle = spare
                self._files.move_to_end(key)
                self.restored += 1
            else:
                restore = None
                self.cold += 1
            slot_id = min(idle, key=lambda i: self._slots[i].used)
        slot = self._slots[slot_id]
        self._started += 1
        slot.task, slot.used, slot.shares = task, self._started, shares
        self._recent.append((shares, key))
        for other in self._slots:  # the server caches its idle slots as it starts a task
            other.cached = other.cached or other.idle
        self._running[task] = (slot_id, key, save)
        return Plan(task, slot_id, restore)

    def _found_elsewhere(self, slot: _RuntimeSlot) -> bool:
        """Whether a restore may overwrite the slot's context: it is none, in a file, in the host cache, or
        a conversation's own (no system prompt that other conversations placed lately share)."""
        return not slot.holds or slot.cached or slot.holds in self._files or not slot.shares \
            or not any(shares == slot.shares and key != slot.holds for shares, key in self._recent)

    def _place_waiting(self) -> list[Plan]:
        plans = []
        while self._waiting and any(slot.idle for slot in self._slots):
            task, key, save, shares = self._waiting.popleft()
            plans.append(self._place(task, key, save, shares))
        return plans

    def _file_for(self, key: int) -> str:
        """The file ``key`` is saved to: its own, a new one, or the one saved longest ago."""
        name = self._files.pop(key, None)
        if name is None:
            if self._free:
                name = self._free.pop()
            elif self._named < self._files_max:
                name = f"{self._prefix}{self._named}.bin"
                self._named += 1
            else:
                _, name = self._files.popitem(last=False)
        self._files[key] = name
        return name

    def _drop(self, key: int) -> None:
        name = self._files.pop(key, None)
        if name is not None:
            self._free.append(name)
