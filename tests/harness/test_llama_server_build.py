"""llama-server's build cache: one binary per pin, flags, compiler and CPU, found without building again.

The build itself runs in ``tools/test`` before pytest (it takes minutes);
these tests check what decides whether it runs, and the binary it left.
"""

from __future__ import annotations

import fcntl
import json
import subprocess
import threading
from dataclasses import replace
from importlib.metadata import version
from pathlib import Path

import pytest

from harness.llama_server_build import (
    BINARY,
    CMAKE_ARGS,
    BuildSpec,
    LlamaServerMissing,
    binary_path,
    cache_root,
    ensure,
    locate,
    pinned_version,
)

#: Runs the real llama-server binary.
pytestmark = pytest.mark.e2e


def test_the_server_is_built_from_the_same_llama_cpp_python_the_test_extra_installs():
    assert pinned_version() == version("llama_cpp_python")


def test_the_pin_is_read_from_the_test_extra(tmp_path):
    setup_cfg = tmp_path / "setup.cfg"
    setup_cfg.write_text("[options.extras_require]\ntest =\n    pytest>=8\n    llama-cpp-python[server]==9.8.7\n")
    assert pinned_version(setup_cfg) == "9.8.7"
    setup_cfg.write_text("[options.extras_require]\ntest =\n    llama-cpp-python>=0.3\n")
    with pytest.raises(ValueError, match="pins no llama-cpp-python"):
        pinned_version(setup_cfg)


def test_any_change_of_pin_flags_compiler_or_cpu_names_another_binary():
    spec = BuildSpec("0.3.36", CMAKE_ARGS, "c++ 12", "avx2 fma")
    assert spec.key == BuildSpec("0.3.36", CMAKE_ARGS, "c++ 12", "avx2 fma").key
    assert spec.key.startswith("0.3.36-")
    others = [replace(spec, version="0.3.37"), replace(spec, cmake_args=(*CMAKE_ARGS, "-DGGML_NATIVE=OFF")),
              replace(spec, compiler="c++ 13"), replace(spec, cpu="avx2 fma avx512f")]
    assert len({spec.key, *(o.key for o in others)}) == 5


def test_the_build_takes_no_network_feature_and_only_the_server():
    assert {"-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_BUILD_TESTS=OFF",
            "-DLLAMA_BUILD_EXAMPLES=OFF", "-DCMAKE_BUILD_TYPE=Release"} <= set(CMAKE_ARGS)


def test_the_cache_lives_where_the_environment_says(monkeypatch, tmp_path):
    monkeypatch.delenv("INFX_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "infx" / "llama-server"
    monkeypatch.setenv("INFX_CACHE_DIR", str(tmp_path / "infx"))
    assert cache_root() == tmp_path / "infx" / "llama-server"


def test_a_missing_binary_is_an_error_that_says_how_to_build_it(monkeypatch, tmp_path):
    monkeypatch.setenv("INFX_CACHE_DIR", str(tmp_path))
    with pytest.raises(LlamaServerMissing, match="run tools/test"):
        locate()


def test_a_built_binary_is_used_as_it_is(monkeypatch, tmp_path):
    monkeypatch.setenv("INFX_CACHE_DIR", str(tmp_path))
    spec = BuildSpec.current()
    built = binary_path(spec)
    built.parent.mkdir(parents=True)
    built.write_text("built before")
    said: list[str] = []
    assert ensure(spec, said.append) == built == locate(spec)
    assert said == [] and built.read_text() == "built before"


def test_a_second_builder_waits_for_the_first_and_uses_its_binary(monkeypatch, tmp_path):
    """The lock is held by 'another process' (a thread here) that installs the binary, then lets go."""
    monkeypatch.setenv("INFX_CACHE_DIR", str(tmp_path))
    spec = BuildSpec.current()
    root = cache_root()
    root.mkdir(parents=True)
    lock = (root / f".{spec.key}.lock").open("w")
    fcntl.flock(lock, fcntl.LOCK_EX)
    waiting = threading.Event()
    said: list[str] = []

    def progress(text: str) -> None:
        said.append(text)
        waiting.set()

    result: list[Path] = []
    second = threading.Thread(target=lambda: result.append(ensure(spec, progress)))
    second.start()
    assert waiting.wait(30), "the second builder never waited for the lock"
    binary_path(spec).parent.mkdir()
    binary_path(spec).write_text("built by the first")
    fcntl.flock(lock, fcntl.LOCK_UN)
    lock.close()
    second.join(30)
    assert result == [binary_path(spec)]
    assert len(said) == 1 and "waiting for another process's build" in said[0]


def test_the_binary_tools_test_built_runs_and_records_how_it_was_built():
    path = locate()
    assert path.name == BINARY
    run = subprocess.run([str(path), "--version"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and "version:" in run.stdout + run.stderr
    info = json.loads((path.parent / "build-info.json").read_text())
    assert info["llama_cpp_python"] == pinned_version() and tuple(info["cmake_args"]) == CMAKE_ARGS
