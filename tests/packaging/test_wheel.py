"""A non-editable wheel, installed into a fresh virtualenv, imports and registers its twistd plugins."""

import os
import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

#: Builds a wheel and installs it into a fresh venv with pip, as child processes.
pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]


def _sources(tmp_path: Path) -> Path:
    """What the Dockerfile copies, in a fresh folder: a build in the checkout would also pack
    whatever an earlier build left in its build/ folder (a package dropped from setup.cfg too)."""
    sources = tmp_path / "src"
    for name in ("pyproject.toml", "setup.cfg", "README.md"):
        sources.mkdir(exist_ok=True)
        shutil.copy(ROOT / name, sources / name)
    for name in ("infx", "protocol", "twisted"):
        shutil.copytree(ROOT / name, sources / name, ignore=shutil.ignore_patterns("__pycache__", "dropin.cache"))
    return sources


def test_wheel_installs_packages_and_plugins(tmp_path):
    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels),
         str(_sources(tmp_path))],
        check=True,
    )
    (wheel,) = wheels.glob("infx-*.whl")

    fresh = tmp_path / "venv"
    venv.create(fresh, with_pip=False)
    python = fresh / "bin" / "python"
    fresh_site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()
    # Reuse the test venv's already-installed dependencies without its editable infx:
    # a plain path in a .pth file, unlike a site dir, does not run the editable finder.
    Path(fresh_site, "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q", str(wheel)],
        check=True,
    )

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    probe = (
        "import protocol.pb.worker_pb2, protocol.pb.internal_pb2, infx, infx.transport, protocol, os;"
        "print(os.path.dirname(protocol.__file__))"
    )
    where = subprocess.run([str(python), "-c", probe], cwd=tmp_path, env=env, check=True, capture_output=True, text=True)
    assert where.stdout.strip().startswith(fresh_site), "imported from the source tree, not the wheel"
    assert Path(fresh_site, "protocol", "py.typed").exists() and Path(fresh_site, "infx", "py.typed").exists()
    packages = {path.parent.relative_to(ROOT) for top in ("infx", "protocol") for path in (ROOT / top).rglob("__init__.py")}
    assert [str(p) for p in sorted(packages) if not Path(fresh_site, p, "__init__.py").exists()] == []
    assert not Path(fresh_site, "harness").exists() and not Path(fresh_site, "tests").exists()
    assert Path(fresh_site, "twisted", "plugins", "infx_plugin.py").exists()

    twistd = "import sys; from twisted.scripts.twistd import run; sys.argv[0] = 'twistd'; run()"
    help_text = subprocess.run(
        [str(python), "-c", twistd, "--help"], cwd=tmp_path, env=env, capture_output=True, text=True
    ).stdout
    commands = {line.split()[0] for line in help_text.splitlines() if line.startswith("    ") and line.split()}
    assert {"infx", "infx-engine"} <= commands, help_text


def test_after_the_install_step_of_the_dockerfile_twistd_has_no_plugin_cache_to_write(tmp_path):
    """A non-root user cannot write ``site-packages/twisted/plugins/dropin.cache``; after
    ``python -m infx.plugin_cache`` (the Dockerfile's step) no twistd start needs to."""
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "python -m infx.plugin_cache" in dockerfile
    fresh = tmp_path / "venv"
    venv.create(fresh, with_pip=False)
    python = fresh / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    Path(site, "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(wheels), str(_sources(tmp_path))], check=True)
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q",
                    *map(str, wheels.glob("infx-*.whl"))], check=True)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    cache = site / "twisted" / "plugins" / "dropin.cache"
    assert not cache.exists()  # what a non-root user's first twistd would try to write

    step = subprocess.run([str(python), "-m", "infx.plugin_cache"], cwd=tmp_path, env=env,
                          capture_output=True, text=True)
    assert step.returncode == 0, step.stderr
    caches = {path: path.stat().st_mtime_ns for path in [cache, *Path(sysconfig.get_paths()["purelib"]).glob(
        "twisted/plugins/dropin.cache")]}
    assert cache in caches

    twistd = "import sys; from twisted.scripts.twistd import run; sys.argv[0] = 'twistd'; run()"
    result = subprocess.run([str(python), "-c", twistd, "infx", "--version"], cwd=tmp_path, env=env,
                            capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.startswith("infx "), result.stderr
    assert {path: path.stat().st_mtime_ns for path in caches} == caches, "twistd rewrote a plugin cache"
    check = subprocess.run([str(python), "-c", "from infx.plugin_cache import stale_caches; print(stale_caches())"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, check=True)
    assert check.stdout.strip() == "[]"
