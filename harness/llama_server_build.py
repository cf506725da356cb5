"""llama.cpp's ``llama-server``, built once from the vendored source of the pinned llama-cpp-python sdist.

Why this source: the C++ server must be the same llama.cpp the Python
binding in ``setup.cfg``'s test extra wraps, so the pin there is the only
version there is; the sdist comes from PyPI through pip (its cache first),
the one registry a fresh machine reaches. No network past that: no curl, no
OpenSSL, no web UI (llama.cpp would otherwise download or npm-build one).

Rules this file keeps: it runs outside tests (``tools/test`` calls ``python
-m harness.llama_server_build`` before pytest, whose per-test timeout a build
would blow); tests only :func:`locate` the binary. One binary per
:class:`BuildSpec`, cached under ``<cache>/llama-server/<version>-<key>/``
(``<cache>`` is ``$INFX_CACHE_DIR``, else ``$XDG_CACHE_HOME/infx``, else
``~/.cache/infx``), where the key hashes the CMake flags, the compiler and,
since the build is ``GGML_NATIVE``, the CPU's feature flags: a change of pin,
flags, compiler or machine builds again, nothing else does. A lock file makes
a second process wait for the first's build instead of racing it, and the
result appears by one ``rename``, so a directory that exists is complete.
"""

from __future__ import annotations

import argparse
import configparser
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BINARY = "llama-server"
#: Parallel compile jobs: the machines running the suite have 2 cores.
JOBS = 2
#: Only what the server needs: CPU backend, static (one self-contained file that survives the move into
#: the cache), tuned to this CPU (GGML_NATIVE: prefill of the bench model is several times faster than a
#: generic x86-64 build), no tests/examples/app, no network features, no web UI.
CMAKE_ARGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DGGML_NATIVE=ON",
    "-DGGML_CCACHE=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_OPENSSL=OFF",
)
_PIN = re.compile(r"^\s*llama-cpp-python(?:\[[^\]]*\])?\s*==\s*([\w.+-]+)\s*$", re.MULTILINE)
_PERCENT = re.compile(r"^\[\s*(\d+)%\]")

Progress = Callable[[str], None]


class LlamaServerMissing(RuntimeError):
    """The binary for this pin and these flags has not been built on this machine."""


def pinned_version(setup_cfg: Path = ROOT / "setup.cfg") -> str:
    """The llama-cpp-python version ``setup.cfg``'s test extra pins."""
    parser = configparser.ConfigParser()
    parser.read(setup_cfg)
    match = _PIN.search(parser.get("options.extras_require", "test"))
    if match is None:
        raise ValueError(f"{setup_cfg}: the test extra pins no llama-cpp-python==VERSION")
    return match.group(1)


def _compiler() -> str:
    """The C++ compiler CMake will pick, as it names itself."""
    cxx = os.environ.get("CXX") or shutil.which("c++") or "c++"
    try:
        return subprocess.run([cxx, "--version"], capture_output=True, text=True, check=True).stdout.split("\n")[0]
    except (OSError, subprocess.CalledProcessError) as e:
        raise RuntimeError(f"no working C++ compiler ({cxx}): {e}") from None


def _cpu_flags() -> str:
    """The CPU's feature flags (a native build runs only where they all are)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return " ".join(sorted(line.split(":", 1)[1].split()))
    except OSError:
        pass
    return os.uname().machine


@dataclass(frozen=True)
class BuildSpec:
    """Everything a build's output depends on; ``key`` names its cache directory."""

    version: str
    cmake_args: tuple[str, ...]
    compiler: str
    cpu: str

    @classmethod
    def current(cls) -> BuildSpec:
        return cls(pinned_version(), CMAKE_ARGS, _compiler(), _cpu_flags())

    @property
    def key(self) -> str:
        digest = hashlib.sha256(json.dumps([self.cmake_args, self.compiler, self.cpu]).encode()).hexdigest()
        return f"{self.version}-{digest[:12]}"


def cache_root() -> Path:
    if "INFX_CACHE_DIR" in os.environ:
        return Path(os.environ["INFX_CACHE_DIR"]) / "llama-server"
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "infx" / "llama-server"


def binary_path(spec: BuildSpec) -> Path:
    return cache_root() / spec.key / BINARY


def locate(spec: BuildSpec | None = None) -> Path:
    """The built binary; :class:`LlamaServerMissing` (saying how to build it) if there is none."""
    spec = spec or BuildSpec.current()
    path = binary_path(spec)
    if not path.is_file():
        raise LlamaServerMissing(
            f"llama-server {spec.key} is not built at {path}: run tools/test (or "
            f"`.venv/bin/python -m harness.llama_server_build`) first; it builds once, in a few minutes")
    return path


def _say(text: str) -> None:
    print(text, flush=True)


@contextmanager
def _locked(path: Path, progress: Progress) -> Iterator[None]:
    with path.open("w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            progress(f"waiting for another process's build (lock {path})")
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def ensure(spec: BuildSpec | None = None, progress: Progress = _say) -> Path:
    """The binary for ``spec``, built first if this machine has none (waiting for another builder)."""
    spec = spec or BuildSpec.current()
    path = binary_path(spec)
    if path.is_file():
        return path
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    with _locked(root / f".{spec.key}.lock", progress):
        if path.is_file():  # another process built it while we waited
            return path
        _build(spec, root, progress)
    return path


def _build(spec: BuildSpec, root: Path, progress: Progress) -> None:
    work = root / f".work-{spec.key}-{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    log_path = work / "build.log"
    started = time.monotonic()
    try:
        progress(f"llama-server {spec.key}: fetching the llama-cpp-python {spec.version} sdist with pip")
        sdist = _download_sdist(spec.version, work, log_path)
        source = work / "llama.cpp"
        _extract_vendored(sdist, spec.version, source)
        build = work / "build"
        progress(f"llama-server {spec.key}: configuring ({' '.join(spec.cmake_args)})")
        _run(["cmake", "-S", str(source), "-B", str(build), *spec.cmake_args], log_path, progress)
        progress(f"llama-server {spec.key}: compiling with {JOBS} jobs (a few minutes on 2 cores)")
        _run(["cmake", "--build", str(build), "--target", BINARY, "-j", str(JOBS)], log_path, progress)
        built = build / "bin" / BINARY
        version = subprocess.run([str(built), "--version"], capture_output=True, text=True, timeout=60)
        if version.returncode != 0:
            raise RuntimeError(f"the built {built} does not run: {version.stderr[-2000:]}")
        staged = root / f".new-{spec.key}-{os.getpid()}"
        shutil.rmtree(staged, ignore_errors=True)
        staged.mkdir()
        shutil.copy2(built, staged / BINARY)
        seconds = time.monotonic() - started
        (staged / "build-info.json").write_text(json.dumps({
            "llama_cpp_python": spec.version, "cmake_args": spec.cmake_args, "compiler": spec.compiler,
            "llama_server_version": (version.stdout + version.stderr).strip(), "seconds": round(seconds, 1),
        }, indent=2) + "\n")
        os.rename(staged, root / spec.key)
        progress(f"llama-server {spec.key}: built in {seconds:.0f} s at {root / spec.key / BINARY}")
    except BaseException:
        if log_path.exists():
            failed = root / f"failed-{spec.key}.log"
            shutil.copy2(log_path, failed)
            progress(f"llama-server {spec.key}: build failed; its log is {failed}")
        raise
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _download_sdist(version: str, into: Path, log_path: Path) -> Path:
    """The sdist, through pip (which serves it from its HTTP cache when it has it)."""
    argv = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-python",
            "--dest", str(into), f"llama-cpp-python=={version}"]
    _run(argv, log_path, lambda _: None)
    found = sorted(into.glob(f"llama_cpp_python-{version}.tar.gz"))
    if not found:
        raise RuntimeError(f"pip downloaded no llama_cpp_python-{version}.tar.gz into {into}")
    return found[0]


def _extract_vendored(sdist: Path, version: str, into: Path) -> None:
    """Only ``vendor/llama.cpp`` of the sdist, with that prefix taken off."""
    prefix = f"llama_cpp_python-{version}/vendor/llama.cpp/"
    with tarfile.open(sdist) as archive:
        members = []
        for member in archive.getmembers():
            if member.name.startswith(prefix) and len(member.name) > len(prefix):
                member.name = member.name[len(prefix):]
                members.append(member)
        if not members:
            raise RuntimeError(f"{sdist} has no {prefix}")
        archive.extractall(into, members=members, filter="data")


def _run(argv: Sequence[str], log_path: Path, progress: Progress) -> None:
    """Run ``argv`` with its output appended to the log; CMake's percentages reported every 10 points."""
    reported = -10
    with log_path.open("a") as log:
        log.write(f"$ {' '.join(argv)}\n")
        log.flush()
        process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert process.stdout is not None
        for line in process.stdout:
            log.write(line)
            match = _PERCENT.match(line)
            if match and int(match.group(1)) >= reported + 10:
                reported = int(match.group(1))
                progress(f"  {line.strip()[:100]}")
        if process.wait() != 0:
            log.flush()
            tail = log_path.read_text(errors="replace")[-4000:]
            raise RuntimeError(f"{argv[0]} {argv[1]} failed with {process.returncode}:\n{tail}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--print-path", action="store_true", help="print only the binary's path")
    args = parser.parse_args(argv)
    path = ensure(progress=(lambda _: None) if args.print_path else _say)
    print(path if args.print_path else f"llama-server: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
