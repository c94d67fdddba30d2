"""Elastic block learners on torchft, with real processes on loopback (``docs/fault-tolerance.md``).

Each replica group is one process (``tests/helpers/elastic_group.py``), beside ``python -m dtrain.lighthouse``.
The per-sample ledger: every group appends the sample indices of each committed block; across the groups every
sample of the stream must appear exactly once per sweep, whoever was lost or joined.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.elastic_group import STREAM_SAMPLES
from tests.helpers.mpi import run_mpi

pytest.importorskip("torchft")

REPOSITORY = Path(__file__).resolve().parents[2]
#: a job of the slow tests: long enough that the others are still training when a group is restarted or joins
#: (about 2.5 s to start here, more on a busy machine): a group started after the job ended would be a job of its own
LONG_JOB = {"max_samples": 8 * STREAM_SAMPLES, "step_seconds": 0.25}


def _env() -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(REPOSITORY), OMP_NUM_THREADS="1")
    for key in [key for key in env if key.startswith(("OMPI_COMM_WORLD", "PMIX_", "PMI_"))]:
        del env[key]  # a group is its own world of one, whatever launched pytest
    return env


class Lighthouse:
    """``python -m dtrain.lighthouse`` on a free port, stopped at the end."""

    def __init__(self, tmp_path: Path, min_groups: int = 1):
        self.log = tmp_path / "lighthouse.log"
        self.process = subprocess.Popen([sys.executable, "-m", "dtrain.lighthouse", "--port", "0", "--min-groups",
                                         str(min_groups), "--heartbeat-timeout-s", "1.5", "--join-timeout-s", "1"],
                                        stdout=open(self.log, "w"), stderr=subprocess.STDOUT, env=_env())
        deadline = time.time() + 30
        while time.time() < deadline:
            found = re.search(r"lighthouse at (http://\S+)", self.log.read_text())
            if found:
                self.address = found.group(1)
                return
            time.sleep(0.1)
        raise AssertionError(f"no lighthouse address in {self.log.read_text()!r}")

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        self.process.wait(timeout=10)


def start_group(tmp_path: Path, lighthouse: Lighthouse, name: str, run_dir: str | None = None,
                **settings) -> subprocess.Popen:
    values = {"mode": "elastic", "learner": "local_sgd", "lighthouse": lighthouse.address, "replica_id": name,
              "run_dir": str(tmp_path / (run_dir or f"run-{name}")), "out": str(tmp_path), "max_samples": 192,
              "block_size": 32, "minibatch_size": 16, **settings}
    log = open(tmp_path / f"{run_dir or name}.log", "w")
    return subprocess.Popen([sys.executable, "-m", "tests.helpers.elastic_group", json.dumps(values)],
                            stdout=log, stderr=subprocess.STDOUT, env=_env())


def wait_all(tmp_path: Path, processes: dict[str, subprocess.Popen], timeout: float = 150) -> None:
    for name, process in processes.items():
        code = process.wait(timeout=timeout)
        assert code == 0, f"group {name} ended with {code}: {(tmp_path / f'{name}.log').read_text()[-3000:]}"


def events(tmp_path: Path, name: str) -> list[dict]:
    path = tmp_path / f"events-{name}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def wait_until(condition: Callable[[], Any], log: Path, timeout: float = 120) -> Any:
    """Polls ``condition()`` (a group's events, read from its file) until it is true and returns it; past ``timeout``
    seconds fails with the end of ``log``."""
    deadline = time.time() + timeout
    while not (found := condition()):
        assert time.time() < deadline, log.read_text()[-3000:]
        time.sleep(0.05)
    return found


def wait_for_commits(tmp_path: Path, name: str, count: int, timeout: float = 120) -> None:
    """Waits until group ``name`` has committed ``count`` syncs (its log in the failure)."""
    wait_until(lambda: sum(event["event"] == "commit" for event in events(tmp_path, name)) >= count,
               tmp_path / f"{name}.log", timeout)


def signal_mid_block(tmp_path: Path, process: subprocess.Popen, name: str, signum: int, after_commits: int) -> float:
    """Sends ``signum`` to group ``name`` inside the block after its ``after_commits``-th committed sync (a block is
    two minibatches of 0.25 s in :data:`LONG_JOB`); returns when."""
    wait_for_commits(tmp_path, name, after_commits)
    time.sleep(0.3)
    process.send_signal(signum)
    return time.time()


def wait_for_a_commit_of(tmp_path: Path, name: str, groups: int, after: float, timeout: float = 120) -> None:
    """Waits until group ``name`` has committed a sync of ``groups`` groups after time ``after`` (its log in the
    failure)."""
    wait_until(lambda: any(event["event"] == "commit" and event["groups"] == groups and event["time"] > after
                           for event in events(tmp_path, name)), tmp_path / f"{name}.log", timeout)


def ledger_counts(tmp_path: Path) -> Counter:
    counts: Counter = Counter()
    for path in tmp_path.glob("ledger-*.jsonl"):
        for line in path.read_text().splitlines():
            counts.update(json.loads(line)["indices"])
    return counts


def assert_every_sample_once_per_sweep(tmp_path: Path, max_samples: int) -> None:
    """The groups' ledgers, together: every sample of the stream trained exactly once per sweep."""
    counts = ledger_counts(tmp_path)
    assert counts == Counter({index: max_samples // STREAM_SAMPLES for index in range(STREAM_SAMPLES)}), counts


def params(tmp_path: Path, name: str) -> dict[str, torch.Tensor]:
    return torch.load(tmp_path / f"params-{name}.pt")


def assert_identical(first: dict, second: dict) -> None:
    assert first.keys() == second.keys()
    for key in first:
        assert torch.equal(first[key], second[key]), key


@pytest.mark.timeout(240)
@pytest.mark.parametrize("learner", ["local_sgd", "diloco"])
def test_no_failure_equals_the_non_elastic_learner(tmp_path, learner):
    """Two groups, nobody lost: the same parameters, bit for bit, as the learner under mpiexec -n 2, and the
    ledger has every sample once per sweep."""
    lighthouse = Lighthouse(tmp_path, min_groups=2)
    try:
        wait_all(tmp_path, {name: start_group(tmp_path, lighthouse, name, learner=learner) for name in "ab"})
    finally:
        lighthouse.stop()
    assert_every_sample_once_per_sweep(tmp_path, 192)
    assert_identical(params(tmp_path, "a"), params(tmp_path, "b"))
    records = [json.loads(line) for line in (tmp_path / "run-a" / "metrics.jsonl").read_text().splitlines()]
    syncs = [record for record in records if record["kind"] == "elastic"]  # every sync's participants, recorded
    assert [(r["event"], r["groups"], r["samples"]) for r in syncs] == [("commit", 2, 32 * (i + 1)) for i in range(6)]

    reference = tmp_path / "mpi"
    reference.mkdir()
    settings = {"mode": "mpi", "learner": learner, "run_dir": str(reference / "run"), "out": str(reference),
                "max_samples": 192, "block_size": 32, "minibatch_size": 16}
    result = run_mpi(2, ["-m", "tests.helpers.elastic_group", json.dumps(settings)], timeout=120)
    assert result.returncode == 0, result.report()
    assert_identical(params(tmp_path, "a"), torch.load(reference / "params-rank0.pt"))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_group_killed_mid_block_then_restarted_rejoins(tmp_path):
    """Three groups; one is SIGKILLed in the middle of a block: the others go on (the block is discarded and read
    again by the two present). Restarted, the group rejoins by itself, heals from a live peer, and ends with the
    others' parameters bit for bit; the ledger has every sample exactly once per sweep."""
    lighthouse = Lighthouse(tmp_path)
    max_samples, common = LONG_JOB["max_samples"], LONG_JOB
    try:
        groups = {name: start_group(tmp_path, lighthouse, name, **common) for name in "abc"}
        killed_at = signal_mid_block(tmp_path, groups["c"], "c", signal.SIGKILL, after_commits=3)
        groups["c"].wait()
        time.sleep(1.0)
        restarted_at = time.time()
        groups["c2"] = start_group(tmp_path, lighthouse, "c", run_dir="run-c2", **common)
        del groups["c"]
        wait_all(tmp_path, {"a": groups["a"], "b": groups["b"]})
        code = groups["c2"].wait(timeout=120)
        assert code == 0, (tmp_path / "run-c2.log").read_text()[-3000:]
    finally:
        lighthouse.stop()

    assert_every_sample_once_per_sweep(tmp_path, max_samples)
    survivors = events(tmp_path, "a")
    assert any(event["event"] == "discard" for event in survivors), survivors
    after_loss = [event for event in survivors if event["event"] == "commit" and event["time"] > killed_at]
    assert after_loss and after_loss[0]["groups"] == 2, after_loss
    recorded = [json.loads(line) for line in (tmp_path / "run-a" / "metrics.jsonl").read_text().splitlines()]
    assert "discard" in [record.get("event") for record in recorded if record["kind"] == "elastic"], recorded
    healed = [json.loads(line) for line in (tmp_path / "run-c2" / "metrics.jsonl").read_text().splitlines()]
    assert [record["event"] for record in healed if record["kind"] == "elastic"][:1] == ["heal"], healed
    rejoined = [event for event in events(tmp_path, "c") if event["time"] > restarted_at]
    assert [event["event"] for event in rejoined][:1] == ["heal"], rejoined
    first_commit = next(event for event in rejoined if event["event"] == "commit")
    assert any(event["event"] == "commit" and event["groups"] == 3 and event["time"] > restarted_at
               for event in survivors)
    assert_identical(params(tmp_path, "a"), params(tmp_path, "b"))
    assert_identical(params(tmp_path, "a"), params(tmp_path, "c"))
    print(f"\nfigures: kill to the survivors' next committed sync {after_loss[0]['time'] - killed_at:.2f} s; "
          f"restart to the rejoined group's first commit {first_commit['time'] - restarted_at:.2f} s "
          f"(process start, imports and healing included)")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_group_of_another_config_is_refused_when_it_joins_and_the_job_goes_on(tmp_path):
    """A group started with another block size (another job's config) asks to join a running job: its first
    round's heal says in one line what differs and it ends; the two groups of the job finish with one model and
    every sample once per sweep."""
    lighthouse = Lighthouse(tmp_path)
    max_samples, common = LONG_JOB["max_samples"], LONG_JOB
    try:
        groups = {name: start_group(tmp_path, lighthouse, name, **common) for name in "ab"}
        wait_for_commits(tmp_path, "a", 2)
        other = start_group(tmp_path, lighthouse, "x", **{**common, "block_size": 64})
        assert other.wait(timeout=120) != 0
        wait_all(tmp_path, groups)
    finally:
        lighthouse.stop()
    refusal = [line for line in (tmp_path / "x.log").read_text().splitlines() if "is not of the running job" in line]
    assert refusal and "learner.block_size is 32 in the job, 64 here" in refusal[-1], \
        (tmp_path / "x.log").read_text()[-3000:]
    assert_identical(params(tmp_path, "a"), params(tmp_path, "b"))
    assert_every_sample_once_per_sweep(tmp_path, max_samples)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_new_group_joins_a_running_job_while_nobody_failed(tmp_path):
    """Scale up: two groups train, a third of a new name starts mid-run. It heals from a live peer at the others'
    next sync and trains with them from there (commits of 3 groups); all three end with one model bit for bit and
    every sample exactly once per sweep."""
    lighthouse = Lighthouse(tmp_path)
    max_samples, common = LONG_JOB["max_samples"], LONG_JOB
    try:
        groups = {name: start_group(tmp_path, lighthouse, name, **common) for name in "ab"}
        wait_for_commits(tmp_path, "a", 3)
        joined_at = time.time()
        groups["c"] = start_group(tmp_path, lighthouse, "c", **common)
        wait_all(tmp_path, groups)
    finally:
        lighthouse.stop()
    assert_every_sample_once_per_sweep(tmp_path, max_samples)
    joiner = events(tmp_path, "c")
    assert [event["event"] for event in joiner][:1] == ["heal"], joiner
    assert any(event["event"] == "commit" and event["groups"] == 3 and event["time"] > joined_at
               for event in events(tmp_path, "a"))
    assert not any(event["event"] == "discard" for name in "abc" for event in events(tmp_path, name))
    assert_identical(params(tmp_path, "a"), params(tmp_path, "b"))
    assert_identical(params(tmp_path, "a"), params(tmp_path, "c"))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_groups_lost_one_after_the_other_leave_the_last_to_finish_the_stream(tmp_path):
    """Two failures in a row: of three groups, one is SIGKILLed mid-block, and once the two left have committed a
    sync, a second; the last group goes on alone and the ledger still has every sample exactly once per sweep."""
    lighthouse = Lighthouse(tmp_path)
    max_samples, common = LONG_JOB["max_samples"], LONG_JOB
    try:
        groups = {name: start_group(tmp_path, lighthouse, name, **common) for name in "abc"}
        first_loss = signal_mid_block(tmp_path, groups.pop("c"), "c", signal.SIGKILL, after_commits=2)
        wait_for_a_commit_of(tmp_path, "a", groups=2, after=first_loss)
        time.sleep(0.3)
        groups.pop("b").send_signal(signal.SIGKILL)
        second_loss = time.time()
        wait_all(tmp_path, groups)
    finally:
        lighthouse.stop()
    assert_every_sample_once_per_sweep(tmp_path, max_samples)
    alone = [event for event in events(tmp_path, "a") if event["event"] == "commit" and event["time"] > second_loss]
    assert alone and all(event["groups"] == 1 for event in alone), alone


def test_fewer_groups_than_min_groups_end_in_one_line_after_the_quorum_timeout(tmp_path):
    """One group started where ``fault_tolerance.min_groups=2``: its rounds cannot commit and torchft retries them
    at once; the group says it waits, then ends after ``quorum_timeout_s`` with one line (exit 2) instead of
    retrying for ever, leaving no run directory behind."""
    lighthouse = Lighthouse(tmp_path)
    run_dir = tmp_path / "run-a"
    try:
        started = time.monotonic()
        result = subprocess.run(
            [sys.executable, "-m", "dtrain", "+recipe=digits", "learner=diloco", "learner.block_size=640",
             "learner.distributed_after=0", "session.max_samples=3200", "fault_tolerance.enabled=true",
             f"fault_tolerance.lighthouse={lighthouse.address}", "fault_tolerance.replica_id=a",
             "fault_tolerance.min_groups=2", "fault_tolerance.quorum_timeout_s=3", f"run_dir={run_dir}"],
            capture_output=True, text=True, env=_env(), timeout=120)
        seconds = time.monotonic() - started
    finally:
        lighthouse.stop()
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert "waiting at a sync for groups: 1 present, fault_tolerance.min_groups=2" in result.stdout, result.stdout
    errors = [line for line in result.stderr.splitlines() if line.startswith("dtrain: error")]
    assert errors == ["dtrain: error: fault_tolerance.min_groups=2: only 1 group has taken part in this sync's rounds "
                      "for 3 s (fault_tolerance.quorum_timeout_s); start at least 2 groups, or lower "
                      "fault_tolerance.min_groups"], result.stderr[-2000:]
    assert seconds < 60
    assert not run_dir.exists()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_stopped_group_is_dropped_and_the_job_goes_on_then_it_rejoins_when_continued(tmp_path):
    """Three groups; one is SIGSTOPped mid-block (alive but silent, as a hung host): its heartbeats stop, the two
    others' next round leaves it out (1.8 s here: the Lighthouse's 1.5 s heartbeat timeout; bounded below by the
    groups' 10 s timeout plus a round), the block is discarded and they commit on without it. SIGCONTed, the
    stopped group finds its round gone, heals from a live peer and ends with the others' parameters bit for bit;
    the ledger has every sample exactly once per sweep."""
    lighthouse = Lighthouse(tmp_path)
    max_samples, common = LONG_JOB["max_samples"], LONG_JOB
    try:
        groups = {name: start_group(tmp_path, lighthouse, name, **common) for name in "abc"}
        stopped_at = signal_mid_block(tmp_path, groups["c"], "c", signal.SIGSTOP, after_commits=3)
        wait_for_a_commit_of(tmp_path, "a", groups=2, after=stopped_at)
        dropped_after = time.time() - stopped_at
        groups["c"].send_signal(signal.SIGCONT)
        continued_at = time.time()
        wait_all(tmp_path, groups)
    finally:
        for process in groups.values():
            if process.poll() is None:
                process.send_signal(signal.SIGCONT)
        lighthouse.stop()
    assert dropped_after < 10 + 8, dropped_after  # the groups' 10 s timeout, then a quorum without it
    assert_every_sample_once_per_sweep(tmp_path, max_samples)
    assert any(event["event"] == "discard" for event in events(tmp_path, "a"))
    continued = [event["event"] for event in events(tmp_path, "c") if event["time"] > continued_at]
    assert "heal" in continued and continued[-1] == "commit", continued
    assert_identical(params(tmp_path, "a"), params(tmp_path, "b"))
    assert_identical(params(tmp_path, "a"), params(tmp_path, "c"))
    print(f"\nfigures: stop to the others' next committed sync {dropped_after:.2f} s")


def _kill_during_a_heal(tmp_path: Path, victim: str) -> tuple[str, float]:
    """Groups a and b train (each pausing 3 s before it sends a heal), c joins; once a or b is serving c's heal,
    ``victim`` (``server``: that group, ``joiner``: c) is SIGKILLed and the others run to their end. Returns the
    server's name and the time of the kill."""
    lighthouse = Lighthouse(tmp_path)
    common = {**LONG_JOB, "serve_heal_seconds": 3.0}
    try:
        groups = {name: start_group(tmp_path, lighthouse, name, **common) for name in "ab"}
        wait_for_commits(tmp_path, "a", 3)
        joined_at = time.time()
        groups["c"] = start_group(tmp_path, lighthouse, "c", **common)
        server, = wait_until(lambda: [name for name in "ab" if any(  # not the heal of b's first round, from a
            event["event"] == "serving" and event["time"] > joined_at for event in events(tmp_path, name))],
            tmp_path / "c.log")
        groups.pop(server if victim == "server" else "c").send_signal(signal.SIGKILL)
        killed_at = time.time()
        wait_all(tmp_path, groups)
    finally:
        lighthouse.stop()
    return server, killed_at


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_group_serving_a_heal_killed_while_it_serves_leaves_the_joiner_to_heal_from_another(tmp_path):
    """Two groups train and a third joins; the group torchft chooses to heal it is SIGKILLed while it serves. The
    round fails: the survivor discards its block when the lost group's collective times out (the groups' 10 s
    timeout: that round had already formed with it), and in the next round the joiner heals from the survivor. The
    two end with one model bit for bit and the ledger has every sample exactly once per sweep."""
    server, killed_at = _kill_during_a_heal(tmp_path, "server")
    survivor = "b" if server == "a" else "a"
    assert_every_sample_once_per_sweep(tmp_path, LONG_JOB["max_samples"])
    joined = [event["event"] for event in events(tmp_path, "c")]
    assert "heal" in joined and joined[-1] == "commit", joined
    healed_at = next(event["time"] for event in events(tmp_path, "c") if event["event"] == "heal")
    assert healed_at > killed_at, (healed_at, killed_at)  # from the survivor, after the server was lost
    served = [event["time"] for event in events(tmp_path, survivor) if event["event"] == "serving"]
    assert any(time_ > killed_at for time_ in served), served
    discarded = next(event["time"] for event in events(tmp_path, survivor)
                     if event["event"] == "discard" and event["time"] > killed_at)
    print(f"\nfigures: the server's loss to the survivor's discard {discarded - killed_at:.2f} s, to the joiner's heal "
          f"{healed_at - killed_at:.2f} s")
    assert any(event["event"] == "commit" and event["groups"] == 2 and event["time"] > killed_at
               for event in events(tmp_path, survivor))
    assert_identical(params(tmp_path, survivor), params(tmp_path, "c"))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_joiner_killed_while_it_is_healed_leaves_the_job_as_it_was(tmp_path):
    """Two groups train and a third joins; the joiner is SIGKILLed while a peer serves its heal. The two go on
    without it (the round it was in is discarded or commits without it), end with one model bit for bit, and the
    ledger has every sample exactly once per sweep: the dead joiner never committed a block."""
    _, killed_at = _kill_during_a_heal(tmp_path, "joiner")
    assert_every_sample_once_per_sweep(tmp_path, LONG_JOB["max_samples"])
    assert not any(event["event"] == "commit" for event in events(tmp_path, "c"))
    after = [event for event in events(tmp_path, "a") if event["event"] in ("commit", "discard")
             and event["time"] > killed_at]
    assert after and after[-1]["event"] == "commit" and after[-1]["groups"] == 2, after
    print(f"\nfigures: the joiner's loss to the others' next committed sync "
          f"{next(event['time'] for event in after if event['event'] == 'commit') - killed_at:.2f} s")
    assert_identical(params(tmp_path, "a"), params(tmp_path, "b"))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_group_killed_mid_sync_is_dropped_and_the_sync_discarded(tmp_path):
    """Three groups; one is SIGKILLed in the middle of a sync (between the round's two all-reduces: it pauses there
    3 s, here). That round fails for all: the two others discard their block, train it again and commit on without
    the lost group; they end with one model bit for bit and the ledger has every sample exactly once per sweep."""
    lighthouse = Lighthouse(tmp_path)
    try:
        groups = {name: start_group(tmp_path, lighthouse, name, **LONG_JOB) for name in "ab"}
        groups["c"] = start_group(tmp_path, lighthouse, "c", **LONG_JOB, pause_in_sync_after_commits=3)
        wait_until(lambda: any(event["event"] == "syncing" for event in events(tmp_path, "c")), tmp_path / "c.log")
        groups.pop("c").send_signal(signal.SIGKILL)
        killed_at = time.time()
        wait_all(tmp_path, groups)
    finally:
        lighthouse.stop()
    assert_every_sample_once_per_sweep(tmp_path, LONG_JOB["max_samples"])
    after = [event for event in events(tmp_path, "a") if event["event"] in ("commit", "discard")
             and event["time"] > killed_at]
    assert after[0]["event"] == "discard", after  # the sync the lost group was in
    first_commit = next(event for event in after if event["event"] == "commit")
    assert first_commit["groups"] == 2, after
    print(f"\nfigures: a kill mid-sync to the others' next committed sync {first_commit['time'] - killed_at:.2f} s")
    assert_identical(params(tmp_path, "a"), params(tmp_path, "b"))


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_an_elastic_runs_checkpoint_continues_in_a_plain_run_and_the_other_way_round(tmp_path):
    """Checkpoints carry over between elastic and plain runs (the same learner): a plain DiLoCo run's checkpoint at
    1,280 samples continued by one elastic group, and an elastic group's continued by a plain run, each say what
    changed and end at 1,920 samples where the uninterrupted run of the other kind does (to the last bits: one
    group alone computes ``W_prev - (W_prev - W)`` where the plain learner keeps ``W``)."""
    from safetensors.torch import load_file

    from tests.helpers.cli import run_dtrain

    lighthouse = Lighthouse(tmp_path)
    common = ["+recipe=digits", "learner=diloco", "learner.block_size=640", "learner.distributed_after=0",
              "session.checkpoint.frequency=640", "session.max_samples=1920", "session.tensorboard=false"]
    elastic = ["fault_tolerance.enabled=true", f"fault_tolerance.lighthouse={lighthouse.address}",
               "fault_tolerance.replica_id=a"]

    def run(name: str, *overrides: str) -> str:
        result = run_dtrain(*common, *overrides, f"run_dir={tmp_path / name}", cwd=tmp_path,
                            env={"OMP_NUM_THREADS": "1"})
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        return result.stdout

    try:
        run("plain")
        run("elastic", *elastic)
        from_plain = run("elastic_from_plain", *elastic,
                         f"session.checkpoint.restore_from={tmp_path / 'plain' / 'checkpoint-1280.pt'}")
        from_elastic = run("plain_from_elastic",
                           f"session.checkpoint.restore_from={tmp_path / 'elastic' / 'checkpoint-1280.pt'}")
    finally:
        lighthouse.stop()
    assert "at 1280 samples" in from_plain and "fault_tolerance.enabled: False -> True" in from_plain, from_plain
    assert "at 1280 samples" in from_elastic and "fault_tolerance.enabled: True -> False" in from_elastic, from_elastic
    for continued, uninterrupted in (("elastic_from_plain", "plain"), ("plain_from_elastic", "elastic")):
        got = load_file(tmp_path / continued / "model.safetensors")
        expected = load_file(tmp_path / uninterrupted / "model.safetensors")
        assert got.keys() == expected.keys()
        for name, tensor in expected.items():
            if tensor.is_floating_point():
                gap = float((got[name] - tensor).abs().max() / tensor.abs().max().clamp_min(1e-12))
                assert gap < 1e-5, f"{continued} against {uninterrupted}: {name} {gap}"
