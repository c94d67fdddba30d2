"""Worker run by tests/dist/test_shards_mpi.py under mpiexec:
``python _shard_ledger_worker.py KIND SHARDS RUN_DIR MAX_SAMPLES LEDGER_DIR``.

Trains a data-parallel model for ``MAX_SAMPLES`` samples (token steps) on shards of ``KIND`` (``parquet``
or ``tar``) through ``training_session``, checkpointing into ``RUN_DIR`` (so a second launch at another
world size resumes there), and writes each rank's ledger: the (timeline position, sample id) of every
sequence the model was given in training, in ``LEDGER_DIR/rank{r}.json``.
"""
from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import torch

import dtrain
from dtrain.comm import create_communicator
from dtrain.data import MinibatchSource, ParquetShards, TarShards
from dtrain.learners import data_parallel_distributed_learner

from tests.helpers.shard_data import tar_fields


class LedgerModel(torch.nn.Module):
    """Embeds the tokens and records which sequences (position, id) it was given."""

    def __init__(self):
        super().__init__()
        self.embedding = torch.nn.Embedding(13, 4)
        self.ledger: list[list[int]] = []

    def forward(self, minibatch):
        if self.training:
            self.ledger += [[position, sample] for position, sample in
                            zip(minibatch.positions.tolist(), minibatch["id"].tolist())]
        return self.embedding(minibatch["tokens"].data).sum(-1)


def token_loss(output, minibatch):
    """Mean over the real token steps (the defining stream's), as a sequence loss is."""
    mask = minibatch["tokens"].mask
    return (output * mask).sum() / mask.sum().clamp(min=1)


def nothing_wrong(output, minibatch):
    """The metric: a sum of errors, none (the test reads the ledger, not the metric)."""
    return output.new_zeros(())


def main() -> None:
    kind, shards, run_dir, max_samples, ledger_dir = sys.argv[1:6]
    torch.set_num_threads(1)
    comm = create_communicator(backend="gloo", timeout_s=60)
    data = TarShards(shards, fields=tar_fields(), sequences=["tokens"]) if kind == "tar" else ParquetShards(shards)
    source = MinibatchSource(data, randomization_seed=7, randomization_window_in_chunks=3, defining_stream="tokens")
    torch.manual_seed(0)
    model = LedgerModel()
    learner = data_parallel_distributed_learner(torch.optim.SGD(model.parameters(), lr=0.01), comm)
    dtrain.training_session(model, token_loss, learner, source, 90, max_samples=int(max_samples), inputs="minibatch",
                            target="minibatch", metric=nothing_wrong, run_dir=Path(run_dir), tensorboard=False, stream=io.StringIO(),
                            checkpoint_config=dtrain.CheckpointConfig("ckpt.pt")).train()
    Path(ledger_dir).mkdir(parents=True, exist_ok=True)
    (Path(ledger_dir) / f"rank{comm.rank}.json").write_text(json.dumps(model.ledger))
    comm.finalize()


if __name__ == "__main__":
    main()
