"""Runs many ``python -m dtrain ARGS`` command lines fast: one interpreter imports dtrain once and
forks a fresh child per command line, which runs exactly what ``python -m dtrain`` runs (or another module's
``python -m MODULE ARGS``, or a script's ``python SCRIPT ARGS``: dtrain's tools and benchmarks).

Protocol: one JSON object per line on stdin, ``{"argv": [...], "cwd": "...", "watch": ["dir", ...], "id": ...,
"env": {...}, "timeout": seconds, "module": "dtrain.generate", "script": "path.py"}`` (all but ``argv`` and ``cwd``
optional; ``module`` is ``dtrain`` unless a ``script`` is named); for each, one JSON line
on stdout: ``{"id", "returncode", "stdout", "stderr", "changed", "added", "timed_out"}``, where ``id`` is the
request's own (``None`` without one), ``changed`` lists the files under the ``watch`` paths whose bytes differ
afterwards (or vanished), ``added`` the files that appeared there, and ``timed_out`` says the command outlived
``timeout`` and was killed (with its whole process group).

The child is the process ``python -m dtrain`` would be, but for what was imported before the fork: it runs in
``cwd`` with ``env`` as its environment (the runner's when absent; variables read at import time, such as
``OMP_NUM_THREADS``, keep the runner's values, so a caller runs one runner per such environment), the
working directory (a script's folder) first on ``sys.path`` and ``env``'s ``PYTHONPATH`` after it, stdin from
``/dev/null``, the module's ``__main__`` (or the script) run as ``__main__``, and on exit what the interpreter
does at its end (non-daemon threads joined, ``atexit`` functions run, streams flushed). No CUDA is started in the runner, so a child may start its own.
Imports cost seconds on a small machine; a fork costs milliseconds, so a parametrized test of
dozens of bad inputs stays quick while each case still runs in its own process.
"""
from __future__ import annotations

import atexit
import ctypes
import hashlib
import importlib
import json
import os
import runpy
import signal
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

import dtrain.cli  # noqa: F401 -- imported once here, inherited by every child
import dtrain.data
import dtrain.learners
import dtrain.models  # noqa: F401

# what the digits recipe loads lazily (scikit-learn's loader and split), warmed once for every child
dtrain.data.Digits("train")
dtrain.data.Digits("test")
# what every training process imports on building its optimizer (torch.optim's step wrappers), and what rank 0
# draws report.png with at the end
for module in ("torch._dynamo", "matplotlib.figure", "matplotlib.backends.backend_agg"):
    importlib.import_module(module)


def die_with_parent() -> None:
    """Linux: this process gets SIGKILL when its parent ends (``prctl(PR_SET_PDEATHSIG)``), so a runner
    whose pytest was stopped, or a command whose runner was, cannot run on alone."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: nothing to ask for
        return
    if os.getppid() == 1:  # the parent ended before the request took effect
        os._exit(1)


def snapshot(paths: list[str]) -> dict[str, str]:
    """``{file: sha256}`` of every file at or below ``paths``."""
    files = {}
    for root in map(Path, paths):
        for path in [root] if root.is_file() else (p for p in root.rglob("*") if p.is_file()):
            files[str(path)] = hashlib.sha256(path.read_bytes()).hexdigest()
    return files


def _exit_code(stop: SystemExit) -> int:
    """The process's exit status for ``SystemExit(code)``, as the interpreter sets it (a message goes to stderr)."""
    if stop.code is None:
        return 0
    if isinstance(stop.code, int):
        return stop.code
    print(stop.code, file=sys.stderr)
    return 1


def _child(argv: list[str], cwd: str, env: dict[str, str] | None, out: int, err: int, module: str = "dtrain",
           script: str | None = None) -> None:
    """In the forked child: ``python -m MODULE ARGV`` (or ``python SCRIPT ARGV``) in ``cwd``, then the
    interpreter's end; never returns."""
    code = 0
    try:
        os.setsid()  # its own process group: a timeout ends it with whatever it started
        die_with_parent()
        os.chdir(cwd)
        if env is not None:
            os.environ.clear()
            os.environ.update(env)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out, 1)
        os.dup2(err, 2)
        # python -m puts the working directory first (the runner put its own folder), python SCRIPT its folder
        sys.path[0] = str(Path(script).resolve().parent) if script else os.getcwd()
        extra = [entry for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep) if entry and entry not in sys.path]
        sys.path[1:1] = extra  # PYTHONPATH's entries come right after it, as at an interpreter's start
        if script:
            sys.argv = [script, *argv]
            runpy.run_path(script, run_name="__main__")
        else:
            sys.argv = ["-m", *argv]  # runpy sets argv[0] to the module's file, as -m does
            runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as stop:
        code = _exit_code(stop)
    except BaseException:  # as the interpreter would: traceback and exit code 1
        traceback.print_exc()
        code = 1
    try:  # what the interpreter does at its end
        threading._shutdown()  # noqa: SLF001 -- joins the non-daemon threads, as Py_FinalizeEx does
        atexit._run_exitfuncs()  # noqa: SLF001
    except BaseException:  # noqa: BLE001 -- an exit function's failure is printed, the status stays
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def run_one(argv: list[str], cwd: str, env: dict[str, str] | None = None, timeout: float | None = None,
            module: str = "dtrain", script: str | None = None) -> tuple[int, str, str, bool]:
    """``(exit code, stdout, stderr, timed out)`` of ``python -m MODULE ARGV`` (or ``python SCRIPT ARGV``) in a
    forked child."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        pid = os.fork()
        if pid == 0:
            _child(argv, cwd, env, out.fileno(), err.fileno(), module, script)
        deadline = None if timeout is None else time.monotonic() + timeout
        timed_out = False
        while True:
            done, status = os.waitpid(pid, 0 if deadline is None else os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                timed_out = True
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                _, status = os.waitpid(pid, 0)
                break
            time.sleep(0.05)
        out.seek(0)
        err.seek(0)
        return (os.waitstatus_to_exitcode(status), out.read().decode(errors="replace"),
                err.read().decode(errors="replace"), timed_out)


def main() -> None:
    die_with_parent()
    for line in sys.stdin:
        request = json.loads(line)
        before = snapshot(request.get("watch", []))
        code, stdout, stderr, timed_out = run_one(request["argv"], request["cwd"], request.get("env"),
                                                  request.get("timeout"), request.get("module", "dtrain"),
                                                  request.get("script"))
        after = snapshot(request.get("watch", []))
        changed = sorted(path for path, digest in before.items() if after.get(path) != digest)
        added = sorted(set(after) - set(before))
        print(json.dumps({"id": request.get("id"), "returncode": code, "stdout": stdout, "stderr": stderr,
                          "changed": changed, "added": added, "timed_out": timed_out}), flush=True)


if __name__ == "__main__":
    main()
