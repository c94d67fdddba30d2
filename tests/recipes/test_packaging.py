"""A plain (non-editable) install carries the config tree and every subpackage."""
from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "--wheel-dir", str(out), str(ROOT)], check=True, capture_output=True, timeout=240)
    return next(out.glob("dtrain-*.whl"))


def test_wheel_holds_every_package_and_the_config_tree(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    packages = {str(p.parent.relative_to(ROOT)) for p in (ROOT / "dtrain").rglob("__init__.py")}
    for package in packages:
        assert f"{package}/__init__.py" in names, f"{package} is missing from pyproject's packages list"
    for recipe in (ROOT / "recipes").glob("*.yaml"):
        assert f"dtrain/conf/recipe/{recipe.name}" in names
    for config in (ROOT / "conf").rglob("*.yaml"):
        assert f"dtrain/conf/{config.relative_to(ROOT / 'conf')}" in names
    assert {"dtrain/data/digits.npz", "dtrain/data/digits.README.md"} <= names  # the data set and its licence
    assert {"dtrain/data/shakespeare.txt.gz", "dtrain/data/shakespeare.README.md"} <= names  # the corpus and its source
    for page in (ROOT / "docs").rglob("*"):  # the documentation, which --help TOPIC prints, with its examples
        if page.is_file():
            assert f"dtrain/docs/{page.relative_to(ROOT / 'docs')}" in names


@pytest.mark.slow
def test_installed_wheel_composes_a_recipe_from_another_directory(wheel, tmp_path):
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(site), str(wheel)],
                   check=True, capture_output=True, timeout=240)
    env = {**os.environ, "PYTHONPATH": str(site)}
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    result = subprocess.run([sys.executable, "-c", "import dtrain; print(dtrain.__file__)"], cwd=elsewhere, env=env,
                            capture_output=True, text=True, check=True)
    assert result.stdout.strip().startswith(str(site))
    result = subprocess.run([sys.executable, "-m", "dtrain", "+recipe=cifar10", "--cfg", "job"], cwd=elsewhere, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "recipe_name: cifar10" in result.stdout and "ConvNetCIFAR10" in result.stdout
    for flags, expected in ((["--version"], "dtrain "), (["--help"], "recipes (+recipe=NAME):\n  cifar10"),
                            (["--help"], "\n    semantics "), (["--help", "semantics"], "# What dtrain computes\n")):
        result = subprocess.run([sys.executable, "-m", "dtrain", *flags], cwd=elsewhere, env=env,
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 0 and expected in result.stdout, result.stderr
    # the digits set is read from the installed package, without scikit-learn
    result = subprocess.run([sys.executable, "-c", "import sys; from dtrain.data import Digits; "
                             "print(Digits('train').num_samples, Digits('test').num_samples, 'sklearn' in sys.modules)"],
                            cwd=elsewhere, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["1500", "297", "False"]


def test_default_dependencies_leave_out_scikit_learn_and_tensorboard():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {dependency.split(">")[0].split("=")[0].split("<")[0].strip() for dependency in dependencies}
    assert not names & {"scikit-learn", "scipy", "tensorboard"}
