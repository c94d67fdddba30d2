"""Samples/s and page faults per step with glibc malloc's own thresholds against dtrain's fixed ones.

    python benchmarks/host_memory.py                          # cifar ConvNet and digits, 3 rounds
    python benchmarks/host_memory.py --model cifar --rounds 5 --samples 3200

A training step frees and allocates the same large CPU tensors every time; with glibc's adaptive
thresholds each step can fault its memory in again from the kernel. ``python -m dtrain`` fixes
the thresholds at start-up (``dtrain/host_memory.py``, ``session.keep_host_memory``). Each
measurement here is a fresh process (the setting cannot be undone in one), with glibc's defaults
or with ``keep_freed_host_memory()``, which runs the hand-written loop and the ``training_session``
of ``session_overhead.py`` on the same model and data (1 torch thread). Rounds alternate the two
settings; the table gives medians of samples/s, minor page faults per training step, and the
process's peak memory (max RSS).
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys

SETTINGS = ("glibc", "kept")


def measure(model: str, setting: str, samples: int, threads: int) -> dict:
    """Runs in the child process: both loops under ``setting``; rates, faults per step and max RSS."""
    import torch

    import session_overhead
    from dtrain.host_memory import keep_freed_host_memory

    if setting == "kept" and not keep_freed_host_memory().kept:
        raise SystemExit("the thresholds could not be fixed here (not glibc, or MALLOC_* variables set)")
    torch.set_num_threads(threads)
    features, labels = session_overhead.make_data(session_overhead.MODELS[model][1], 10000)
    steps = samples / session_overhead.MODELS[model][2]
    session_overhead.hand_written_loop(model, features, labels, session_overhead.MODELS[model][2] * 5)  # warm-up

    def faults() -> int:
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

    before = faults()
    hand = session_overhead.hand_written_loop(model, features, labels, samples)
    hand_faults = (faults() - before) / steps
    before = faults()
    session = session_overhead.dtrain_session(model, features, labels, samples)[0]
    session_faults = (faults() - before) / steps  # the session's one-off set-up and end included
    return {"hand": hand, "session": session, "hand_faults": hand_faults, "session_faults": session_faults,
            "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def run_child(model: str, setting: str, samples: int, threads: int) -> dict:
    command = [sys.executable, __file__, "--child", setting, "--model", model, "--samples", str(samples),
               "--threads", str(threads)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["cifar", "digits", "all"], default="all")
    parser.add_argument("--samples", type=int, default=None, help="samples per loop (default: per model)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating processes of each setting")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--child", choices=SETTINGS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.model, args.child, args.samples, args.threads)))
        return
    print(f"{args.threads} torch thread(s), {args.rounds} alternating rounds, one process per measurement")
    print(f"{'model':<7} {'malloc':<6} {'hand loop /s':>13} {'session /s':>11} {'faults/step hand':>17} "
          f"{'session':>8} {'max RSS MB':>11}")
    for model in (["cifar", "digits"] if args.model == "all" else [args.model]):
        samples = args.samples or {"cifar": 1920, "digits": 20000}[model]
        results = {setting: [] for setting in SETTINGS}
        for index in range(args.rounds):
            for setting in SETTINGS if index % 2 == 0 else reversed(SETTINGS):
                results[setting].append(run_child(model, setting, samples, args.threads))
        medians = {setting: {key: statistics.median(run[key] for run in runs) for key in runs[0]}
                   for setting, runs in results.items()}
        for setting, median in medians.items():
            print(f"{model:<7} {setting:<6} {median['hand']:>13,.0f} {median['session']:>11,.0f} "
                  f"{median['hand_faults']:>17,.1f} {median['session_faults']:>8,.1f} {median['max_rss_mb']:>11,.0f}")
        kept, glibc = medians["kept"], medians["glibc"]
        print(f"{model:<7} {'kept/glibc':<10} {kept['hand'] / glibc['hand']:>9.3f} "
              f"{kept['session'] / glibc['session']:>11.3f} {'':>17} {'':>8} "
              f"{kept['max_rss_mb'] / glibc['max_rss_mb']:>11.3f}")


if __name__ == "__main__":
    main()
