"""The README's code blocks, as written, so that the first commands a user types keep working.

Fast (default suite): every ``dtrain`` command of every block composes and validates its config as
``--cfg job`` would compose it (in this process, one Hydra compose per command), every ``--help`` line
runs, the Slurm script passes ``bash -n``, the install lines name extras that exist, and every link of
the README and of ``docs/`` reaches a page and a heading that exist. Slow: every block runs verbatim in
a fresh project directory, in order, with this environment's ``python``, ``dtrain`` and ``mpiexec`` (a line
that is one ``python ...`` command runs forked from a warm interpreter, ``tests.helpers.cli.run_shell_line``).
Blocks that cannot run on one machine (the environment's own installation, ``sbatch``, a multi-node
``torchrun``) are named in ``NOT_RUN_HERE``, with what is checked instead.
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from dtrain.config import validate
from tests.helpers.cli import run_shell_line
from tests.helpers.config import compose_config
from tests.helpers.mpi import OPEN_MPI_ENV, plain_environment

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"

#: command prefixes the tests cannot run here, and what they check instead
NOT_RUN_HERE = {
    "make ": "builds .venv from nothing (checked: `make -n` plans the step-by-step block's commands, and .ci/run "
             "runs make test)",
    "python3 -m venv": "creates the environment these tests run in",
    "pip install": "installs into the environment these tests run in (checked: its extras exist in pyproject.toml)",
    "torchrun --nnodes 2": "needs two nodes (checked: the dtrain command after the launcher composes)",
}
#: ``file=`` blocks that are scripts for a scheduler, not for this machine
SCHEDULER_SCRIPTS = {"train.sbatch": "needs Slurm (checked: bash -n, and its srun line's dtrain command composes)"}

_BLOCK = re.compile(r"^```(\w+)(?: file=(\S+))?\n(.*?)^```$", re.MULTILINE | re.DOTALL)


def blocks(text: str) -> list[tuple[str, str, str]]:
    """``(language, file name or "", body)`` of every fenced code block, in order."""
    return [(match.group(1), match.group(2) or "", match.group(3)) for match in _BLOCK.finditer(text)]


def command_lines(body: str) -> list[str]:
    """The commands of a shell block: continuation lines joined, comments and blank lines left out."""
    joined = re.sub(r"\\\n\s*", " ", body)
    return [line for line in joined.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def dtrain_arguments(line: str) -> list[str] | None:
    """The arguments a command line gives ``dtrain`` (after ``python -m dtrain``, ``-m dtrain`` of a
    launcher, or the ``dtrain`` command); ``None`` when it does not run dtrain."""
    words = shlex.split(line, comments=True)
    for index, word in enumerate(words):
        if word == "dtrain" and (index == 0 or words[index - 1] == "-m"):
            return words[index + 1:]
    return None


def not_run_here(line: str) -> str | None:
    return next((why for prefix, why in NOT_RUN_HERE.items() if line.startswith(prefix)), None)


def write_files(directory: Path) -> None:
    for _, name, body in blocks(README.read_text()):
        if name:
            (directory / name).parent.mkdir(parents=True, exist_ok=True)
            (directory / name).write_text(body)


def all_commands() -> list[str]:
    """Every command of the README's shell blocks, the scheduler scripts' included."""
    return [line for language, _, body in blocks(README.read_text()) if language == "bash" for line in command_lines(body)]


# -- fast --------------------------------------------------------------------------------------------
def test_the_readme_stays_short():
    assert len(README.read_text().splitlines()) < 250


def test_every_dtrain_command_of_the_readme_composes_its_config(tmp_path, monkeypatch):
    write_files(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))  # the project's own modules, as python -m dtrain imports them
    composed = []
    for line in all_commands():
        arguments = dtrain_arguments(line)
        if arguments is None or "--help" in arguments:
            continue
        overrides, config_dirs = [], []
        words = iter(arguments)
        for word in words:
            if word == "--config-dir":
                config_dirs.append(tmp_path / next(words))
            elif word == "--cfg":
                next(words)
            else:
                overrides.append(word)
        if config_dirs:
            overrides.append("hydra.searchpath=[" + ",".join(f"file://{path}" for path in config_dirs) + "]")
        cfg = compose_config(*overrides)
        assert validate(cfg, check_run_dir=False) == [], line
        composed.append(line)
    assert any("srun " in line for line in composed) and any(line.startswith("torchrun ") for line in composed)
    assert any(line.startswith("mpiexec ") for line in composed) and any("--config-dir" in line for line in composed)


def test_every_help_line_of_the_readme_runs(tmp_path):
    lines = [line for line in all_commands() if "--help" in (dtrain_arguments(line) or [])]
    assert lines
    environment = {**plain_environment(), "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    for line in lines:
        result = subprocess.run(line, shell=True, cwd=tmp_path, env=environment, capture_output=True, text=True,
                                timeout=120)
        assert result.returncode == 0 and result.stdout.startswith(("dtrain: ", "# ")), f"{line}\n{result.stderr}"


def test_the_slurm_script_is_valid_bash(tmp_path):
    write_files(tmp_path)
    for name in SCHEDULER_SCRIPTS:
        script = tmp_path / name
        assert script.read_text().startswith("#!/bin/bash\n")
        result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert result.returncode == 0, result.stderr
        assert any(line.startswith("srun python -m dtrain ") for line in script.read_text().splitlines())


def test_the_install_lines_name_extras_that_exist():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = set(project["optional-dependencies"])
    installs = [line for line in all_commands() if line.startswith("pip install")]
    assert any("torch==" in line for line in installs)
    for line in installs:
        for named in re.findall(r"\.\[([\w,]+)\]", line):
            assert set(named.split(",")) <= extras, line
    for named in re.findall(r'`\.\[(\w+)\]`|"\.\[([\w,]+)\]"', README.read_text()):
        assert set(",".join(named).strip(",").split(",")) <= extras, named


def _make(*arguments: str) -> subprocess.CompletedProcess:
    """``make`` as a user runs it: without the settings of a make that runs these tests (``make test VENV=...``
    exports its command-line variables to the suite's environment and hands them on through ``MAKEFLAGS``)."""
    make_settings = ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES", "PYTHON", "VENV", "TORCH", "TORCH_INDEX")
    environment = {key: value for key, value in os.environ.items() if key not in make_settings}
    return subprocess.run(["make", "--no-print-directory", *arguments], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, env=environment)


def _planned(target: str, venv: Path, *settings: str) -> list[list[str]]:
    """The commands ``make -n TARGET`` plans, as words; the venv's Python shortened to ``python``."""
    planned = _make("-n", target, f"VENV={venv}", *settings)
    assert planned.returncode == 0, planned.stderr
    return [["python" if word == f"{venv}/bin/python" else word for word in line.split()]
            for line in planned.stdout.splitlines()]


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_demo_and_make_test_run_the_step_by_step_commands(tmp_path):
    """The two commands plan what the README's step-by-step block does (the same torch pin and index, the
    same extras, the same run), in order, and .ci/run installs through make and runs make test's pytest command."""
    step_by_step = [line.split("#")[0].split() for line in all_commands()
                    if line.startswith(("pip install", "python -m dtrain +recipe=digits  "))]
    torch_pin, extras, run = step_by_step
    venv = tmp_path / "venv"
    demo = _planned("demo", venv)
    assert demo[0] == ["python3", "-m", "venv", str(venv)]
    assert [words[2:] for words in demo if words[:2] == ["python", "-m"]] == [
        ["pip", "install", "--upgrade", "pip"],
        ["pip", "install", "--force-reinstall", *torch_pin[2:]],  # torch, pinned, from the CPU index
        ["pip", *extras[1:]],  # dtrain and the demo's extras
        ["dtrain", *run[3:]],
    ], demo
    cuda = [words for words in _planned("demo", venv, "TORCH=cuda") if "torch" in " ".join(words)]
    assert cuda[0] == ["python", "-m", "pip", "install", "--force-reinstall", torch_pin[2]]  # PyPI's own build
    assert _planned("test", venv)[-3:] == [["python", "-m", "pip", "install", "-e", '".[dev]"'],
                                           ["touch", f"{venv}/.installed-dev"],
                                           ["python", "-m", "pytest", "--durations=25"]]
    ci = (ROOT / ".ci" / "run").read_text()
    assert "\npython -m pytest --durations=25\npython -m pytest --durations=25 -m slow " in ci  # make test's command
    assert "make install-dev VENV=.ci/venv" in ci


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_refuses_an_unknown_torch_build_in_one_line():
    refused = _make("demo", "TORCH=rocm")
    assert refused.returncode == 2 and refused.stdout == ""
    assert refused.stderr.strip().endswith("TORCH=rocm: expected cpu or cuda.  Stop."), refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1, refused.stderr


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors of a Markdown page's headings."""
    headings = re.findall(r"^#+ (.+)$", re.sub(r"^```.*?^```$", "", page.read_text(), flags=re.M | re.S), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-") for heading in headings}


@pytest.mark.parametrize("page", [README, *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md"],
                         ids=lambda page: str(page.relative_to(ROOT)))
def test_every_link_reaches_a_page_and_heading_that_exist(page):
    for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        assert linked.exists(), f"{page.relative_to(ROOT)} links {target}, which does not exist"
        if anchor and linked.suffix == ".md":
            assert anchor in _anchors(linked), f"{page.relative_to(ROOT)} links {target}: no such heading"


def test_the_readmes_link_for_your_own_loss_and_metric_reaches_the_page_that_has_them():
    found = re.search(r"your own\s+loss\s+and\s+metric:\s*\[[^\]]*\]\(([^)\s]+)\)", README.read_text())
    assert found, "the README names no page for your own loss and metric"
    path = found.group(1).partition("#")[0]
    assert "your-own-loss-and-metric" in _anchors(README.parent / path), found.group(0)


# -- slow --------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_every_block_of_the_readme_runs_as_written(tmp_path):
    environment = {**plain_environment(**OPEN_MPI_ENV),
                   "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    outputs = ""
    for language, name, body in blocks(README.read_text()):
        if name:
            (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / name).write_text(body)  # a file of the project; a later command uses it
            continue
        if language == "text":  # a sample of the digits run's last lines: each kind of line is printed
            for line in body.splitlines():
                assert re.search(rf"^{re.escape(line.split(':')[0])}: ", outputs, re.M), line
            continue
        commands = [body] if language == "python" else command_lines(body)
        for command in commands:
            if language == "bash" and not_run_here(command):
                continue
            if language == "python":
                result = subprocess.run([sys.executable, "-"], input=command, cwd=tmp_path, env=environment,
                                        capture_output=True, text=True, timeout=600)
            else:
                result = run_shell_line(command, tmp_path, environment)
            assert result.returncode == 0, f"{command}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
            outputs += result.stdout
            arguments = dtrain_arguments(command) if language == "bash" else None
            if arguments and "--help" not in arguments and "--cfg" not in arguments:
                assert "finished:" in result.stdout, result.stdout[-3000:]
    assert "restored " in outputs and "at 15000 samples" in outputs  # the resumed run continued its checkpoint
