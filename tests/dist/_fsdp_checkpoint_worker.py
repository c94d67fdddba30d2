"""Worker run by tests/dist/test_fsdp_checkpoints.py: ``python _fsdp_checkpoint_worker.py RUN_DIR PHASE``.

Sharded checkpoints (``torch.distributed.checkpoint``) of ``learner=fsdp`` on a char transformer with AdamW, across
launches of different world sizes sharing ``RUN_DIR``:

  write (2 ranks)   ``straight``: a run to 500 tokens; ``half``: the same run stopped at 250, its periodic sharded
                    checkpoint (the last minibatch before 250 is cut short, so the final one is removed) resumed
                    to 500 in the same directory: bit-exact against ``straight``; a damaged newest
                    checkpoint is refused and the one before is used; data_parallel resumes the sharded checkpoint
                    and fsdp resumes a data_parallel checkpoint, both equal to ``straight``.
  resume (N ranks)  the 2-rank checkpoint at 250 resumed on N ranks (1: the one-process learner reads the shards
                    whole), equal to ``straight`` to float rounding.
"""
from __future__ import annotations

import io
import os
import shutil
import sys
import warnings
from functools import partial
from pathlib import Path

import torch

import dtrain
from dtrain.comm import create_communicator
from dtrain.learners import data_parallel_distributed_learner, fsdp_learner
from dtrain.session import CheckpointConfig, SequenceCrossEntropy

from tests.dist._fsdp_worker import MINIBATCH, adamw, char_model, relative_difference, whole
from tests.helpers.checks import run_checks
from tests.helpers.sequence_data import token_sequences


def run(comm, run_dir: Path, max_samples: int, learner_kind: str = "fsdp", restore_from=None):
    model = char_model()
    learner = fsdp_learner(adamw(model), comm) if learner_kind == "fsdp" else \
        data_parallel_distributed_learner(adamw(model), comm)
    torch.manual_seed(1 + comm.rank)
    result = dtrain.training_session(
        model, SequenceCrossEntropy(), learner, dtrain.MinibatchSource(token_sequences(), randomization_seed=4),
        MINIBATCH, max_samples=max_samples, inputs=["text[:-1]"], target="text[1:]", run_dir=run_dir,
        checkpoint_config=CheckpointConfig("checkpoint.pt", frequency=125, restore=True, keep_last=3,
                                           restore_from=restore_from),
        tensorboard=False, stream=io.StringIO(), independent_processes=comm.size == 1).train()
    return whole(model), result


def check_write(comm, run_dir: Path) -> dict:
    figures = {}
    straight, _ = run(comm, run_dir / "straight", 500)
    if comm.is_main:
        torch.save(straight, run_dir / "straight.pt")
    _, half = run(comm, run_dir / "half", 250)
    figures["half_checkpoint"] = half.last_checkpoint.name
    figures["half_checkpoint_is_directory"] = half.last_checkpoint.is_dir()
    figures["half_files"] = sorted(path.name for path in half.last_checkpoint.iterdir())
    comm.barrier()
    if comm.is_main:  # its last minibatch was cut short at 250: the periodic checkpoint before is the one resumed
        shutil.rmtree(half.last_checkpoint)
        shutil.copytree(run_dir / "half", run_dir / "half_for_resume")
        shutil.copytree(run_dir / "half", run_dir / "half_for_dp")
    comm.barrier()
    resumed, result = run(comm, run_dir / "half", 500)
    figures["resumed_from"] = result.restored_from.name
    figures["resume_bit_exact"] = all(torch.equal(resumed[name], straight[name]) for name in straight)
    # damage the newest checkpoint of a copy of the straight run: the one before it is used, and the run ends as it
    if comm.is_main:
        shutil.copytree(run_dir / "straight", run_dir / "damaged")
        newest = sorted((run_dir / "damaged").glob("checkpoint-*.pt"), key=lambda p: int(p.stem.split("-")[1]))[-1]
        shard = newest / "__1_0.distcp"
        shard.write_bytes(shard.read_bytes()[:-7] + b"garbage")
    comm.barrier()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        damaged, result = run(comm, run_dir / "damaged", 500)
    figures["damaged_restored_from"] = result.restored_from.name
    figures["damaged_warning"] = next((str(w.message) for w in caught if "checksum" in str(w.message)), "")
    figures["damaged_bit_exact"] = all(torch.equal(damaged[name], straight[name]) for name in straight)
    # a replicated learner resumes the sharded checkpoint, and fsdp resumes a replicated one
    replicated, result = run(comm, run_dir / "half_for_dp", 500, "data_parallel")
    figures["data_parallel_from_sharded"] = relative_difference(replicated, straight)
    _, half_dp = run(comm, run_dir / "dp_half", 250, "data_parallel")
    figures["dp_checkpoint_is_file"] = half_dp.last_checkpoint.is_file()
    if comm.is_main:
        half_dp.last_checkpoint.unlink()
    comm.barrier()
    sharded, result = run(comm, run_dir / "dp_half", 500)
    figures["fsdp_from_replicated"] = relative_difference(sharded, straight)
    return figures


def check_resume(comm, run_dir: Path) -> dict:
    target = run_dir / f"resume{comm.size}"
    if comm.is_main:
        shutil.copytree(run_dir / "half_for_resume", target)
    comm.barrier()
    resumed, result = run(comm, target, 500)
    straight = torch.load(run_dir / "straight.pt")
    return {"restored_from": result.restored_from.name, "relative_difference": relative_difference(resumed, straight)}


def main() -> None:
    run_dir, phase = Path(sys.argv[1]), sys.argv[2]
    torch.set_num_threads(1)
    comm = create_communicator(backend=os.environ.get("WORKER_BACKEND", "gloo"), timeout_s=60)
    run_checks(comm, {phase: partial({"write": check_write, "resume": check_resume}[phase], run_dir=run_dir)})
    comm.finalize()


if __name__ == "__main__":
    main()
