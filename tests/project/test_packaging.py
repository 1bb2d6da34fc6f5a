"""The built wheel is the whole toolkit: installed (not editable) in a fresh environment, with
no checkout in reach, ``sparse-ft train recipe=tiny`` runs from any directory."""

import json
import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ("recipes", "ds_configs", "assets/tiny-base", "assets/tiny-base-bpe", "data/tiny")  # mapped to sparse_ft/_data/... in the wheel


def _tracked(*paths: str) -> list[str]:
    done = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "--", *paths],
                          cwd=ROOT, capture_output=True, text=True, check=True)
    return done.stdout.split()


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """Built from a copy of what git tracks: no stale build/ or untracked files get in."""
    tmp = tmp_path_factory.mktemp("wheel")
    for name in _tracked():
        (tmp / "src" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp / "src" / name).write_bytes((ROOT / name).read_bytes())
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-v", "-w",
                           str(tmp / "dist"), str(tmp / "src")], check=True, capture_output=True, text=True)
    (tmp / "build.log").write_text(done.stdout + done.stderr)
    (built,) = (tmp / "dist").glob("sparse_ft-*.whl")
    return built


def test_building_warns_about_no_package_data(wheel):
    """setuptools printed ~175 lines of "Package would be ignored" on every install: each folder
    of recipes with an importable name must be a package of pyproject.toml's list."""
    log = (wheel.parent.parent / "build.log").read_text()
    assert "would be ignored" not in log, log[log.find("would be ignored") - 300:][:900]


def test_every_folder_of_recipes_is_a_declared_package():
    """The fast form of the check above: a new folder under recipes/ names what to add."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

    declared = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {f"sparse_ft._data.recipes.{d.name}" for d in (ROOT / "recipes").iterdir() if d.is_dir() and d.name.isidentifier()}
    assert folders <= declared, f"add to [tool.setuptools] packages and package-data in pyproject.toml: {sorted(folders - declared)}"


def test_the_wheel_holds_every_module_and_shipped_file(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    modules = {name for name in _tracked("attn_patterns", "sparse_ft") if name.endswith(".py")}
    shipped = {f"sparse_ft/_data/{name}" for name in _tracked(*SHIPPED) if not Path(name).name.startswith(".")}
    assert modules <= names and shipped <= names, sorted((modules | shipped) - names)
    assert "sparse_ft/_data/recipes/tiny.yaml" in shipped and "sparse_ft/_data/assets/tiny-base/model.safetensors" in shipped
    assert "sparse_ft/_data/assets/tiny-base-bpe/model.safetensors" in shipped


@pytest.mark.slow
def test_installed_wheel_trains_the_tiny_recipe_outside_the_repository(wheel, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    # the dependencies (torch, transformers, ...) come from this environment; sparse_ft only from the wheel
    site = Path(subprocess.run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                               capture_output=True, text=True, check=True).stdout.strip())
    (site / "dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "--no-deps",
                    "--no-index", "-q", str(wheel)], check=True, capture_output=True)
    work = tmp_path / "work"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    where = subprocess.run([str(venv / "bin" / "python"), "-c", "import sparse_ft; print(sparse_ft.__file__)"],
                           cwd=work, env=env, capture_output=True, text=True, check=True).stdout
    assert where.startswith(str(site))
    done = subprocess.run([str(venv / "bin" / "sparse-ft"), "train", "recipe=tiny", "deepspeed=null", "train.max_steps=1",
                           "train.report_to=[none]", "train.output_dir=out", "data.cache_dir=cache"],
                          cwd=work, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    meta = json.loads((work / "out" / "adapter" / "sparse_ft.json").read_text())
    assert meta["base_model"] == str(work / "out" / "base-model") and meta["base_model_given"] == "tiny"
    resolved = (work / "out" / "recipe.resolved.yaml").read_text()
    assert f"source: {site / 'sparse_ft' / '_data' / 'data' / 'tiny' / 'train.jsonl'}" in resolved
