"""Worker run by tests/dist/test_sequences_mpi.py under mpiexec: ``python _sequence_worker.py RUN_DIR``.

Sequence data through the public API (``training_session`` over ``MinibatchSource`` of named
streams), data-parallel on N ranks against one process reading the same global minibatches.
Samples are steps (tokens), and each rank's share holds whole sequences of uneven lengths, so the
ranks' step counts differ from minibatch to minibatch: only a learner weighting each rank by its
tokens gives the one-process update on the token-mean loss.

Checks:
  language_model   a causal attention LM (inputs text[:-1], target text[1:]) equals one process, with
                   and without micro-batches; parameters identical on all ranks; tokens weighted
                   unevenly (some minibatch gives two ranks different step counts).
  dealt_shares     sequences of 1..3B/2N target tokens (about N to a global minibatch): every rank's tokens stay
                   within B/N plus the minibatch's longest sequence, no rank is empty while the minibatch has N
                   sequences, and the update equals one process.
  seq2seq          a GRU encoder-decoder (keyword inputs, packed source lengths, target[1:]) equals one
                   process; its cross-validation and test figures equal one process's (averaged over
                   steps, and over sequences for the sequence error).
"""
from __future__ import annotations

import io
import os
import sys
from functools import partial
from pathlib import Path

import torch

import dtrain
from dtrain.comm import LocalCommunicator, create_communicator
from dtrain.learners import LocalLearner, data_parallel_distributed_learner
from dtrain.session import CrossValidationConfig, SequenceCrossEntropy, SequenceError, TestConfig

from tests.helpers.checks import run_checks
from tests.helpers.compare import differing_on_ranks, max_difference
from tests.helpers.sequence_data import TinyCausalLM, TinySeq2Seq, sequence_pairs, token_sequences

MINIBATCH = dtrain.Schedule([[3, 37], [1, 5], [2, 61]], epoch_size=40)  # tokens; 5: fewer sequences than ranks
MAX_SAMPLES = 700


def fresh(model_class) -> torch.nn.Module:
    torch.manual_seed(0)  # the same initial model on every rank, as the CLI does
    return model_class()


def optimizer_of(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)


def check_language_model(comm, run_dir: Path) -> dict:
    figures = {"size": comm.size}
    shares = []
    for micro in (None, 9):
        model = fresh(TinyCausalLM)
        learner = data_parallel_distributed_learner(optimizer_of(model), comm, bucket_size_mb=0.002)
        if micro is None:  # record every rank's token count per minibatch
            original = learner.begin_minibatch

            def record(local, global_, original=original):
                shares.append(local)
                original(local, global_)
            learner.begin_minibatch = record
        source = dtrain.MinibatchSource(token_sequences(), randomization_seed=4)
        dtrain.training_session(model, SequenceCrossEntropy(), learner, source, MINIBATCH, max_samples=MAX_SAMPLES,
                                inputs=["text[:-1]"], target="text[1:]", micro_batch_size=micro,
                                run_dir=run_dir / f"lm{micro}", tensorboard=False, stream=io.StringIO()).train()
        reference = fresh(TinyCausalLM)
        dtrain.training_session(reference, SequenceCrossEntropy(), LocalLearner(optimizer_of(reference), LocalCommunicator()),
                                dtrain.MinibatchSource(token_sequences(), randomization_seed=4), MINIBATCH,
                                max_samples=MAX_SAMPLES, inputs=["text[:-1]"], target="text[1:]",
                                run_dir=run_dir / f"lm_reference{comm.rank}{micro}", tensorboard=False,
                                stream=io.StringIO(), independent_processes=True).train()
        figures[f"max_difference_to_one_process_micro{micro}"] = max_difference(model, reference)
        figures[f"differing_parameters_micro{micro}"] = differing_on_ranks(comm, dict(model.named_parameters()))
        figures[f"samples_seen_micro{micro}"] = learner.samples_seen
    figures["parameters_moved_by"] = max_difference(model, fresh(TinyCausalLM))
    everyone = comm.allgather_object(shares)
    figures["minibatches_with_uneven_shares"] = sum(len(set(per_rank)) > 1 for per_rank in zip(*everyone))
    return figures


def check_dealt_shares(comm, run_dir: Path) -> dict:
    size = 24  # target tokens per global minibatch; sequences of 1..3 * size / 2N target tokens
    data = token_sequences(num_sequences=80, seed=3, low=2, high=3 * size // (2 * comm.size) + 2)

    def session(model, learner, source, name: str) -> None:
        dtrain.training_session(model, SequenceCrossEntropy(), learner, source, size, max_samples=300,
                                inputs=["text[:-1]"], target="text[1:]", run_dir=run_dir / name, tensorboard=False,
                                stream=io.StringIO(), independent_processes=learner.comm.size == 1).train()

    model = fresh(TinyCausalLM)
    source = dtrain.MinibatchSource(data, randomization_seed=5)
    read, reads = source.next_minibatch, []

    def recorded(*args):  # (tokens, sequences, longest sequence's tokens, sequences of the global minibatch)
        minibatch = read(*args)
        if minibatch is not None:
            targets = minibatch["text"].lengths - 1
            reads.append([minibatch.num_samples, minibatch.num_sequences, int(targets.max()) if len(targets) else 0,
                          minibatch.global_num_sequences])
        return minibatch
    source.next_minibatch = recorded
    session(model, data_parallel_distributed_learner(optimizer_of(model), comm, bucket_size_mb=0.002), source, "dealt")
    reference = fresh(TinyCausalLM)
    session(reference, LocalLearner(optimizer_of(reference), LocalCommunicator()),
            dtrain.MinibatchSource(data, randomization_seed=5), f"dealt_reference{comm.rank}")
    everyone = comm.allgather_object(reads)
    excess, empty, uneven, eligible = [], 0, 0, 0
    for per_rank in zip(*everyone):
        tokens = [r[0] for r in per_rank]
        longest = max(r[2] for r in per_rank)
        excess.append(max(tokens) - (size / comm.size + longest))
        if per_rank[0][3] >= comm.size:
            eligible += 1
            empty += sum(r[1] == 0 for r in per_rank)
        uneven += len(set(tokens)) > 1
    return {
        "minibatches": len(excess), "with_n_sequences": eligible, "empty_shares_with_n_sequences": empty,
        "max_tokens_above_share_plus_longest": max(excess), "minibatches_with_uneven_shares": uneven,
        "tokens_per_rank": [sum(r[0] for r in mine) for mine in everyone],
        "max_difference_to_one_process": max_difference(model, reference),
        "differing_parameters": differing_on_ranks(comm, dict(model.named_parameters())),
        "parameters_moved_by": max_difference(model, fresh(TinyCausalLM)),
    }


def seq2seq_session(model, learner, run_dir: Path, stream) -> dtrain.TrainingResult:
    def source(**options) -> dtrain.MinibatchSource:
        return dtrain.MinibatchSource(sequence_pairs(**options), randomization_seed=2)

    test = dtrain.MinibatchSource(sequence_pairs(num_sequences=23, seed=9), randomize=False, max_sweeps=1)
    cv = dtrain.MinibatchSource(sequence_pairs(num_sequences=17, seed=8), randomize=False, max_sweeps=1)
    return dtrain.training_session(
        model, SequenceCrossEntropy(), learner, source(), 45, max_samples=600, metric=SequenceError(),
        inputs={"source": "source", "decoder_input": "target[:-1]"}, target="target[1:]",
        cv_config=CrossValidationConfig(cv, frequency=300, minibatch_size=13),
        test_config=TestConfig(test, minibatch_size=11), run_dir=run_dir, tensorboard=False, stream=stream,
        independent_processes=learner.comm.size == 1).train()


def check_seq2seq(comm, run_dir: Path) -> dict:
    model = fresh(TinySeq2Seq)
    result = seq2seq_session(model, data_parallel_distributed_learner(optimizer_of(model), comm), run_dir / "s2s",
                             io.StringIO())
    reference = fresh(TinySeq2Seq)
    expected = seq2seq_session(reference, LocalLearner(optimizer_of(reference), LocalCommunicator()),
                               run_dir / f"s2s_reference{comm.rank}", io.StringIO())
    return {
        "max_difference_to_one_process": max_difference(model, reference),
        "differing_parameters": differing_on_ranks(comm, dict(model.named_parameters())),
        "test": [result.test.loss, result.test.error, result.test.num_samples],
        "test_one_process": [expected.test.loss, expected.test.error, expected.test.num_samples],
        "cv": [result.last_cross_validation.loss, result.last_cross_validation.error],
        "cv_one_process": [expected.last_cross_validation.loss, expected.last_cross_validation.error],
    }


def main() -> None:
    run_dir = Path(sys.argv[1])
    torch.set_num_threads(1)  # several ranks share two cores
    comm = create_communicator(backend=os.environ.get("WORKER_BACKEND", "gloo"), timeout_s=60)
    run_checks(comm, {"language_model": partial(check_language_model, run_dir=run_dir),
                      "dealt_shares": partial(check_dealt_shares, run_dir=run_dir),
                      "seq2seq": partial(check_seq2seq, run_dir=run_dir)})
    comm.finalize()


if __name__ == "__main__":
    main()
