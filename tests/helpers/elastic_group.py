"""One replica group of an elastic test job (or one rank of the same job without elasticity, under mpiexec).

``python -m tests.helpers.elastic_group SETTINGS_JSON``; the settings: ``mode`` (``elastic`` or ``mpi``),
``learner`` (``local_sgd``, ``diloco``; ``block_momentum`` for its refusal), ``lighthouse``, ``replica_id``, ``run_dir``,
``out`` (a folder), ``max_samples``, ``block_size``, ``minibatch_size``, ``step_seconds`` (a pause in each
forward, so a test can kill a group mid-block), ``min_groups``, ``serve_heal_seconds`` (a pause before the
group's state is sent to a joiner, after an event ``serving``, so a test can kill the group serving a heal),
``pause_in_sync_after_commits`` (once this many syncs are committed, the next sync pauses 3 s between its first and
its second all-reduce, after an event ``syncing``, so a test can kill a group mid-sync).

The per-sample ledger: every sample carries its index in its last feature; the model notes the indices of each
training forward, and the group appends the notes of a block to ``OUT/ledger-REPLICA.jsonl`` when the block is
committed (dropped when it is discarded). At the end it writes ``OUT/params-REPLICA.pt`` (the model's parameters)
and ``OUT/result-REPLICA.json``.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

from dtrain import MinibatchSource, TestConfig, training_session
from dtrain.data import ArrayDeserializer

#: samples in the test stream (a sweep)
STREAM_SAMPLES = 96


class LedgerModel(torch.nn.Module):
    """A small MLP over the features but the last, which is the sample's index (noted while training)."""

    def __init__(self, step_seconds: float = 0.0):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
        self.step_seconds = step_seconds
        self.pending: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.pending.extend(int(i) for i in x[:, -1].tolist())
            if self.step_seconds:
                time.sleep(self.step_seconds)
        return self.net(x[:, :-1])


def stream() -> ArrayDeserializer:
    generator = np.random.default_rng(0)
    features = generator.normal(size=(STREAM_SAMPLES, 6)).astype(np.float32)
    labels = (features[:, 0] + features[:, 1] > 0).astype(np.int64) + 2 * (features[:, 2] > 0.5)
    indexed = np.concatenate([features, np.arange(STREAM_SAMPLES, dtype=np.float32)[:, None]], axis=1)
    return ArrayDeserializer(indexed, labels, num_classes=4)


def build_learner(settings: dict, optimizer, comm):
    from dtrain.learners.block_momentum import BlockMomentumLearner
    from dtrain.learners.diloco import DiLoCoLearner
    from dtrain.learners.local_sgd import LocalSGDLearner

    common = {"block_size": settings["block_size"], "distributed_after": 0}
    if settings["learner"] == "local_sgd":
        return LocalSGDLearner(optimizer, comm, **common)
    if settings["learner"] == "diloco":
        return DiLoCoLearner(optimizer, comm, **common)
    return BlockMomentumLearner(optimizer, comm, **common)


def main() -> None:
    settings = json.loads(sys.argv[1])
    out = Path(settings["out"])
    torch.manual_seed(0)
    model = LedgerModel(settings.get("step_seconds", 0.0))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    comm = None
    if settings["mode"] == "mpi":
        from dtrain import create_communicator

        comm = create_communicator()
        name = f"rank{comm.rank}"
    else:
        name = settings["replica_id"]
    learner = build_learner(settings, optimizer, comm)
    ledger = out / f"ledger-{name}.jsonl"
    if settings["mode"] == "elastic":
        from dtrain.learners.elastic import ElasticGroups

        serve_heal_seconds = settings.get("serve_heal_seconds", 0.0)

        class Groups(ElasticGroups):
            def heal_state(self) -> dict:  # torchft calls it in the round where this group serves a joiner
                if serve_heal_seconds:
                    note("serving", {})
                    time.sleep(serve_heal_seconds)
                return super().heal_state()

        groups = Groups(settings["lighthouse"], name, min_groups=settings.get("min_groups", 1), timeout_s=10,
                        quorum_timeout_s=120)

        def note(event: str, facts: dict) -> None:
            if event == "commit":
                with open(ledger, "a") as file:
                    file.write(json.dumps({"samples_seen": facts["samples_seen"], "groups": facts["groups"],
                                           "indices": model.pending}) + "\n")
            if event in ("commit", "discard", "heal"):
                model.pending = []
            with open(out / f"events-{name}.jsonl", "a") as file:
                file.write(json.dumps({"event": event, "time": time.time(), **facts}) + "\n")

        groups.listeners.append(note)
        pause_after = settings.get("pause_in_sync_after_commits")
        if pause_after is not None:
            allreduce, state = groups.manager.allreduce, {"calls": 0, "paused": False}

            def paused_allreduce(tensor, *args, **kwargs):  # each round all-reduces its header, then its deltas
                state["calls"] += 1
                if state["calls"] % 2 == 0 and groups.commits >= pause_after and not state["paused"]:
                    state["paused"] = True
                    note("syncing", {})
                    time.sleep(3.0)
                return allreduce(tensor, *args, **kwargs)

            groups.manager.allreduce = paused_allreduce
        learner.make_elastic(groups)
    source = MinibatchSource(stream(), randomize=True, randomization_seed=0)
    result = training_session(model, torch.nn.functional.cross_entropy, learner, source,
                              minibatch_size=settings["minibatch_size"], max_samples=settings["max_samples"],
                              progress_frequency=settings["block_size"], run_dir=settings["run_dir"],
                              tensorboard=False,  # the final model judged on the stream (a tiny run's loss is noisy)
                              test_config=TestConfig(MinibatchSource(stream(), randomize=False, max_sweeps=1))).train()
    if settings["mode"] == "mpi":  # the non-elastic job's ledger: every rank's samples
        with open(ledger, "a") as file:
            file.write(json.dumps({"indices": model.pending}) + "\n")
    torch.save({key: value.detach().clone() for key, value in model.state_dict().items()},
               out / f"params-{name}.pt")
    (out / f"result-{name}.json").write_text(json.dumps({"samples_seen": result.samples_seen, "pid": os.getpid()}))
    if comm is not None:
        comm.finalize()


if __name__ == "__main__":
    main()
