"""The API key file is read again when it changes: revoked keys stop working at the next check.

Time is a ``task.Clock``; the file is a real file (rewritten in place, or
swapped the way a Kubernetes Secret mount swaps its ``..data`` symlink).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from twisted.internet.task import Clock
from twisted.logger import globalLogPublisher

from infx.gateway.auth import KeyFileError
from infx.gateway.key_reload import CHECK_INTERVAL, KeyFileReload, watched_key_store

ALICE_AND_BOB = "keys:\n  - {key: sk-alice, tenant: a}\n  - {key: sk-bob, tenant: b}\n"
BOB_ONLY = "keys:\n  - {key: sk-bob, tenant: b}\n"


@pytest.fixture
def warnings():
    seen: list[str] = []

    def observe(event):
        if event.get("log_level") is not None and event["log_level"].name == "warn":
            seen.append(event["log_format"].format(**event))

    globalLogPublisher.addObserver(observe)
    yield seen
    globalLogPublisher.removeObserver(observe)


def rewrite(path: Path, text: str) -> None:
    path.write_text(text)
    # Rewritten within the same clock tick on a coarse-mtime file system: the size still differs
    # in these tests, but make the mtime differ too, as it would a moment later.
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))


def start(path: Path):
    clock = Clock()
    store, reload = watched_key_store(clock, str(path))
    reload.startService()
    return clock, store, reload


def test_a_removed_key_stops_working_at_the_next_check(tmp_path):
    path = tmp_path / "keys.yaml"
    path.write_text(ALICE_AND_BOB)
    clock, store, reload = start(path)
    assert store.client("Bearer sk-alice").tenant == "a"
    rewrite(path, BOB_ONLY)
    clock.advance(CHECK_INTERVAL - 0.1)
    assert store.client("Bearer sk-alice") is not None  # not checked yet
    clock.advance(0.1)
    assert store.client("Bearer sk-alice") is None
    assert store.client("Bearer sk-bob").tenant == "b"
    reload.stopService()


def test_a_kubernetes_secret_update_swapping_the_data_symlink_is_seen(tmp_path):
    """kubelet writes ``..2026_12_01_a/keys.yaml``, points ``..data`` at it, ``keys.yaml -> ..data/keys.yaml``."""
    mount = tmp_path / "secret"
    mount.mkdir()
    first, second = mount / "..2026_12_01_a", mount / "..2026_12_01_b"
    first.mkdir()
    second.mkdir()
    (first / "keys.yaml").write_text(ALICE_AND_BOB)
    (mount / "..data").symlink_to(first.name)
    (mount / "keys.yaml").symlink_to("..data/keys.yaml")
    clock, store, _ = start(mount / "keys.yaml")
    # Same size and, possibly, the same mtime as the old file: only the inode tells them apart.
    (second / "keys.yaml").write_text(ALICE_AND_BOB.replace("sk-alice", "sk-carol"))
    (mount / "..data_tmp").symlink_to(second.name)
    os.replace(mount / "..data_tmp", mount / "..data")
    clock.advance(CHECK_INTERVAL)
    assert store.client("Bearer sk-alice") is None
    assert store.client("Bearer sk-carol").tenant == "a"


def test_a_changed_file_that_does_not_load_keeps_the_keys_and_is_logged_once(tmp_path, warnings):
    path = tmp_path / "keys.yaml"
    path.write_text(ALICE_AND_BOB)
    clock, store, _ = start(path)
    rewrite(path, "keys:\n  - {key: sk-bob, tenat: b}\n")
    for _ in range(5):
        clock.advance(CHECK_INTERVAL)
    assert store.client("Bearer sk-alice").tenant == "a"
    assert len(warnings) == 1 and "unknown member 'tenat'" in warnings[0] and "keeping the current keys" in warnings[0]
    rewrite(path, "keys:\n  - {key: sk-bob, admin: 'yes'}\n")  # another bad version: logged too
    clock.advance(CHECK_INTERVAL)
    assert len(warnings) == 2 and "'admin' must be true or false" in warnings[1]
    rewrite(path, BOB_ONLY)
    clock.advance(CHECK_INTERVAL)
    assert store.client("Bearer sk-alice") is None and store.client("Bearer sk-bob") is not None
    assert len(warnings) == 2


def test_a_missing_file_keeps_the_keys_until_it_is_back(tmp_path, warnings):
    path = tmp_path / "keys.yaml"
    path.write_text(ALICE_AND_BOB)
    clock, store, _ = start(path)
    path.unlink()
    clock.advance(CHECK_INTERVAL)
    clock.advance(CHECK_INTERVAL)
    assert store.client("Bearer sk-alice") is not None
    assert len(warnings) == 1 and "missing" in warnings[0]
    path.write_text(BOB_ONLY)
    clock.advance(CHECK_INTERVAL)
    assert store.client("Bearer sk-alice") is None


def test_an_unchanged_file_is_not_read_again(tmp_path):
    path = tmp_path / "keys.yaml"
    path.write_text(ALICE_AND_BOB)
    clock, store, reload = start(path)
    reads = []
    original = reload.store.replace
    reload.store.replace = lambda tables: (reads.append(tables), original(tables))  # type: ignore[method-assign]
    for _ in range(10):
        clock.advance(CHECK_INTERVAL)
    assert reads == []


def test_a_bad_file_at_start_is_an_error_and_reloading_needs_a_file(tmp_path):
    path = tmp_path / "keys.yaml"
    path.write_text("keys:\n  - {key: sk-a, rate_limit: 5}\n")
    with pytest.raises(KeyFileError, match="rate_limit must be a mapping"):
        watched_key_store(Clock(), str(path))
    from infx.gateway.auth import KeyStore

    with pytest.raises(ValueError):
        KeyFileReload(Clock(), KeyStore.disabled(), None)


@pytest.mark.slow
@pytest.mark.e2e
def test_a_running_gateway_stops_accepting_a_removed_key(tmp_path):
    """A real ``twistd infx``: the key works, is removed from the file, and is refused seconds later."""
    from harness.twistd_processes import Gateway, http_get, wait_until

    path = tmp_path / "keys.yaml"
    path.write_text(ALICE_AND_BOB)
    gateway = Gateway(tmp_path, api_keys=path)
    try:
        def models(key: str) -> int:
            return http_get(gateway.url + "/v1/models", {"Authorization": f"Bearer {key}"})[0]

        assert models("sk-alice") == 200
        rewrite(path, BOB_ONLY)
        wait_until(lambda: models("sk-alice") == 401, "the removed key to be refused", [gateway.child])
        assert models("sk-bob") == 200
        assert "API keys: loaded 1 client and 0 engine key(s)" in gateway.child.output()
    finally:
        gateway.stop()


@pytest.mark.e2e
def test_an_engine_whose_key_is_removed_loses_its_stream_and_cannot_dial_again(tmp_path):
    from harness.twistd_processes import Engine, Gateway, wait_until

    path = tmp_path / "keys.yaml"
    with_engine = "keys:\n  - {key: sk-admin, admin: cluster}\nengine_keys:\n  - {key: ek-a, tenant: a}\n"
    path.write_text(with_engine)
    gateway = Gateway(tmp_path, api_keys=path, admin_key="sk-admin")
    engine = None
    try:
        engine = Engine(tmp_path, gateway, "e1", ["m"], key="ek-a", tenant="a")
        rewrite(path, "keys:\n  - {key: sk-admin, admin: cluster}\n")
        wait_until(lambda: "e1" not in gateway.engines("a"), "the engine to be removed", [gateway.child])
        assert "its key was removed or changed in the key file" in gateway.child.output()
        rewrite(path, with_engine)  # and back: the agent's next dial is admitted again
        gateway.wait_for_engine("e1", "a", [engine.child])
    finally:
        if engine is not None:
            engine.stop()
        gateway.stop()
