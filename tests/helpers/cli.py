"""Running ``python -m dtrain`` (and dtrain's tools) as a user would from a shell: one process, no launcher.

Each command line runs in its own process, forked from a warm interpreter that imported torch and dtrain
once (``tests/helpers/forked_dtrain.py``; one per environment, for the life of the test process): a fresh
``python -m dtrain`` spends seconds on those imports, which the suites would pay for every run.
"""
from __future__ import annotations

import atexit
import json
import shlex
import subprocess
import sys
from pathlib import Path

from dtrain.testing.processes import RunTimedOut, hang_guard
from tests.helpers.mpi import plain_environment

#: the warm interpreter's script (run by path: importing it here would import dtrain into pytest's process)
RUNNER = Path(__file__).with_name("forked_dtrain.py")

#: the warm interpreters, by the environment they started with (less PYTEST_CURRENT_TEST, which changes per test)
_RUNNERS: dict[tuple, subprocess.Popen] = {}


def run_dtrain(*args: str, cwd: Path, timeout: float = 240, gpu: bool = False,
               env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run ``python -m dtrain ARGS`` in ``cwd`` without any launcher's variables; return it finished
    (``stdout``/``stderr`` as text). Raises ``subprocess.TimeoutExpired`` past ``timeout`` seconds.

    The process is forked from a warm interpreter and sees no GPU (``CUDA_VISIBLE_DEVICES=""``: CUDA does not
    survive a fork once started, and the suites are a CPU machine's); ``gpu=True`` starts a fresh interpreter
    that sees this machine's GPUs. ``timeout`` is scaled as every hang guard is (:func:`hang_guard`). ``env``:
    variables added to the plain environment (read after start-up, such as a test model's; ``PYTHONPATH`` joins
    ``sys.path`` as at an interpreter's start)."""
    return run_python("-m", "dtrain", *args, cwd=cwd, timeout=timeout, gpu=gpu, env=env)


def run_python(*command: str, cwd: Path, timeout: float = 240, gpu: bool = False,
               env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``python COMMAND`` as :func:`run_dtrain` runs it, for dtrain's other entry points: ``COMMAND`` is
    ``-m MODULE ARGS`` (``dtrain.generate``, ``dtrain.noise_scale``, ...) or ``SCRIPT ARGS`` (a benchmark)."""
    full = [sys.executable, *command]
    timeout = hang_guard(timeout)
    base = plain_environment(**({} if gpu else {"CUDA_VISIBLE_DEVICES": ""}))
    child_env = {**base, **(env or {})}
    if gpu:
        return subprocess.run(full, cwd=cwd, env=child_env, capture_output=True, text=True, timeout=timeout)
    if command[0] == "-m":
        request = {"module": command[1], "argv": list(command[2:])}
    else:
        request = {"script": str(command[0]), "argv": list(command[1:])}
    runner = _runner(base)  # keyed by what the runner imported with; the child gets the added variables
    runner.stdin.write(json.dumps({**request, "cwd": str(cwd), "env": child_env, "timeout": timeout}) + "\n")
    runner.stdin.flush()
    line = runner.stdout.readline()
    if not line:  # the runner itself ended (killed from outside): this command in a process of its own
        _RUNNERS.pop(_key(base), None)
        return subprocess.run(full, cwd=cwd, env=child_env, capture_output=True, text=True, timeout=timeout)
    reply = json.loads(line)
    if reply["timed_out"]:
        raise RunTimedOut(full, timeout, output=reply["stdout"], stderr=reply["stderr"])
    return subprocess.CompletedProcess(full, reply["returncode"], reply["stdout"], reply["stderr"])


#: words that make a command line more than one program run (those lines go to bash)
SHELL_OPERATORS = frozenset({"|", "||", "&&", ";", "&", ">", ">>", "<", "2>", "2>&1"})


def run_shell_line(line: str, cwd: Path, env: dict[str, str], timeout: float = 600) -> subprocess.CompletedProcess:
    """One line of a documentation's shell block, as ``bash -c LINE`` runs it in ``cwd`` with ``env``; a line that
    is a single ``python ...`` command runs through :func:`run_python` (forked warm; ``env`` is then the
    plain environment, which such a command needs no more of)."""
    words = shlex.split(line, comments=True)
    if words and words[0] == "python" and not set(words) & SHELL_OPERATORS and "$" not in line:
        return run_python(*words[1:], cwd=cwd, timeout=timeout)
    return subprocess.run(["bash", "-c", line], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def _key(env: dict[str, str]) -> tuple:
    return tuple(sorted((name, value) for name, value in env.items() if name != "PYTEST_CURRENT_TEST"))


def _runner(env: dict[str, str]) -> subprocess.Popen:
    """The warm interpreter for ``env``, started on first use."""
    key = _key(env)
    runner = _RUNNERS.get(key)
    if runner is None or runner.poll() is not None:
        runner = subprocess.Popen([sys.executable, str(RUNNER)], env=env, stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
        _RUNNERS[key] = runner
    return runner


@atexit.register
def _end_runners() -> None:
    """Each runner ends when its input does (and would with this process: it asked for SIGKILL then)."""
    for runner in _RUNNERS.values():
        try:
            runner.stdin.close()
            runner.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            runner.kill()
