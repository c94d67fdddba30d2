"""``docs/your-model-and-data.md`` (the walkthrough the README's "Your own model and data" leads to), run as
written: its files are written into a fresh
project directory, and its commands run there one by one, with ``python -m dtrain`` (forked from a warm
interpreter, ``tests.helpers.cli.run_shell_line``) and with the installed ``dtrain`` command (a process of its
own, which must import the project's modules from the working directory)."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.cli import plain_environment, run_shell_line

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]  # about 30 s of training runs; .ci/run runs it


def page() -> str:
    return (ROOT / "docs" / "your-model-and-data.md").read_text()


def blocks(text: str) -> list[tuple[str, str, str]]:
    """``(language, file name or "", body)`` of every fenced code block, in order."""
    pattern = re.compile(r"^```(\w+)(?: file=(\S+))?\n(.*?)^```$", re.MULTILINE | re.DOTALL)
    return [(match.group(1), match.group(2) or "", match.group(3)) for match in pattern.finditer(text)]


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    """A project directory outside the repository, with a text file of its own for the corpus."""
    directory = tmp_path_factory.mktemp("my_project")
    shutil.copy(ROOT / "docs" / "semantics.md", directory / "corpus.txt")
    return directory


def run(command: str, cwd: Path) -> subprocess.CompletedProcess:
    environment = plain_environment()
    # `python` and `dtrain` are this interpreter's and its environment's scripts, as in an activated venv
    environment["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{environment.get('PATH', '')}"
    return run_shell_line(command, cwd, environment, timeout=400)


def test_every_snippet_of_your_own_model_and_data_runs_as_written(project: Path) -> None:
    found = blocks(page())
    commands = [line for language, _, body in found if language == "bash" for line in body.splitlines()
                if line.strip() and not line.startswith("#")]
    assert any(line.startswith("dtrain ") for line in commands)  # the installed command is among them
    assert sum(1 for language, name, _ in found if name) >= 7
    for language, name, body in found:
        if name:
            path = project / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(body)
            continue
        if language != "bash":
            continue
        for line in body.splitlines():
            if not line.strip() or line.startswith("#"):
                continue
            result = run(line, project)
            assert result.returncode == 0, f"{line}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
            if "dtrain" in line and ("+recipe" in line):
                assert "finished:" in result.stdout, result.stdout[-3000:]
                if "+recipe=chars" in line:  # the language model learns: its loss falls from ln(128) = 4.85
                    losses = [float(value) for value in re.findall(r"\| loss ([0-9.]+) \|", result.stdout)]
                    assert "samples are steps of text[1:]" in result.stdout and "padding" in result.stdout
                    assert losses[-1] < 2.6, result.stdout[-3000:]
                if "+recipe=my_arrays" in line:
                    accuracy = float(re.search(r"test: accuracy ([0-9.]+)%", result.stdout).group(1))
                    assert accuracy > 85, result.stdout[-2000:]


def test_the_installed_command_names_the_working_directory_when_a_module_is_missing(project: Path) -> None:
    result = run("dtrain +recipe=digits model._target_=mymissing.Model session.max_samples=64", project)
    assert result.returncode == 2
    assert "mymissing.Model" in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert f"imported from the working directory, {project}" in result.stderr, result.stderr
