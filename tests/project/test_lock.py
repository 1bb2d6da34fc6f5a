"""requirements/lock-cpu.txt is the whole test environment: it pins every dependency in a
version pyproject.toml's ranges admit, and everything those need in turn; scripts/setup.sh
refuses an environment that differs from it."""

import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
from lock_compare import read_lock  # noqa: E402

LOCK = read_lock(str(ROOT / "requirements" / "lock-cpu.txt"))


def _name(text: str) -> str:
    return text.lower().replace("_", "-")


def test_every_dependency_is_pinned_inside_its_range():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    wanted = [Requirement(r) for r in project["dependencies"] + extras["dev"] + extras["harness"]]
    assert "torch" in {r.name for r in wanted} and all("==" not in str(r) for r in wanted)  # users bring their torch
    outside = [f"{r} (lock {LOCK.get(_name(r.name))})" for r in wanted if LOCK.get(_name(r.name)) not in r.specifier]
    assert not outside, f"pins outside pyproject.toml's ranges or missing: {outside}"


def test_the_lock_is_closed_under_requirements():
    """What each pinned package needs is pinned too (checked where the installed version is the pin)."""
    missing, checked = [], 0
    for name, version in LOCK.items():
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        if dist.version.split("+")[0] != version:
            continue
        checked += 1
        for text in dist.requires or []:
            req = Requirement(text)
            if (req.marker is None or req.marker.evaluate({"extra": ""})) and _name(req.name) not in LOCK:
                missing.append(f"{name} needs {req}")
    assert checked > 40 and not missing, missing


def test_setup_refuses_an_environment_that_differs_from_the_lock(tmp_path):
    pytest_version = metadata.version("pytest")
    good, bad = tmp_path / "good.txt", tmp_path / "bad.txt"
    good.write_text(f"# a lock\npytest=={pytest_version}\n")
    bad.write_text("pytest==0.0.1\n")
    script = [sys.executable, str(ROOT / "scripts" / "lock_compare.py"), "--require"]
    ok = subprocess.run(script + [str(good)], capture_output=True, text=True)
    assert ok.returncode == 0 and "also holds packages outside" in ok.stderr and "torch" in ok.stderr
    wrong = subprocess.run(script + [str(bad)], capture_output=True, text=True)
    assert wrong.returncode == 1 and f"pytest==0.0.1 (installed: {pytest_version})" in wrong.stderr
    report = subprocess.run(script[:-1] + [str(good)], capture_output=True, text=True)
    assert report.returncode == 0 and f"differs from {good}: " in report.stdout and "torch " in report.stdout
