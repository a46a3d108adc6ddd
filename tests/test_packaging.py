"""What ``pip install`` puts in site-packages: one namespace, ``specdec``, holding the
repository's folders (setup.py), and an installed copy that runs from any directory."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("decoders", "proposers", "verifiers", "train")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    if importlib.util.find_spec("setuptools") is None:
        pytest.skip("setuptools is not installed (pip install -e '.[dev]' installs it)")
    # built from a copy: setuptools leaves build/ in the tree it builds, and reuses it
    source = tmp_path_factory.mktemp("source")
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy(REPO_ROOT / name, source / name)
    for folder in (*FOLDERS, "conf"):
        shutil.copytree(REPO_ROOT / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
         "--disable-pip-version-check", "-w", str(out), str(source)],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    (built,) = out.glob("*.whl")
    return built


def source_files() -> set[str]:
    """Every file an installed copy needs: the code, the configs, the default workloads and
    the shipped drafters."""
    files = {p for folder in FOLDERS for p in (REPO_ROOT / folder).rglob("*.py")}
    files |= set((REPO_ROOT / "conf").rglob("*.yaml"))
    files |= set((REPO_ROOT / "decoders" / "evaluation" / "data").glob("*.jsonl"))
    files |= {p for p in (REPO_ROOT / "proposers" / "shipped").rglob("*") if p.is_file()}
    return {p.relative_to(REPO_ROOT).as_posix() for p in files if "__pycache__" not in p.parts}


@pytest.mark.slow  # builds and installs the wheel
def test_the_wheel_installs_one_namespace_holding_every_folder(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert {name.split("/")[0] for name in names} == {"specdec", wheel.name.split("-py3")[0] + ".dist-info"}
    missing = sorted(f for f in source_files() if f"specdec/{f}" not in names)
    assert not missing, f"not in the wheel: {missing[:10]}"


@pytest.mark.slow  # builds and installs the wheel
def test_an_installed_copy_runs_from_another_directory(wheel, tmp_path):
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--disable-pip-version-check",
         "--target", str(target), str(wheel)],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(target)}
    where = subprocess.run(
        [sys.executable, "-c", "import specdec.decoders.cli.config as c; print(c.__file__); print(c.CONF_DIR)"],
        cwd=tmp_path, env=env, check=True, capture_output=True, text=True,
    )  # fmt: skip
    module, conf = where.stdout.split()
    assert Path(module).is_relative_to(target) and Path(conf) == target / "specdec" / "conf"
    done = subprocess.run(
        [sys.executable, "-m", "specdec.decoders.generate", "model=tiny-random", "prompt=hello",
         "max_new_tokens=4", "proposer=ngram", "verifier=greedy"],
        cwd=tmp_path, env=env, capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "new tokens          4" in done.stderr  # the text goes to stdout, the figures to stderr
