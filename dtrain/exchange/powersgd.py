"""PowerSGD (Vogels et al. 2019): low-rank gradient compression with error feedback and warm start.

A faithful port of PyTorch's DDP communication hook
``torch/distributed/algorithms/ddp_comm_hooks/powerSGD_hook.py`` (``powerSGD_hook`` with
``batch_tensors_with_same_shape=False``) to dtrain's exchange seam, so the two agree on the
same gradients (tested against each other). Per key (gradient bucket):

1. the first ``start_powersgd_iter`` steps are a plain all-reduce (no state is touched);
2. then the error of the previous step is added to the input; every tensor is viewed as a
   matrix ``M`` of ``shape[0]`` rows; one whose ``(rows + cols) * rank * min_compression_rate``
   is not below ``rows * cols`` (every vector and bias) is all-reduced uncompressed;
3. for the others, ``P = M Q`` (Q from the previous step, orthogonalised, when ``warm_start``;
   drawn from a seeded normal distribution the first time), P all-reduced and orthogonalised,
   ``Q = M^T P``, Q all-reduced, ``M ~= P Q^T``;
4. the error (input minus this rank's share of the result) is kept for the next step.

``matrix_approximation_rank="auto"`` (``learner=powersgd``'s default) chooses the rank from the
all-reduced gradient of the last plain all-reduce step: the smallest power of two whose best approximation
leaves at most :data:`~dtrain.compress.lowrank.AUTO_RANK_ERROR` of it out (relative Frobenius error, matrices
sent whole counting as exact), so a gradient of low rank (a small CNN: rank 4) travels as few factors and one
that is not (a transformer trained with AdamW: rank 16) keeps its quality. When that step lies inside the
learning rate's warm-up, the rank is measured again later, up to the first step past it, and only raised
(``docs/exchange-strategies.md#powersgd-rank``).

The only difference to the hook is dtrain's convention: the learner hands over gradients
already divided by the number of contributions (their SUM is the mean gradient), so nothing is
divided by the world size afterwards, and the error is ``input - result / world_size`` (the
hook's error divided by the world size, as its input is). P is the hook's P divided by N before
orthogonalisation (the same after it), Q equals the hook's Q.
"""
from __future__ import annotations

import math
import warnings
from collections import defaultdict
from collections.abc import Hashable
from typing import Any

import numpy as np
import torch

from dtrain.compress.lowrank import AUTO_RANK_ERROR, CANDIDATE_RANKS, choose_rank, orthogonalize_, should_compress, \
    tail_energies
from dtrain.exchange.base import ThreadedExchange, full_precision_allreduce_bytes, split_views, warn_residuals_dropped
from dtrain.exchange.settings import POWERSGD
from dtrain.rules import check_settings


AUTO_START_FRACTION = 0.1
"""``start_powersgd_iter="auto"``: this fraction of the run's exchange steps is plain all-reduce (the hook's advice)."""

DEFAULT_START_ITER = 1000
"""The hook's default in minibatch steps, used by ``"auto"`` when the run's length is unknown."""

DEFAULT_START_SYNCS = 10
"""``"auto"`` for a block learner (whose exchange steps are its syncs) when the run's length is unknown."""


class PowerSGD(ThreadedExchange):
    """Rank-r PowerSGD with error feedback and warm start (``learner/exchange=powersgd``).

    Runs on the exchange's background thread (three dependent all-reduces per bucket plus the
    products), so it overlaps backward. All ranks end with the same P and Q, hence the same
    decompressed gradient.

    Args:
        matrix_approximation_rank: r, the rank of the approximation (>= 1; 1-4 is typical for CNNs), or ``"auto"``:
            chosen from the gradient of the last all-reduce step (above; one more all-reduce step when there is none),
            and re-checked while the learning rate warms up (:meth:`_plan_rechecks`).
        start_powersgd_iter: exchange steps of plain all-reduce before compression starts (>= 0),
            counted as the learner exchanges: minibatches under the data-parallel learner, syncs
            under block momentum and DiLoCo (which say so at start-up). ``"auto"``: 10% of the run's
            exchange steps (the hook's advice), derived in :meth:`plan`; 1000 minibatches or 10
            syncs when the run's length is unknown. None (the default): the hook's 1000 for
            minibatches, ``"auto"`` for syncs (1000 syncs would outlast most runs).
        min_compression_rate: compress a matrix only if it shrinks by more than this factor (> 0).
        use_error_feedback: add each step's compression error to the next step's input. None (the
            default): on for minibatch steps (the hook's default), off for syncs: a block's local steps
            start from the model the sync made and learn what it left out again, and with error
            feedback on top block momentum and DiLoCo collapsed on digits (off: BMUF's float32 accuracy
            at 79x fewer bytes; ``docs/semantics.md#powersgd``).
        warm_start: start the power iteration from the previous step's Q (else a new random Q).
        orthogonalization_epsilon: added to column norms when orthogonalising (>= 0).
        random_seed: seeds the draw of the initial Q (numpy ``RandomState``, as the hook).

    Raises:
        ValueError: a value out of range (one line naming it).
    """

    name = "powersgd"

    def __init__(self, matrix_approximation_rank: int | str = 1, start_powersgd_iter: int | str | None = None,
                 min_compression_rate: float = 2.0, use_error_feedback: bool | None = None, warm_start: bool = True,
                 orthogonalization_epsilon: float = 0.0, random_seed: int = 0):
        super().__init__()
        check_settings(POWERSGD, matrix_approximation_rank=matrix_approximation_rank,
                       start_powersgd_iter=start_powersgd_iter, min_compression_rate=min_compression_rate,
                       use_error_feedback=use_error_feedback, warm_start=warm_start,
                       orthogonalization_epsilon=orthogonalization_epsilon, random_seed=random_seed)
        self.rank_is_auto = matrix_approximation_rank == "auto"
        self.matrix_approximation_rank: int | None = None if self.rank_is_auto else int(matrix_approximation_rank)
        self.start_is_auto = start_powersgd_iter == "auto"
        self.start_is_default = start_powersgd_iter is None
        self.start_powersgd_iter = 0 if self.start_is_auto or self.start_is_default else int(start_powersgd_iter)
        self._start_note = ""       # how the start was derived, for describe()
        self.min_compression_rate = float(min_compression_rate)
        self.error_feedback_is_default = use_error_feedback is None
        self.use_error_feedback = bool(use_error_feedback)
        self.warm_start = bool(warm_start)
        self.orthogonalization_epsilon = float(orthogonalization_epsilon)
        self.random_seed = int(random_seed)
        self._recheck_steps: tuple[int, ...] = ()  # steps (0-based) re-measured while the lr warms up (plan)
        self._warmup_steps: int | None = None      # the exchange steps made before the lr's warm-up ends (plan)
        self._run_steps: int | None = None         # the run's exchange steps (plan)
        self.reset()
        self.count_steps_as(self.step_name)  # minibatch steps until a learner says otherwise

    # -- identity and progress -------------------------------------------------------------------
    def identity(self) -> dict[str, Any]:
        """The name and the rank setting (``"auto"`` or a number): P and Q of another rank do not fit; an automatic
        rank already chosen travels in the state."""
        return {"name": self.name,
                "matrix_approximation_rank": "auto" if self.rank_is_auto else self.matrix_approximation_rank}

    def describe(self) -> str:
        """``powersgd rank r``, and while compression has not started ``(all-reduce for the first s
        steps)`` (or syncs), with how an automatic start was derived."""
        return self._describe(plan=False)

    def describe_plan(self) -> str:
        """:meth:`describe`, and for ``"auto"`` the re-checks planned while the learning rate warms up (start-up)."""
        return self._describe(plan=True)

    def _describe(self, plan: bool) -> str:
        waiting = ""
        if self.step < self.start_powersgd_iter:
            note = f", {self._start_note}" if self._start_note else ""
            waiting = f" (all-reduce for the first {self.start_powersgd_iter:,} {self.step_name}s{note})"
        feedback = "" if self.use_error_feedback else ", error feedback off"
        return f"powersgd rank {self._describe_rank(plan)}{waiting}{feedback}"

    def _describe_rank(self, plan: bool) -> str:
        """The rank, and for ``"auto"`` how it was (or will be) chosen; with ``plan`` the re-checks too."""
        if not self.rank_is_auto:
            return str(self.matrix_approximation_rank)
        rechecks = self._describe_rechecks() if plan else ""
        if self.matrix_approximation_rank is None:
            return (f"auto (the smallest power of two leaving at most {AUTO_RANK_ERROR} of the all-reduced "
                    f"gradient out, chosen at the switch{rechecks})")
        return f"{self.matrix_approximation_rank} (auto{rechecks})"

    def count_steps_as(self, step_name: str) -> None:
        """The defaults that follow from what one exchange step is (``step_name``: minibatch ``"step"`` or
        ``"sync"``), set when the learner is built: error feedback left unset is on for steps, off for syncs;
        the start left unset is the hook's 1000 minibatch steps, ``"auto"`` for syncs, and ``"auto"`` is
        :data:`DEFAULT_START_ITER` steps or :data:`DEFAULT_START_SYNCS` syncs until :meth:`plan` knows the run's
        length. A learner driven by hand, never planned, so gets what ``training_session`` gives a run of
        unknown length."""
        super().count_steps_as(step_name)
        if self.error_feedback_is_default:
            self.use_error_feedback = step_name == "step"
            if not self.use_error_feedback and self.errors:  # restored before: not used now
                warn_residuals_dropped(self, "use_error_feedback")
                self.errors = {}
        if self.start_is_auto or (self.start_is_default and step_name != "step"):
            self.start_powersgd_iter = DEFAULT_START_ITER if step_name == "step" else DEFAULT_START_SYNCS
            self._start_note = "auto: the run's length is unknown"
        elif self.start_is_default:
            self.start_powersgd_iter, self._start_note = DEFAULT_START_ITER, "torch's default"

    def plan(self, facts, steps: int | None = None, step_name: str = "step") -> None:
        """Derives the start in the learner's exchange steps (``step_name``: minibatch ``"step"`` or
        ``"sync"``, whose defaults :meth:`count_steps_as` sets): ``"auto"`` (and the default for syncs) is 10%
        of the run's ``steps`` (a minibatch learner's are ``max_samples / minibatch_size`` when not given).
        Warns (rank 0, one line) when the start is not before the run's last exchange step: PowerSGD would
        never compress."""
        if step_name != self.step_name:  # a learner that did not say so when it was built
            self.count_steps_as(step_name)
        if steps is None and step_name == "step":
            max_samples, minibatch = getattr(facts, "max_samples", None), getattr(facts, "minibatch_size", None)
            if max_samples and minibatch:
                steps = math.ceil(max_samples / minibatch)
        if (self.start_is_auto or (self.start_is_default and step_name != "step")) and steps:
            self.start_powersgd_iter = math.ceil(AUTO_START_FRACTION * steps)
            self._start_note = f"auto: 10% of the run's {steps:,}"
        self._plan_rechecks(getattr(facts, "warmup_exchange_steps", None), steps)
        if steps is not None and self.start_powersgd_iter >= steps and (self.comm is None or self.comm.is_main):
            warnings.warn(f"learner.exchange.start_powersgd_iter={self.start_powersgd_iter} {step_name}s of plain "
                          f"all-reduce, but this run makes only {steps:,} {step_name}s: PowerSGD would never "
                          f"compress; use start_powersgd_iter=auto (10% of the run) or fewer",
                          RuntimeWarning, stacklevel=2)

    def _plan_rechecks(self, warmup_steps: int | None, steps: int | None) -> None:
        """``"auto"``: when the step measured for the rank (the last before the switch) lies inside the learning
        rate's warm-up (``warmup_steps`` exchange steps), the rank is measured again, each time on one more plain
        all-reduce step, after twice, four times, ... as many steps as that first measurement, and on the first
        step past the warm-up, as long as a compressed step follows. Early gradients have lower rank: on the
        language model shortened to a tenth, the measurement at 10% of the run (inside the warm-up) chose rank 2,
        where the full run's, past its warm-up, chooses 16 (``docs/exchange-strategies.md#powersgd-rank``)."""
        self._warmup_steps, self._run_steps, self._recheck_steps = warmup_steps, steps, ()
        measured = max(self.start_powersgd_iter - 1, 0)
        if not self.rank_is_auto or not warmup_steps or measured >= warmup_steps:
            return
        rechecks, count = [], 2 * (measured + 1)
        while count < warmup_steps:
            rechecks.append(count - 1)
            count *= 2
        rechecks.append(warmup_steps)
        first = max(self.start_powersgd_iter, measured + 1)  # the first compressed step, at the first rank
        last = steps - 2 if steps else math.inf  # a re-check needs a compressed step after it
        self._recheck_steps = tuple(step for step in rechecks if first < step <= last)

    def _describe_rechecks(self) -> str:
        """The re-checks :meth:`_plan_rechecks` planned, in words (1-based steps, as the rank's line counts)."""
        if not self._recheck_steps:
            return ""
        counts = [f"{step + 1:,}" for step in self._recheck_steps]
        listed = counts[0] if len(counts) == 1 else f"{', '.join(counts[:-1])} and {counts[-1]}"
        words = (f"; re-checked at {self.step_name}s {listed}, as the learning rate warms up over the first "
                 f"{self._warmup_steps:,}")
        if self._run_steps is not None and self._warmup_steps >= self._run_steps - 1:
            words += (f" (this run of {self._run_steps:,} ends inside the warm-up: a longer run's rank may be higher; "
                      f"learner.exchange.matrix_approximation_rank=R sets one)")
        return words

    @property
    def step(self) -> int:
        """Index of the current step (0-based; steps are counted by ``begin_step``)."""
        return max(self.steps_begun - 1, 0)

    def begin_step(self) -> None:
        """Starts a step: resets the byte counters and advances the step counter (the hook's ``iter``)."""
        super().begin_step()
        self.steps_begun += 1

    # -- the exchange ----------------------------------------------------------------------------
    def exchange_now(self, key: Hashable, flat: torch.Tensor, shapes: list[torch.Size]) -> torch.Tensor:
        """One bucket's PowerSGD exchange (or plain all-reduce before ``start_powersgd_iter``), blocking."""
        comm, world = self.comm, self.comm.size
        self.full_precision_bytes_last_step += full_precision_allreduce_bytes(flat.numel(), world)
        measuring = self._measuring_rank()
        if self.step < self.start_powersgd_iter or measuring:
            comm.allreduce(flat, op="sum")
            self.bytes_sent_last_step += full_precision_allreduce_bytes(flat.numel(), world)
            if measuring or (self.rank_is_auto and self.matrix_approximation_rank is None
                             and self.step >= self.start_powersgd_iter - 1):
                self._measure_spectrum(flat, shapes)
            return flat
        if self.rank_is_auto and self._spectrum is not None and self._spectrum["step"] != self._rank_measured_at:
            self._choose_rank()  # from the step just measured: the first choice, or a re-check
        device, dtype = flat.device, flat.dtype
        input_copy = None
        if self.use_error_feedback:
            if key in self.errors:
                flat.add_(self.errors[key])
            else:
                self.errors[key] = torch.zeros(flat.numel(), device=device, dtype=dtype)
            input_copy = flat.detach().clone()

        to_compress, uncompressed = [], []
        p_size = q_size = 0
        for tensor in split_views(flat, shapes):
            matrix = tensor.view(tensor.shape[0] if tensor.dim() else 1, -1)
            rows, cols = matrix.shape
            rank = min(rows, cols, self.matrix_approximation_rank)
            if should_compress(rows, cols, rank, self.min_compression_rate):
                to_compress.append(matrix)
                p_size += rows * rank
                q_size += cols * rank
            else:
                uncompressed.append(tensor)
        uncompressed_memory = (torch.cat([tensor.reshape(-1) for tensor in uncompressed]) if uncompressed
                               else torch.tensor([], device=device, dtype=dtype))

        need_random_qs = not self.warm_start or key not in self.p_memory
        if need_random_qs:
            self.p_memory[key] = torch.empty(p_size, device=device, dtype=dtype)
            self.q_memory[key] = torch.empty(q_size, device=device, dtype=dtype)
        by_shape: dict[torch.Size, list[torch.Tensor]] = defaultdict(list)  # the hook's order: grouped by shape
        for matrix in to_compress:
            by_shape[matrix.shape].append(matrix)
        matrices, ps, qs = [], [], []
        p_index = q_index = 0
        for group in by_shape.values():
            for matrix in group:
                rows, cols = matrix.shape
                rank = min(rows, cols, self.matrix_approximation_rank)
                matrices.append(matrix.unsqueeze(0))
                ps.append(self.p_memory[key][p_index:p_index + rows * rank].view(1, rows, rank))
                qs.append(self.q_memory[key][q_index:q_index + cols * rank].view(1, cols, rank))
                p_index += rows * rank
                q_index += cols * rank
        if not need_random_qs:
            for q in qs:
                orthogonalize_(q, self.orthogonalization_epsilon)
        else:
            # a private generator, seeded as the hook seeds the global one: the same draws, and the
            # exchange thread never touches the generator the training thread (dropout) draws from
            generator = torch.Generator().manual_seed(int(self.rng.randint(1_000_000_000)))
            for q in qs:
                q.copy_(torch.randn(*q.shape, device="cpu", dtype=dtype, generator=generator))
                orthogonalize_(q, self.orthogonalization_epsilon)
        for matrix, q, p in zip(matrices, qs, ps):
            torch.bmm(matrix, q, out=p)

        comm.allreduce(uncompressed_memory, op="sum")
        offset = 0
        for tensor in uncompressed:
            tensor.copy_(uncompressed_memory[offset:offset + tensor.numel()].view_as(tensor))
            offset += tensor.numel()
        comm.allreduce(self.p_memory[key], op="sum")
        for p in ps:
            orthogonalize_(p, self.orthogonalization_epsilon)
        for matrix, p, q in zip(matrices, ps, qs):
            torch.bmm(matrix.transpose(1, 2), p, out=q)
        comm.allreduce(self.q_memory[key], op="sum")
        for p, q, matrix in zip(ps, qs, matrices):
            torch.bmm(p, q.transpose(1, 2), out=matrix)

        if self.use_error_feedback:
            self.errors[key] = input_copy - flat / world
        if not self.warm_start:
            self.p_memory.clear()
            self.q_memory.clear()
        self.bytes_sent_last_step += sum(full_precision_allreduce_bytes(count, world)
                                         for count in (uncompressed_memory.numel(), p_size, q_size))
        return flat

    # -- the automatic rank ----------------------------------------------------------------------
    def _measuring_rank(self) -> bool:
        """Whether this step is still a plain all-reduce for ``"auto"``: no all-reduce step has been measured yet
        (``start_powersgd_iter=0``, or a checkpoint without it), this step is the one being measured, or it is
        one of the re-checks while the learning rate warms up (:meth:`plan`)."""
        if not self.rank_is_auto:
            return False
        if self.matrix_approximation_rank is None:
            return self._spectrum is None or self._spectrum["step"] == self.step
        return self.step in self._recheck_steps

    def _measure_spectrum(self, flat: torch.Tensor, shapes: list[torch.Size]) -> None:
        """Adds one all-reduced bucket (the same on every rank) to this step's tail energies
        (:func:`~dtrain.compress.lowrank.tail_energies`), each tensor viewed as the exchange views it."""
        if self._spectrum is None or self._spectrum["step"] != self.step:
            self._spectrum = {"step": self.step, "tails": [0.0] * len(CANDIDATE_RANKS), "total": 0.0}
        matrices = [tensor.view(tensor.shape[0] if tensor.dim() else 1, -1) for tensor in split_views(flat, shapes)]
        tails, total = tail_energies(matrices, self.min_compression_rate)
        self._spectrum["tails"] = [old + tails[rank] for old, rank in zip(self._spectrum["tails"], CANDIDATE_RANKS)]
        self._spectrum["total"] += total

    def _choose_rank(self) -> None:
        """Chooses the rank from the measured step (:func:`~dtrain.compress.lowrank.choose_rank`), rank 0's choice
        broadcast so all ranks size P and Q alike, and says so on rank 0 (one line). A re-check only raises the
        rank (a gradient of higher rank is the one measured later in training); P and Q of the old rank are then
        drawn afresh, the error kept."""
        tails = dict(zip(CANDIDATE_RANKS, self._spectrum["tails"]))
        rank, error = choose_rank(tails, self._spectrum["total"])
        previous = self.matrix_approximation_rank
        chosen = torch.tensor([rank if previous is None else max(rank, previous)], dtype=torch.int64,
                              device=self.comm.device)
        self.matrix_approximation_rank = int(self.comm.broadcast(chosen).item())
        self._rank_measured_at = self._spectrum["step"]
        if previous is not None and self.matrix_approximation_rank != previous:
            self.p_memory.clear()
            self.q_memory.clear()
        if self.comm.is_main:
            print(self._rank_line(tails, rank, error, previous), flush=True)

    def _rank_line(self, tails: dict[int, float], rank: int, error: float, previous: int | None) -> str:
        """The line saying which rank ``"auto"`` chose (or what a re-check found) and what it leaves out."""
        total, measured = self._spectrum["total"], f"{self.step_name} {self._spectrum['step'] + 1:,}"
        smaller = [f"rank {r}: {math.sqrt(tails[r] / total):.2f}" for r in CANDIDATE_RANKS
                   if r < rank and total > 0][-2:]
        others = f"; {', '.join(smaller)}" if smaller else ""
        leaves = (f"whose best approximation leaves {error:.2f} of {measured}'s all-reduced gradient out (at most "
                  f"{AUTO_RANK_ERROR}{others})")
        if previous is None:
            return (f"dtrain: PowerSGD rank auto: {rank}, {leaves}; learner.exchange.matrix_approximation_rank=R "
                    f"sets one")
        now = (f"rank {self.matrix_approximation_rank} from here on" if self.matrix_approximation_rank != previous
               else f"rank {previous} kept")
        return f"dtrain: PowerSGD rank auto re-checked as the learning rate warms up: {rank}, {leaves}: {now}"

    # -- state -----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This rank's state: the step counter, the seed generator, and per key the error, P and Q (CPU copies)."""
        self.drain()

        def cpu(tensors: dict) -> dict:
            return {key: tensor.detach().cpu().clone() for key, tensor in tensors.items()}
        state = {"name": self.name, "steps_begun": self.steps_begun, "rng": _rng_state(self.rng),
                 "errors": cpu(self.errors), "p_memory": cpu(self.p_memory), "q_memory": cpu(self.q_memory)}
        if self.rank_is_auto:
            state["auto_rank"] = {"rank": self.matrix_approximation_rank, "spectrum": self._spectrum,
                                  "measured_at": self._rank_measured_at}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores :meth:`state_dict`'s output (saved at the same world size). With error feedback off
        the saved errors are not used: they are dropped, and a warning says so (rank 0, one line)."""
        device = self.comm.device if self.comm is not None else torch.device("cpu")
        self.steps_begun = int(state["steps_begun"])
        self.rng.set_state(_rng_state_from(state["rng"]))
        errors = state["errors"]
        if errors and not self.use_error_feedback:
            warn_residuals_dropped(self, "use_error_feedback")
            errors = {}
        self.errors = {key: tensor.to(device) for key, tensor in errors.items()}
        self.p_memory = {key: tensor.to(device) for key, tensor in state["p_memory"].items()}
        self.q_memory = {key: tensor.to(device) for key, tensor in state["q_memory"].items()}
        if self.rank_is_auto:
            auto = state.get("auto_rank") or {"rank": None, "spectrum": None}
            self.matrix_approximation_rank, self._spectrum = auto["rank"], auto["spectrum"]
            # checkpoints before re-checks: the rank came from the one step measured
            self._rank_measured_at = auto.get("measured_at", None if auto["rank"] is None or auto["spectrum"] is None
                                              else auto["spectrum"]["step"])

    def reset(self) -> None:
        """Back to a fresh start: no error, new random Q, and ``start_powersgd_iter`` all-reduce steps again."""
        if hasattr(self, "steps_begun"):
            self.drain()  # never pull the state from under an exchange still running
        self.rng = np.random.RandomState(self.random_seed)
        self.errors: dict[Hashable, torch.Tensor] = {}
        self.p_memory: dict[Hashable, torch.Tensor] = {}
        self.q_memory: dict[Hashable, torch.Tensor] = {}
        self.steps_begun = 0
        if self.rank_is_auto:  # chosen again from the next measured step
            self.matrix_approximation_rank = None
        self._spectrum: dict[str, Any] | None = None  # the measured step: {"step", "tails" per CANDIDATE_RANKS, "total"}
        self._rank_measured_at: int | None = None  # the step whose measurement chose the rank in use


def _rng_state(rng: np.random.RandomState) -> dict[str, Any]:
    """The generator's state as tensors and numbers (checkpoints are read with ``weights_only=True``)."""
    kind, keys, position, has_gauss, cached = rng.get_state()
    return {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "position": int(position),
            "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}


def _rng_state_from(state: dict[str, Any]) -> tuple:
    """Inverse of :func:`_rng_state`."""
    return (state["kind"], state["keys"].numpy().astype(np.uint32), state["position"], state["has_gauss"],
            state["cached_gaussian"])


__all__ = ["PowerSGD"]
