"""The ``fault_tolerance`` section: an elastic run of replica groups on torchft (``docs/fault-tolerance.md``)."""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

from omegaconf import DictConfig

from dtrain import checks
from dtrain.rules import StrictBool

#: the learner targets an elastic run accepts (their groups meet only at syncs)
ELASTIC_TARGETS = {"dtrain.learners.LocalSGDLearner": "local_sgd", "dtrain.learners.DiLoCoLearner": "diloco"}


@dataclass
class FaultToleranceConfig:
    enabled: StrictBool = False     # this process is one replica group of an elastic job
    lighthouse: str = ""            # http://HOST:PORT of the Lighthouse (python -m dtrain.lighthouse); "": $TORCHFT_LIGHTHOUSE
    replica_id: str = ""            # this group's name, unique in the job (a restarted group keeps its name)
    min_groups: int = 1             # a sync commits only with at least this many groups
    timeout_s: float = 60.0         # each collective of a sync, and a joiner's healing transfer
    quorum_timeout_s: float = 900.0  # how long a group waits at a sync for the others (longer than a block)


def lighthouse_address(section: DictConfig) -> str:
    """The Lighthouse's address: the setting, else ``$TORCHFT_LIGHTHOUSE``."""
    return section.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE", "")


def fault_tolerance_problems(cfg: DictConfig) -> list[str]:
    """One line per reason the config cannot run elastic (empty when it is off, or can)."""
    section = cfg.get("fault_tolerance")
    if section is None:
        return []
    try:
        enabled = checks.boolean("fault_tolerance.enabled", section.enabled)
    except (TypeError, ValueError) as error:
        return [str(error)]
    if not enabled:
        return []
    prefix = "fault_tolerance.enabled=true"
    problems = []
    if importlib.util.find_spec("torchft") is None:
        problems.append(f"{prefix} needs torchft: pip install \"dtrain[ft]\"")
    if not lighthouse_address(section):
        problems.append(f"{prefix}: fault_tolerance.lighthouse is empty and $TORCHFT_LIGHTHOUSE unset; expected the "
                        f"address python -m dtrain.lighthouse prints (http://HOST:PORT)")
    if not section.replica_id:
        problems.append(f"{prefix}: fault_tolerance.replica_id is empty; expected a name for this group, unique in "
                        f"the job")
    if section.min_groups < 1:
        problems.append(f"fault_tolerance.min_groups={section.min_groups}: expected at least 1")
    for key in ("timeout_s", "quorum_timeout_s"):
        if not section[key] > 0:
            problems.append(f"fault_tolerance.{key}={section[key]}: expected seconds above 0")
    learner = cfg.get("learner")
    target = learner.get("_target_") if isinstance(learner, DictConfig) else None
    if target not in ELASTIC_TARGETS:
        why = ("block momentum's filter is set by the number of workers (its block momentum 1 - 1/N), which "
               "changes in an elastic run" if target == "dtrain.learners.block_momentum_distributed_learner" else
               "data_parallel, the compressed gradient learners and two_level_* are not elastic in this version")
        problems.append(f"{prefix}: learner {target} is not elastic yet ({why}); use learner=local_sgd or diloco "
                        f"(groups that meet only at syncs)")
        return problems
    if learner.get("block_size") == "auto":
        problems.append(f"{prefix}: learner.block_size=auto depends on the number of groups, which changes; give it "
                        f"in samples")
    if learner.get("distributed_after") not in (0, None):
        problems.append(f"{prefix}: learner.distributed_after={learner.get('distributed_after')}: a warm start on one "
                        f"model is not elastic yet; set learner.distributed_after=0")
    if learner.get("overlap"):
        problems.append(f"{prefix}: learner.overlap=true: an overlapped outer step spans two syncs, and membership "
                        f"changes at each")
    exchange = learner.get("exchange")
    exchange_target = exchange.get("_target_") if isinstance(exchange, DictConfig) else exchange
    if exchange_target not in (None, "dtrain.exchange.AllReduce"):
        problems.append(f"{prefix}: learner.exchange {exchange_target}: elastic syncs sum the deltas in float32 "
                        f"through torchft; a compressing strategy's residuals do not heal yet (learner/exchange=allreduce)")
    try:
        from dtrain.comm import detect_launcher

        size = detect_launcher(os.environ).size
    except ValueError:
        size = 1
    if size != 1:
        problems.append(f"{prefix}: each replica group is one process in this version, this launch has {size}; start "
                        f"one process per group (no mpiexec -n > 1, torchrun --nproc-per-node 1)")
    if cfg.session.get("max_samples") is None:
        problems.append(f"{prefix}: session.max_samples is unset; an elastic run ends at a sample count every group "
                        f"agrees on")
    return problems


__all__ = ["ELASTIC_TARGETS", "FaultToleranceConfig", "fault_tolerance_problems", "lighthouse_address"]
