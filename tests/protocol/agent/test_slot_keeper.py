"""The slot keeper: slots that hold a conversation are used again, saved contexts restored, the disk bounded."""

import pytest

from protocol.agent.slot_keeper import Plan, Save, SlotKeeper, SlotKeeperUsageError, shared_prompt, worth_saving
from protocol.pb import status_pb2
from protocol.routing.hints import RoutingHints

A, B, C = 0xA, 0xB, 0xC
#: A system prompt that conversations share.
S = 0x5


def run(keeper: SlotKeeper, task: str, key: int) -> Plan:
    plan = keeper.start(task, key)
    assert plan is not None
    return plan


def finish(keeper: SlotKeeper, task: str, ok: bool = True) -> list[Plan]:
    """End ``task`` and its save (if any) at once; the plans that came of it."""
    save, plans = keeper.ended(task, ok)
    if save is not None:
        plans += keeper.save_ended(save.slot, True)
    return plans


def test_a_later_turn_runs_in_the_idle_slot_that_still_holds_its_conversation():
    keeper = SlotKeeper(slots=2, files=4)
    first = run(keeper, "a1", A)
    assert first == Plan("a1", 0, None)
    save, plans = keeper.ended("a1", True)
    assert save == Save(0, "infx-0.bin") and plans == []
    keeper.save_ended(0, True)
    run(keeper, "b1", B)  # the other slot: slot 0 was used more recently
    assert run(keeper, "a2", A) == Plan("a2", 0, None)  # held: nothing to restore
    assert (keeper.held, keeper.restored, keeper.cold) == (1, 0, 2)


def test_a_conversation_pushed_out_of_every_slot_is_restored_from_its_file():
    keeper = SlotKeeper(slots=1, files=4)
    run(keeper, "a1", A)
    finish(keeper, "a1")
    run(keeper, "b1", B)
    finish(keeper, "b1")
    assert run(keeper, "a2", A) == Plan("a2", 0, "infx-0.bin")
    save, _ = keeper.ended("a2", True)
    assert save == Save(0, "infx-0.bin")  # saved again over its own file
    assert keeper.restored == 1


def test_files_are_reused_for_the_conversation_saved_longest_ago():
    keeper = SlotKeeper(slots=1, files=2, prefix="e1-")
    for task, key in (("a", A), ("b", B), ("c", C)):
        run(keeper, task, key)
        save, _ = keeper.ended(task, True)
        keeper.save_ended(save.slot, True)
    assert save.file == "e1-0.bin"  # A's file, A being saved longest ago
    assert keeper.saved == 2
    assert run(keeper, "a2", A).restore is None  # A's context is gone from disk


def test_with_every_slot_busy_tasks_wait_in_order_and_a_slot_frees_only_once_saved():
    keeper = SlotKeeper(slots=1, files=4)
    run(keeper, "a1", A)
    assert keeper.start("b1", B) is None
    assert keeper.start("c1", C) is None
    assert keeper.waiting == 2
    save, plans = keeper.ended("a1", True)
    assert plans == []  # the slot is being saved
    assert keeper.save_ended(save.slot, True) == [Plan("b1", 0, None)]
    keeper.cancel("c1")
    assert finish(keeper, "b1") == []
    assert keeper.waiting == 0


def test_a_failed_task_leaves_its_slot_unknown_and_saves_nothing():
    keeper = SlotKeeper(slots=1, files=4)
    run(keeper, "a1", A)
    save, _ = keeper.ended("a1", False)
    assert save is None
    assert run(keeper, "a2", A) == Plan("a2", 0, None)
    assert keeper.cold == 2  # neither held nor restored


def test_a_failed_save_or_restore_forgets_the_file_and_frees_its_name():
    keeper = SlotKeeper(slots=1, files=1)
    run(keeper, "a1", A)
    save, _ = keeper.ended("a1", True)
    keeper.save_ended(save.slot, False)
    run(keeper, "b1", B)
    finish(keeper, "b1")
    assert run(keeper, "a2", A).restore is None  # A's save failed: no file
    save, _ = keeper.ended("a2", True)
    assert save.file == "infx-0.bin"  # B's, the only name there is
    keeper.save_ended(save.slot, True)
    run(keeper, "c1", C)
    finish(keeper, "c1")
    plan = run(keeper, "a3", A)
    assert plan.restore is None  # C took the one file
    keeper.ended("a3", True)


def test_a_task_without_a_key_runs_but_is_neither_restored_nor_saved():
    keeper = SlotKeeper(slots=1, files=2)
    assert run(keeper, "x", 0) == Plan("x", 0, None)
    save, _ = keeper.ended("x", True)
    assert save is None and keeper.saved == 0


def test_misuse_is_refused():
    keeper = SlotKeeper(slots=1, files=1)
    run(keeper, "a", A)
    with pytest.raises(SlotKeeperUsageError):
        keeper.start("a", A)
    with pytest.raises(SlotKeeperUsageError):
        keeper.save_ended(0, True)
    with pytest.raises(SlotKeeperUsageError):
        SlotKeeper(slots=0, files=1)


def test_a_task_its_caller_says_is_not_worth_a_file_keeps_its_slot_but_is_not_saved():
    keeper = SlotKeeper(slots=1, files=2)
    run(keeper, "a1", A)
    keeper.start("a2", A, save=False)  # waits
    keeper.cancel("a2")
    assert keeper.start("b1", B, save=False) is None
    save, plans = keeper.ended("a1", True)
    keeper.save_ended(save.slot, True)
    assert keeper.ended("b1", True) == (None, [])
    assert run(keeper, "b2", B) == Plan("b2", 0, None)  # held all the same
    assert worth_saving(RoutingHints(blocks=(1, 2, 3, 4, 5), home=0, home_blocks=4))
    assert not worth_saving(RoutingHints(blocks=(1, 2, 3, 4), home=0, home_blocks=4))
    assert shared_prompt(RoutingHints(blocks=(1, 2, 3, 4), home=S, home_blocks=4)) == S
    assert shared_prompt(RoutingHints(blocks=(1, 2), home=S)) == 0  # a home key that is no system prompt


def test_a_restore_never_overwrites_a_shared_prompt_found_nowhere_else():
    """The server does not put a slot's context in its host cache before a restore, as it does before a
    prompt displaces it and for every idle slot when it starts a task: a restore takes a slot that holds
    nothing, a saved conversation, a context the server has cached since, or one no other conversation
    shares; never a burst's system prompt in a slot a one-question conversation just left."""
    keeper = SlotKeeper(slots=2, files=4)
    run(keeper, "a1", A)
    finish(keeper, "a1")  # slot 0 holds A, saved
    run(keeper, "c1", C)
    finish(keeper, "c1")  # slot 1 holds C, saved
    run(keeper, "x1", 0xD)  # slot 0 (used longest ago): A leaves it, with its file
    assert keeper.start("y1", 0xE, save=False, shares=S) == Plan("y1", 1, None)  # C leaves slot 1, with its file
    assert keeper.ended("x1", True)[0] is not None
    keeper.save_ended(0, True)  # slot 0 holds D, saved
    assert keeper.ended("y1", True) == (None, [])  # slot 1 holds E, kept nowhere else
    assert run(keeper, "a2", A) == Plan("a2", 0, "infx-0.bin")  # over D's saved context
    # Starting a2, the server put the idle slot 1's context in its host cache: C may be restored there.
    assert run(keeper, "c2", C) == Plan("c2", 1, "infx-1.bin")
    finish(keeper, "a2")
    assert keeper.ended("c2", True)[0] is not None  # slot 1 saving C
    assert keeper.start("z1", 0xF, save=False, shares=S) == Plan("z1", 0, None)  # E's system prompt again
    keeper.save_ended(1, True)
    assert run(keeper, "c3", C) == Plan("c3", 1, None)  # held
    assert keeper.ended("z1", True) == (None, [])  # slot 0 holds F, kept nowhere else
    # Only slot 0 is idle, no task started since F ended there, and E shared its system prompt lately:
    # A runs there without a restore, and the server keeps F in its host cache as A's prompt displaces it.
    assert keeper.start("a3", A) == Plan("a3", 0, None)
    assert (keeper.restored, keeper.held) == (2, 1)


def test_a_restore_overwrites_a_one_question_conversation_whose_system_prompt_is_its_own():
    keeper = SlotKeeper(slots=1, files=4)
    run(keeper, "a1", A)
    finish(keeper, "a1")
    assert keeper.start("h1", 0xD, save=False, shares=S) == Plan("h1", 0, None)
    assert keeper.ended("h1", True) == (None, [])  # nothing saved, nothing cached, but nobody else's
    assert run(keeper, "a2", A) == Plan("a2", 0, "infx-0.bin")


def test_what_the_keeper_did_is_counted_for_the_engines_status():
    keeper = SlotKeeper(slots=1, files=4)
    run(keeper, "a1", A)
    finish(keeper, "a1")
    run(keeper, "a2", A)  # held
    finish(keeper, "a2")
    run(keeper, "b1", B)  # cold
    save, _ = keeper.ended("b1", True)
    assert save is not None
    keeper.save_ended(save.slot, False)  # a failed save costs B its file
    run(keeper, "b2", B)  # held
    finish(keeper, "b2")  # and saved this time
    run(keeper, "a3", A)  # restored
    keeper.restore_failed(0, "a3")  # and that file is not trusted again
    assert keeper.counts() == status_pb2.EngineStatus.SlotKeeping(held=2, restored=1, cold=2, failed=2, saved=1)
    keeper.ended("a3", True)
    assert keeper.counts().saved == 2
