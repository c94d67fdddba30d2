"""Elastic block learners: replica groups that leave and join at the syncs, on torchft.

A replica group is one ``python -m dtrain`` process (a world of one). The groups of a job meet only at
the block learner's syncs, so membership changes only there, through torchft's ``Manager`` (its quorum,
formed by torchft's ``Lighthouse``; its reconfigurable Gloo process group; its checkpoint transport for
healing a joiner from a live peer). No consensus is written here: who is in a round, whether the round
committed and who heals from whom are torchft's answers.

One round (:meth:`ElasticGroups.round`), the same collectives on every group present:

1. ``start_quorum()``: torchft forms the quorum; a group behind the others (a joiner, a restarted group)
   receives a live peer's :meth:`ElasticGroups.heal_state`: the state of the last committed sync (model,
   inner and outer optimizer state, counters, data position) and the peer's data position now;
2. an all-reduce of a header (members of the block's plan, the plan's size, samples) and one of the
   sample-weighted deltas ``w_i (W_prev - W_i)``, ``w_i = N n_i / n`` (exactly 1 when the shares are equal,
   so the sum is then the non-elastic learner's ``D`` bit for bit), with the float buffers beside them;
3. ``should_commit()``: torchft's agreement that every collective of the round succeeded.

The block is committed when every group of its plan contributed (the header says so) and the round
committed: then every group present, a joiner included, takes the same outer step. Otherwise the block is
discarded everywhere: each group goes back to the state of the last committed sync, its data position
included, and the block's samples are read again, split among the groups present (the next plan: the
quorum's participants, in its order). So every sample of the stream is trained exactly once per sweep in a
committed block, whatever joins or leaves (``docs/fault-tolerance.md``).
"""
from __future__ import annotations

import copy
import time
from dataclasses import astuple
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

#: the learners an elastic run accepts (``fault_tolerance.enabled=true``): those whose groups meet only at syncs
ELASTIC_LEARNERS = ("local_sgd", "diloco")


def import_torchft():
    """torchft's modules, or ImportError with the line that installs them."""
    try:
        from torchft.manager import Manager
        from torchft.process_group import ProcessGroupGloo
    except ImportError as error:
        raise ImportError(f"fault_tolerance.enabled=true needs torchft ({error}); install it with "
                          f"pip install \"dtrain[ft]\"") from None
    return Manager, ProcessGroupGloo


class ElasticGroups:
    """This replica group's membership in an elastic job: a torchft ``Manager`` used only at syncs.

    Args:
        lighthouse: the address of torchft's Lighthouse (``http://HOST:PORT``; ``python -m dtrain.lighthouse``).
        replica_id: this group's name, unique among the groups of the job.
        min_groups: a round commits only with at least this many groups (torchft's ``min_replica_size``).
        timeout_s: the limit of each collective and of a healing transfer, in seconds.
        quorum_timeout_s: how long a group waits at a sync for the quorum (a joiner waits for the others' next
            sync: longer than a block takes).

    Raises:
        ImportError: torchft is not installed.
        ValueError: a value out of range.
    """

    def __init__(self, lighthouse: str, replica_id: str, min_groups: int = 1, timeout_s: float = 60.0,
                 quorum_timeout_s: float = 900.0):
        if not lighthouse:
            raise ValueError("fault_tolerance.lighthouse is empty: expected the Lighthouse's address, "
                             "http://HOST:PORT (python -m dtrain.lighthouse prints it)")
        if not replica_id:
            raise ValueError("fault_tolerance.replica_id is empty: expected a name for this group, unique in the job")
        if int(min_groups) < 1:
            raise ValueError(f"fault_tolerance.min_groups={min_groups!r}: expected at least 1")
        Manager, ProcessGroupGloo = import_torchft()
        from torch.distributed import TCPStore

        self.replica_id = replica_id
        self.min_groups = int(min_groups)
        self.quorum_timeout_s = float(quorum_timeout_s)
        self._short_since: float | None = None  # when this sync's rounds began to find fewer groups than min_groups
        # the group's own store (torchft keys its process group under it); a world of one, so this process hosts it
        self._store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self._pg = ProcessGroupGloo(timeout=timedelta(seconds=timeout_s))
        self.manager = Manager(
            pg=self._pg, load_state_dict=self._heal, state_dict=self.heal_state, min_replica_size=self.min_groups,
            use_async_quorum=False,  # a sync waits for its quorum; a joiner is healed before it trains
            timeout=timedelta(seconds=timeout_s), quorum_timeout=timedelta(seconds=quorum_timeout_s),
            rank=0, world_size=1, store_addr="127.0.0.1", store_port=self._store.port,
            lighthouse_addr=lighthouse, replica_id=replica_id, init_sync=True)
        self.learner = None
        self.source = None
        self.model: torch.nn.Module | None = None
        # -- state
        self.partition = (1, 0)            # (groups of this block's plan, this group's index in it)
        self.snapshot: dict[str, Any] | None = None  # the state of the last committed sync (CPU copies)
        self._healed: dict[str, Any] | None = None    # a peer's heal_state received in this round
        self._refused: str | None = None              # how that state's job differs from this group's
        self.last_round_failed = False                # torchft did not commit the last round (a group lost in it)
        self._last_groups: int | None = None
        # -- statistics
        self.participants: int = 0          # groups in the last committed round
        self.rounds = self.commits = self.discards = 0
        self.last_event = ""                # the last membership line, for the progress lines
        self.listeners: list[Callable[[str, dict[str, Any]], None]] = []  # (event, facts): commit, discard, heal
        self.unrecorded: list[tuple[str, dict[str, Any]]] = []  # (event, facts) no metrics record holds yet

    # -- what heals a joiner ----------------------------------------------------------------------
    def take_snapshot(self) -> None:
        """Keeps the state of a committed sync: the model, the learner (inner and outer optimizer, counters) and
        the data position; a discarded block goes back to it, and a joiner heals from it."""
        learner = self.learner
        self.snapshot = {
            "model": {name: tensor.detach().cpu().clone() for name, tensor in self.model.state_dict().items()},
            "learner": copy.deepcopy(learner.state_dict()),
            "local": copy.deepcopy(learner.local_state_dict()),
            "source": copy.deepcopy(self.source.state_dict()),
        }

    def heal_state(self) -> dict[str, Any]:
        """What a peer receives when it heals from this group (torchft calls it in its quorum): the state of the
        last committed sync, and the data position now (where the block being synced ends)."""
        return {"snapshot": self.snapshot, "source_now": copy.deepcopy(self.source.state_dict()),
                "block_lr": astuple(self.learner.block_lr), "identity": self.identity()}

    def identity(self) -> dict[str, Any]:
        """What every group of one job has alike: the learner's identity (its kind, exchange and outer optimizer)
        and block size (the groups' blocks must end together), the optimizer's type, the model's parameter names
        and shapes and the data's identity. A joiner's must equal the job's."""
        learner = self.learner
        source_identity = getattr(self.source, "checkpoint_identity", None)
        return {"learner": {**learner.checkpoint_identity(), "block_size": int(learner.block_size)},
                "optimizer": f"{type(learner.optimizer).__module__}.{type(learner.optimizer).__qualname__}",
                "model": {name: list(tensor.shape) for name, tensor in self.model.state_dict().items()},
                "data": source_identity() if callable(source_identity) else None}

    def _heal(self, state: dict[str, Any]) -> None:
        """torchft's load callback: this group becomes the peer's last committed sync, unless it is not of the
        peer's job (its config or code differ: refused in the round, and the job goes on without it)."""
        self._healed = state
        self._refused = _first_difference(state.get("identity"), self.identity())
        if self._refused is not None:
            return
        self._restore(state["snapshot"])
        self.snapshot = copy.deepcopy(state["snapshot"])

    def _restore(self, snapshot: dict[str, Any]) -> None:
        learner = self.learner
        self.model.load_state_dict(snapshot["model"])
        configured = [{key: value for key, value in group.items() if key != "params"}
                      for group in learner.optimizer.param_groups]
        learner.load_state_dict(copy.deepcopy(snapshot["learner"]))
        learner.load_local_state_dict(copy.deepcopy(snapshot["local"]))
        for group, settings in zip(learner.optimizer.param_groups, configured):
            group.update(settings)  # the session applies its schedules again from samples_seen
        self.source.load_state_dict(copy.deepcopy(snapshot["source"]))

    # -- the round --------------------------------------------------------------------------------
    def join(self) -> None:
        """The first round, before this group trains: the quorum, healing from a peer when the job is running
        (or, at the start, from the group torchft names the primary, so every group starts from one model)."""
        self.take_snapshot()
        self.round(in_step=False, end_of_block=False)

    def round(self, in_step: bool, end_of_block: bool) -> bool:
        """One round at a sync (see the module docstring); returns whether this group's block was committed.

        ``in_step``: called from inside the learner's step (whose caller adds the last minibatch's samples when it
        returns). Rounds repeat until one commits (a group lost inside a round fails it for all)."""
        learner = self.learner
        member = learner.global_samples_in_block > 0
        committed = self._one_round(member, in_step, end_of_block)
        while self.last_round_failed:
            self._one_round(False, in_step, end_of_block)  # a block of a failed round was discarded in it
        self._short_since = None
        return committed

    def _check_enough_groups(self) -> None:
        """A round with fewer groups than ``min_groups`` cannot commit, and torchft retries it at once: says so once
        on this group, and after ``quorum_timeout_s`` of such rounds ends it in one line (else it would retry for
        ever, a group started alone or the survivors of a loss waiting for groups that never come).

        Raises:
            ValueError: fewer than ``min_groups`` groups for ``quorum_timeout_s`` seconds.
        """
        present = self.manager.num_participants()
        if present >= self.min_groups:
            self._short_since = None
            return
        now = time.monotonic()
        if self._short_since is None:
            self._short_since = now
            print(f"dtrain: elastic [{self.replica_id}] waiting at a sync for groups: {present} present, "
                  f"fault_tolerance.min_groups={self.min_groups} (for at most fault_tolerance.quorum_timeout_s="
                  f"{self.quorum_timeout_s:g} s)", flush=True)
        elif now - self._short_since > self.quorum_timeout_s:
            self.manager.shutdown(wait=False)
            plural = "group has" if present == 1 else "groups have"
            raise ValueError(f"fault_tolerance.min_groups={self.min_groups}: only {present} {plural} taken part in "
                             f"this sync's rounds for {self.quorum_timeout_s:g} s (fault_tolerance.quorum_timeout_s); "
                             f"start at least {self.min_groups} groups, or lower fault_tolerance.min_groups")
        else:
            time.sleep(0.05)  # torchft forms the next quorum at once: no busy loop while waiting

    def _one_round(self, member: bool, in_step: bool, end_of_block: bool) -> bool:
        from torch.distributed import ReduceOp

        learner, manager = self.learner, self.manager
        started = time.perf_counter()
        self.rounds += 1
        self._healed = None
        manager.start_quorum()  # may heal this group (_heal) from a live peer
        self._check_enough_groups()
        healed = self._healed
        if healed is not None and self._refused is not None:
            self.manager.shutdown(wait=False)  # leaves the job: the others' round fails without it, and goes on
            raise ValueError(f"fault_tolerance: group {self.replica_id!r} is not of the running job: {self._refused}; "
                             f"start it with the job's config and code (the job goes on without it)")
        if healed is not None:
            member = False  # its block (if any) is gone: it is at the peer's last committed sync now
        scratch, count = learner._scratch, learner._num_parameter_elements
        planned, share, total = self.partition[0], learner.local_samples_in_block, learner.global_samples_in_block
        if member:
            learner.flat_parameters(out=scratch[:count])
            torch.sub(learner.prev_parameters, scratch[:count], out=scratch[:count])  # d_i = W_prev - W_i
            _pack(learner._float_buffers, scratch[count:])
            weight = planned * share / total  # 1.0 exactly with equal shares: D is then the plain sum
            if weight != 1.0:
                scratch.mul_(weight)
        else:
            scratch.zero_()
        header = torch.tensor([float(member), float(member * planned), float(member * share),
                               float(member * total)], dtype=torch.float64)
        manager.allreduce(header, reduce_op=ReduceOp.SUM).wait()
        manager.allreduce(scratch, reduce_op=ReduceOp.SUM).wait()
        committed_round = manager.should_commit()
        self.last_round_failed = not committed_round
        members, planned_sum, shares, totals = (int(round(value)) for value in header.tolist())
        complete = (committed_round and members > 0 and planned_sum == members * members
                    and shares * members == totals)
        facts = {"groups": manager.num_participants() if committed_round else 0, "members": members,
                 "samples": shares, "samples_seen": None, "seconds": time.perf_counter() - started,
                 "replica_id": self.replica_id}
        if healed is not None:
            self._emit("heal", facts)
        if complete:
            if healed is not None:
                self._after_heal(healed, totals // members, in_step)
            self._outer_step(members, totals // members, end_of_block)
            self.commits += 1
            facts["samples_seen"] = learner.samples_seen + (learner.global_samples if in_step else 0)
            self._emit("commit", facts)
        elif healed is not None:  # at the peer's last committed sync already
            if in_step:
                learner.samples_seen -= learner.global_samples
            learner.reset_block_counters()
        elif members > 0 or member:
            self.discards += 1
            self._rollback(in_step)
            facts["samples_seen"] = self.snapshot["learner"]["samples_seen"]
            self._emit("discard", facts)
        if committed_round:
            self.partition = (manager.num_participants(), manager.participating_rank())
            self.participants = self.partition[0]
            if complete or healed is not None or not self.snapshot:
                self.take_snapshot_after(in_step)
        return complete

    def take_snapshot_after(self, in_step: bool) -> None:
        """The snapshot of the sync just committed; inside a step, with the samples its caller adds counted."""
        learner = self.learner
        if in_step:
            learner.samples_seen += learner.global_samples
            try:
                self.take_snapshot()
            finally:
                learner.samples_seen -= learner.global_samples
        else:
            self.take_snapshot()

    def _after_heal(self, healed: dict[str, Any], block_samples: int, in_step: bool) -> None:
        """A joiner healed in a round that commits a block: it is at the peer's last committed sync, takes the same
        outer step (its own delta 0, weight 0) and goes on from the block's end, the peer's data position now."""
        learner = self.learner
        learner.block_lr = healed_block_lr(healed, type(learner.block_lr))  # the momentum correction's rate, as the members have it
        learner.samples_seen += block_samples - (learner.global_samples if in_step else 0)
        self.source.load_state_dict(copy.deepcopy(healed["source_now"]))

    def _outer_step(self, members: int, block_samples: int, end_of_block: bool) -> None:
        """The sync's outer step on the summed weighted deltas in the scratch buffer, ``members`` contributions
        of a block of ``block_samples`` samples: the same arithmetic as the non-elastic learner's."""
        learner = self.learner
        learner.global_samples_in_block = block_samples
        learner.elastic_outer_step(members, end_of_block)

    def _rollback(self, in_step: bool) -> None:
        """The block is discarded: back to the last committed sync (its samples are read again)."""
        learner = self.learner
        self._restore(self.snapshot)
        if in_step:  # the step adds this minibatch's samples when it returns
            learner.samples_seen -= learner.global_samples
        learner.reset_block_counters()

    def _emit(self, event: str, facts: dict[str, Any]) -> None:
        line = {"commit": "sync committed by {groups} groups ({samples} samples, {seconds:.2f} s)",
                "discard": "block discarded: {members} of the plan's groups met; its samples are read again "
                           "by the {groups} groups present",
                "heal": "healed from a live peer ({seconds:.2f} s)"}[event].format(**facts)
        if event != "commit" or facts["groups"] != self._last_groups:
            print(f"dtrain: elastic [{self.replica_id}] {line}", flush=True)
        self._last_groups = facts["groups"]
        self.last_event = line
        self.unrecorded.append((event, dict(facts)))  # until a run's records take them (a heal at start-up)
        for listener in self.listeners:
            listener(event, dict(facts))

    def close(self) -> None:
        """Leaves the job: shuts torchft's manager down."""
        self.manager.shutdown(wait=False)


def _first_difference(theirs: Any, mine: Any, path: str = "") -> str | None:
    """The first place two identities differ, as ``learner.block_size is 64 in the job, 32 here``; None if equal."""
    if isinstance(theirs, dict) and isinstance(mine, dict):
        for key in sorted(set(theirs) | set(mine), key=str):
            where = f"{path}.{key}" if path else str(key)
            if key not in theirs or key not in mine:
                return f"{where} is {'only here' if key not in theirs else 'missing here'}"
            difference = _first_difference(theirs[key], mine[key], where)
            if difference is not None:
                return difference
        return None
    return None if theirs == mine else f"{path} is {theirs!r} in the job, {mine!r} here"


def healed_block_lr(healed: dict[str, Any], trace_type):
    """The block's inner learning rate trace (of ``trace_type``, the learner's own) a joiner takes from the peer
    (the momentum correction's)."""
    return trace_type(*healed.get("block_lr", ())) if "block_lr" in healed else trace_type()


def _pack(tensors, flat: torch.Tensor) -> None:
    offset = 0
    with torch.no_grad():
        for tensor in tensors:
            flat[offset:offset + tensor.numel()].copy_(tensor.reshape(-1))
            offset += tensor.numel()


__all__ = ["ELASTIC_LEARNERS", "ElasticGroups", "elastic_problems", "import_torchft"]


def elastic_problems(learner) -> list[str]:
    """Why ``learner`` cannot run elastic (one line each; empty: it can)."""
    prefix = "fault_tolerance.enabled=true"
    problems = []
    if learner.kind not in ELASTIC_LEARNERS:
        problems.append(f"{prefix}: learner {learner.kind!r} is not elastic yet; use one of "
                        f"{', '.join(ELASTIC_LEARNERS)} (their groups meet only at syncs)")
    if learner.comm.size != 1:
        problems.append(f"{prefix}: each replica group is one process in this version, this one has "
                        f"{learner.comm.size}; start one process per group (no mpiexec -n > 1)")
    if not learner.exchange.lossless or learner.exchange.name != "allreduce":
        problems.append(f"{prefix}: learner.exchange={learner.exchange.name}: elastic syncs sum the deltas in float32 "
                        f"through torchft; a compressing strategy's residuals do not heal yet")
    if learner.overlap:
        problems.append(f"{prefix}: learner.overlap=true: an overlapped outer step spans two syncs, and membership "
                        f"changes at each")
    if learner.block_size_is_auto:
        problems.append(f"{prefix}: learner.block_size=auto depends on the number of groups, which changes; give it "
                        f"in samples")
    if learner.distributed_after_is_auto or learner.distributed_after:
        problems.append(f"{prefix}: learner.distributed_after={learner.distributed_after!r}: a warm start on one model "
                        f"is not elastic yet; set learner.distributed_after=0")
    if learner.has_own_sync():
        problems.append(f"{prefix}: learner {type(learner).__name__} has a sync of its own, which is not elastic")
    return problems
