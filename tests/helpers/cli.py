"""Running ``python -m dtrain`` as a user would from a shell: one process, no launcher."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.helpers.mpi import plain_environment


def run_dtrain(*args: str, cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    """Run ``python -m dtrain ARGS`` in ``cwd`` without any launcher's variables; return it finished
    (``stdout``/``stderr`` as text). Raises ``subprocess.TimeoutExpired`` past ``timeout`` seconds."""
    return subprocess.run([sys.executable, "-m", "dtrain", *args], cwd=cwd, env=plain_environment(),
                          capture_output=True, text=True, timeout=timeout)
