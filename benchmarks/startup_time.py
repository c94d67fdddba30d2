"""Time from the command to the first minibatch of ``python -m dtrain +recipe=digits``, one process and
``mpiexec -n 2``, phase by phase; and what ``import dtrain.cli`` imports.

    python benchmarks/startup_time.py                   # 1 and 2 processes, 3 rounds each, medians
    python benchmarks/startup_time.py --processes 1 --rounds 5

Each round starts the real command line in a fresh process (``mpiexec -n 2 python
benchmarks/startup_time.py --worker ...`` for two); the worker notes the wall clock at each
phase of dtrain's own ``main()`` (by wrapping the functions that begin and end them) and writes
them to a JSON file for this script, which prints the times since the command started: the
interpreter coming up, ``import torch``, the rest of ``import dtrain.cli`` (Hydra, OmegaConf, rich,
dtrain), the command-line checks and Hydra's config composition, the communicator, building the
model and learner, loading the training data, the session's set-up up to the first minibatch, and
the first minibatch itself. A second table runs ``python -X importtime -c "import dtrain.cli"``
and gives the cumulative import time of each heavy package, and which optional ones (matplotlib,
TensorBoard, DALI, safetensors, optuna, mpi4py) a one-process run does NOT import before training.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PHASES = [  # (key, label): each is the time from the previous mark to this one
    ("python", "interpreter up"),
    ("torch", "import torch"),
    ("dtrain", "import dtrain.cli (hydra, rich, ...)"),
    ("config", "checks + Hydra compose"),
    ("comm", "communicator"),
    ("model", "model, optimizer, learner"),
    ("data", "training data loaded"),
    ("session", "session set-up"),
    ("first", "first minibatch"),
]

#: packages whose cumulative import time the second table shows; the lazy ones should be absent
HEAVY = ["torch", "numpy", "hydra", "omegaconf", "rich", "PIL", "mpi4py"]
LAZY = ["matplotlib", "tensorboard", "torch.utils.tensorboard", "nvidia.dali", "safetensors", "optuna", "mpi4py"]


def worker(marks_path: str, arguments: list[str]) -> None:
    """Runs ``dtrain.cli.main()`` on ``arguments``, noting the wall clock at each phase; rank 0 writes them to
    ``marks_path`` as JSON."""
    marks = {"python": time.time()}
    import torch  # noqa: F401 - timed

    marks["torch"] = time.time()
    import dtrain.build as build
    import dtrain.cli as cli
    from dtrain.session import minibatch_step

    marks["dtrain"] = time.time()

    def wrap(module, name, before=None, after=None):
        original = getattr(module, name)

        def wrapper(*args, **kwargs):
            if before:
                before(args, kwargs)
            result = original(*args, **kwargs)
            if after:
                after(args, kwargs)
            return result

        setattr(module, name, wrapper)

    wrap(cli, "run", before=lambda a, k: marks.setdefault("config", time.time()))
    wrap(cli, "create_communicator", after=lambda a, k: marks.setdefault("comm", time.time()))
    wrap(build, "_instantiate", before=lambda a, k: marks.setdefault("model", time.time())
         if "source.train" in (a[1] if len(a) > 1 else k.get("what", "")) else None,
         after=lambda a, k: marks.setdefault("data", time.time())
         if "source.train" in (a[1] if len(a) > 1 else k.get("what", "")) else None)
    wrap(minibatch_step.MinibatchStep, "train", before=lambda a, k: marks.setdefault("session", time.time()),
         after=lambda a, k: marks.setdefault("first", time.time()))
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMI_RANK", "0")))
    sys.argv = ["dtrain", *arguments]
    try:
        cli.main()
    except SystemExit:
        pass
    if rank == 0:
        Path(marks_path).write_text(json.dumps(marks))


def one_round(processes: int) -> dict[str, float]:
    """Seconds of each phase (and ``total``) of one run of the digits recipe."""
    environment = dict(os.environ)
    with tempfile.TemporaryDirectory() as run_dir:
        arguments = ["+recipe=digits", f"run_dir={run_dir}", "session.max_samples=64", "session.progress_frequency=0",
                     "session.checkpoint.frequency=0", "session.tensorboard=false", "session.progress_bar=false"]
        marks_path = Path(run_dir) / "startup_marks.json"  # beside the run's files, removed with them
        command = [sys.executable, os.path.abspath(__file__), "--worker", str(marks_path), *arguments]
        if processes > 1:
            mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
            command = [mpiexec if os.path.exists(mpiexec) else "mpiexec", "-n", str(processes), "--oversubscribe",
                       *command]
        start = time.time()
        done = subprocess.run(command, capture_output=True, text=True, env=environment, timeout=600)
        if done.returncode != 0 or not marks_path.is_file():
            raise SystemExit(f"{' '.join(command)} failed ({done.returncode}):\n{done.stdout[-2000:]}"
                             f"{done.stderr[-2000:]}")
        marks = json.loads(marks_path.read_text())
    seconds, previous = {}, start
    for key, _ in PHASES:
        seconds[key] = marks[key] - previous
        previous = marks[key]
    seconds["total"] = marks["first"] - start
    return seconds


#: one line of ``python -X importtime``'s report: "import time: self [us] | cumulative | imported package".
#: Python reports it on stderr only, so it is parsed; a report without such lines stops the script
IMPORT_TIME = re.compile(r"import time:\s+\d+ \|\s+(\d+) \|( *)(\S+)")


def import_table() -> list[tuple[str, float | None]]:
    """Cumulative seconds of each heavy package in ``import dtrain.cli`` (``None``: not imported)."""
    done = subprocess.run([sys.executable, "-X", "importtime", "-c", "import dtrain.cli"], capture_output=True,
                          text=True, timeout=300)
    cumulative: dict[str, float] = {}
    for line in done.stderr.splitlines():
        match = IMPORT_TIME.match(line)
        if match:
            cumulative.setdefault(match.group(3), int(match.group(1)) / 1e6)
    if done.returncode != 0 or "dtrain.cli" not in cumulative:
        raise SystemExit(f"python -X importtime -c 'import dtrain.cli' (exit {done.returncode}) reported no "
                         f"{IMPORT_TIME.pattern!r} line for dtrain.cli:\n{done.stderr[-2000:]}")
    return [(name, cumulative.get(name)) for name in [*HEAVY, "dtrain", "dtrain.cli",
                                                        *[n for n in LAZY if n not in HEAVY]]]


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3:])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    results = {n: [] for n in args.processes}
    for _ in range(args.rounds):  # alternate, so machine noise hits every column
        for processes in args.processes:
            results[processes].append(one_round(processes))
    print(f"{os.cpu_count()} CPUs, python -m dtrain +recipe=digits, median of {args.rounds} rounds (seconds)")
    print(f"{'phase':<38}" + "".join(f"{f'{n} process' + ('es' if n > 1 else ''):>14}" for n in args.processes))
    for key, label in [*PHASES, ("total", "command -> first minibatch done")]:
        print(f"{label:<38}" + "".join(f"{statistics.median(r[key] for r in results[n]):>14.2f}"
                                       for n in args.processes))
    print()
    print("python -X importtime -c 'import dtrain.cli': cumulative seconds of each package (one run)")
    for name, seconds in import_table():
        print(f"  {name:<26} {'not imported' if seconds is None else f'{seconds:.3f}'}")


if __name__ == "__main__":
    main()
