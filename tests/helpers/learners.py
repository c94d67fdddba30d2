"""The learner settings the multi-process command-line tests run, by name: one registry, as
``tests/helpers/strategies.py`` is for exchange strategies, so that a new learner gets a line here and is
resumed, compared and checked with the rest.

Each entry is the overrides of a short digits run in which the learner really communicates: the warm start
pinned at 0 (its default, ``auto``, is a share of ``max_samples``, which the halves of a resumed run change)
and blocks of 320 samples (several syncs in a 1,920-sample run)."""
from __future__ import annotations

from pathlib import Path

CONF = Path(__file__).resolve().parents[2] / "conf"

_NOW = ["learner.distributed_after=0"]
_BLOCKS = ["learner.block_size=320", *_NOW]
_FOUR_BITS = ["learner/exchange=quantized", "learner.exchange.num_bits=4"]
#: LARS/LAMB runs: a linear lr scaling with its warm-up, and the weight EMA (both in the checkpoint)
_SCALED_WITH_EMA = ["session.ema_decay=0.9", "session.lr_scaling=linear", "session.lr_reference_minibatch_size=32",
                    "session.lr_schedule.warmup_samples=640"]

LEARNERS: dict[str, list[str]] = {
    # each shipped one-level learner with its defaults, but for the pinned warm start and blocks
    "data_parallel": ["learner=data_parallel"],
    "quantized": ["learner=quantized", "learner.exchange.num_bits=2", *_NOW],
    "powersgd": ["learner=powersgd", "learner.exchange.matrix_approximation_rank=1",
                 "learner.exchange.start_powersgd_iter=2"],
    "block_momentum": ["learner=block_momentum", *_BLOCKS],
    "diloco": ["learner=diloco", *_BLOCKS],
    "local_sgd": ["learner=local_sgd", *_BLOCKS],
    "sparseloco": ["learner=sparseloco", *_BLOCKS],
    # combinations: compressed outer updates, optimizer state kept across syncs, large-minibatch optimizers
    "bm_quantized": ["learner=block_momentum", *_BLOCKS, "learner/exchange=quantized", "learner.exchange.num_bits=2"],
    "bmuf_4bit": ["learner=block_momentum", *_FOUR_BITS, *_BLOCKS],
    "diloco_4bit": ["learner=diloco", *_FOUR_BITS, *_BLOCKS],
    # every rank's own optimizer state (momentum kept across syncs) must come back, not rank 0's
    "bmuf_momentum_kept": ["learner=block_momentum", "learner.reset_sgd_momentum_after_aggregation=false", *_BLOCKS],
    "data_parallel_lars": ["learner=data_parallel", "optimizer=lars", "optimizer.lr=2.0", "optimizer.eta=0.01",
                           *_SCALED_WITH_EMA],
    "block_momentum_lamb": ["learner=block_momentum", *_BLOCKS, "optimizer=lamb", "optimizer.lr=0.003",
                            *_SCALED_WITH_EMA],
    "diloco_lamb": ["learner=diloco", *_BLOCKS, "optimizer=lamb", *_SCALED_WITH_EMA],
    # an outer optimizer from the config group, with state of its own (Adam's two moments and step count)
    "local_sgd_outer_adam": ["learner=local_sgd", *_BLOCKS, "learner/outer_optimizer=adam",
                             "learner.outer_optimizer.lr=0.01"],
    # the overlapped outer step, through the threaded 4-bit exchange (its residuals and the step one block late)
    "diloco_overlap_4bit": ["learner=diloco", *_FOUR_BITS, *_BLOCKS, "learner.overlap=true"],
}


def learners(*names: str) -> dict[str, list[str]]:
    """The registry's entries of these names, in this order (a KeyError names one it lacks)."""
    return {name: LEARNERS[name] for name in names}


def shipped_learners() -> list[str]:
    """Every learner preset the config tree ships (``learner=NAME``), sorted."""
    return sorted(path.stem for path in (CONF / "learner").glob("*.yaml"))


def preset(overrides: list[str]) -> str:
    """The ``learner=NAME`` preset an entry runs."""
    return next(item.split("=", 1)[1] for item in overrides if item.startswith("learner="))


__all__ = ["LEARNERS", "learners", "preset", "shipped_learners"]
