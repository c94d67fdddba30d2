"""Runs many ``python -m dtrain ARGS`` command lines fast: one interpreter imports dtrain once and
forks a fresh child per command line, which runs exactly what ``python -m dtrain`` runs.

Protocol: one JSON object per line on stdin, ``{"argv": [...], "cwd": "...", "watch": ["dir", ...], "id": ...}``;
for each, one JSON line on stdout: ``{"id", "returncode", "stdout", "stderr", "changed", "added"}``, where
``id`` is the request's own (``None`` without one), ``changed`` lists the files under the ``watch`` paths
whose bytes differ afterwards (or vanished) and ``added`` the files that appeared there.
Imports cost seconds on a small machine; a fork costs milliseconds, so a parametrized test of
dozens of bad inputs stays quick while each case still runs in its own process.
"""
from __future__ import annotations

import ctypes
import hashlib
import json
import os
import signal
import sys
import tempfile
import traceback
from pathlib import Path

import dtrain.cli  # noqa: F401 -- imported once here, inherited by every child
import dtrain.data
import dtrain.learners
import dtrain.models  # noqa: F401

# what the digits recipe loads lazily (scikit-learn's loader and split), warmed once for every child
dtrain.data.Digits("train")
dtrain.data.Digits("test")


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


def run_one(argv: list[str], cwd: str) -> tuple[int, str, str]:
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        pid = os.fork()
        if pid == 0:  # the child: python -m dtrain ARGV
            code = 0
            try:
                die_with_parent()
                os.chdir(cwd)
                os.dup2(out.fileno(), 1)
                os.dup2(err.fileno(), 2)
                sys.argv = ["dtrain", *argv]
                from dtrain.cli import main
                main()
            except SystemExit as stop:
                code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
            except BaseException:  # as the interpreter would: traceback and exit code 1
                traceback.print_exc()
                code = 1
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        out.seek(0)
        err.seek(0)
        return os.waitstatus_to_exitcode(status), out.read().decode(errors="replace"), err.read().decode(errors="replace")


def main() -> None:
    die_with_parent()
    for line in sys.stdin:
        request = json.loads(line)
        before = snapshot(request.get("watch", []))
        code, stdout, stderr = run_one(request["argv"], request["cwd"])
        after = snapshot(request.get("watch", []))
        changed = sorted(path for path, digest in before.items() if after.get(path) != digest)
        added = sorted(set(after) - set(before))
        print(json.dumps({"id": request.get("id"), "returncode": code, "stdout": stdout, "stderr": stderr, "changed": changed, "added": added}),
              flush=True)


if __name__ == "__main__":
    main()
