"""Worker run by tests/dist/test_fsdp_mpi.py under mpiexec: ``python _fsdp_worker.py RUN_DIR``.

``learner=fsdp`` (parameters, gradients and optimizer state sharded over the ranks, torch's FSDP2) against one
process reading the same global minibatches, through the public API (``training_session``).

Checks:
  attention       a GPT-style char transformer (tied read-out, one unit per block) on token sequences of uneven
                  lengths, AdamW, with and without micro-batches: equal to one process (relative 1e-6); the ranks'
                  token shares differ; model.safetensors (gathered) equals the one-process run's file.
  convolutions    a Conv1d + BatchNorm model (one unit per child), SGD with momentum, sync_batchnorm: equal to one
                  process, parameters and BatchNorm statistics.
  clipping        clip_grad_norm clips by the global norm across shards: equal to one process with clipping, and
                  the clipping acted.
  settings        activation_checkpointing and reshard_after_forward=false give the same update; bfloat16
                  parameters close to it; a hand-driven loop that never folds the gradient scale equals one process.
  hsdp            shard_over="host" on two hosts of N/2 ranks: equal to one process; each rank holds 2/N of the
                  model; its sharded checkpoint resumed by the flat learner ends where it did.
  weight_ema      session.ema_decay kept in shards: model_ema.safetensors and the EMA's test pass equal
                  data_parallel's, the live weights untouched by the EMA's pass; its checkpoint resumed bit for bit,
                  and across sharded and replicated learners both ways.
  refusals        one line each: a wrap policy matching nothing, parameters tied across units, cpu_offload on the
                  CPU, session settings fp16/compile.
"""
from __future__ import annotations

import io
import os
import sys
from functools import partial
from pathlib import Path

import torch
from torch import nn

import dtrain
from dtrain.comm import LocalCommunicator, create_communicator
from dtrain.learners import FSDPLearner, LocalLearner, data_parallel_distributed_learner, fsdp_learner
from dtrain.models.char_transformer import CharTransformer
from dtrain.session import SequenceCrossEntropy

from tests.helpers.checks import run_checks
from tests.helpers.sequence_data import VOCABULARY, token_sequences
from tests.helpers.toy_data import four_class_data

MINIBATCH = dtrain.Schedule([[3, 37], [1, 5], [2, 61]], epoch_size=40)  # tokens; 5: fewer sequences than ranks
MAX_SAMPLES = 500


def whole(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of ``model``, whole (a sharded one gathered: a collective)."""
    from torch.distributed.tensor import DTensor

    return {name: (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()
            for name, tensor in model.state_dict().items()}


def relative_differences(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> dict[str, float]:
    """``max|a - b| / max|b|`` of each floating-point tensor."""
    return {name: float((got[name].float() - tensor.float()).abs().max() / tensor.float().abs().max().clamp_min(1e-12))
            for name, tensor in expected.items() if tensor.is_floating_point() and tensor.numel()}


def relative_difference(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    """The largest ``max|a - b| / max|b|`` over the tensors (floating point ones)."""
    return max(relative_differences(got, expected).values())


def worst(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> str:
    differences = relative_differences(got, expected)
    return max(differences, key=differences.get)


def held_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[int, int, int]:
    """``(parameter bytes, optimizer state bytes, bytes of one first-dimension row of every parameter)``: what this
    rank holds of the first two (its shards of a sharded model, ``DTensor.to_local``; all of a replicated one), and
    what an uneven cut may add to a rank's share of the parameters."""
    from torch.distributed.tensor import DTensor

    def local(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to_local() if isinstance(tensor, DTensor) else tensor

    parameters = [local(parameter.detach()) for parameter in model.parameters()]
    state = [] if optimizer is None else [local(value) for per_parameter in optimizer.state.values()
                                          for value in per_parameter.values()
                                          if isinstance(value, torch.Tensor) and value.dim() > 0]
    return (sum(t.numel() * t.element_size() for t in parameters), sum(t.numel() * t.element_size() for t in state),
            sum(p.numel() // max(p.shape[0], 1) * p.element_size() for p in model.parameters()))


def char_model() -> nn.Module:
    torch.manual_seed(0)
    return CharTransformer(VOCABULARY, context_length=64, layers=2, heads=2, width=16)


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    # eps 1e-4: the attention's key bias has a gradient of exactly zero in theory (softmax ignores a shift), so its
    # float noise (1e-9) differs between any two summation orders and Adam's default eps 1e-8 would turn that noise
    # into whole steps; with 1e-4 the comparison sees the update, not the noise
    return torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1, eps=1e-4)


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)


def lm_session(model, learner, run_dir: Path, **options):
    return dtrain.training_session(
        model, SequenceCrossEntropy(), learner, dtrain.MinibatchSource(token_sequences(), randomization_seed=4),
        MINIBATCH, max_samples=MAX_SAMPLES, inputs=["text[:-1]"], target="text[1:]", run_dir=run_dir,
        tensorboard=False, stream=io.StringIO(), independent_processes=learner.comm.size == 1, **options)


def reference_lm(run_dir: Path, comm, name: str, **options) -> dict[str, torch.Tensor]:
    model = char_model()
    lm_session(model, LocalLearner(adamw(model), LocalCommunicator()), run_dir / f"{name}_reference{comm.rank}",
               **options).train()
    return whole(model)


def check_attention(comm, run_dir: Path) -> dict:
    from safetensors.torch import load_file

    figures: dict = {"size": comm.size}
    for micro in (None, 9):
        model = char_model()
        learner = fsdp_learner(adamw(model), comm)
        shares = []
        original = learner.begin_minibatch

        def record(local, global_, original=original):
            shares.append(local)
            original(local, global_)
        learner.begin_minibatch = record
        lm_session(model, learner, run_dir / f"lm{micro}", micro_batch_size=micro).train()
        got = whole(model)
        expected = reference_lm(run_dir, comm, f"lm{micro}", micro_batch_size=micro)
        figures[f"relative_difference_micro{micro}"] = relative_difference(got, expected)
        figures[f"worst_micro{micro}"] = worst(got, expected)
        replicated = char_model()
        lm_session(replicated, data_parallel_distributed_learner(adamw(replicated), comm),
                   run_dir / f"lm_dp{micro}", micro_batch_size=micro).train()
        figures[f"relative_difference_to_data_parallel_micro{micro}"] = relative_difference(got, whole(replicated))
        figures[f"units_micro{micro}"] = len(learner.units)
        figures[f"sharded_micro{micro}"] = all(type(p).__name__ == "DTensor" for p in model.parameters())
        everyone = comm.allgather_object(shares)
        figures[f"uneven_minibatches_micro{micro}"] = sum(len(set(per)) > 1 for per in zip(*everyone))
        if micro is None:
            figures["bytes"] = comm.allgather_object(held_bytes(model, learner.optimizer))
            figures["bytes_replicated"] = held_bytes(replicated, None)[0]
            figures["moved_by"] = relative_difference({n: t for n, t in got.items() if n.endswith("weight")},
                                                      {n: t for n, t in whole(char_model()).items() if n.endswith("weight")})
            if comm.is_main:
                mine = load_file(str(run_dir / "lmNone" / "model.safetensors"))
                theirs = load_file(str(run_dir / "lmNone_reference0" / "model.safetensors"))
                figures["weights_same_names"] = sorted(mine) == sorted(theirs)
                figures["weights_difference"] = relative_difference(mine, theirs)
    return figures


class ConvNet(nn.Sequential):
    """Six features as a one-channel signal: Conv1d, BatchNorm, ReLU, Conv1d, ReLU, a linear read-out."""

    def __init__(self):
        torch.manual_seed(0)
        super().__init__(nn.Unflatten(1, (1, 6)), nn.Conv1d(1, 4, 3, padding=1), nn.BatchNorm1d(4), nn.ReLU(),
                         nn.Conv1d(4, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(16, 4))


def conv_session(model, learner, run_dir: Path):
    return dtrain.training_session(
        model, nn.functional.cross_entropy, learner,
        dtrain.MinibatchSource(four_class_data(), randomize=True, randomization_seed=5),
        dtrain.Schedule([[2, 7], [1, 1], [1, 3], [1, 13]], epoch_size=7), max_samples=200, run_dir=run_dir,
        tensorboard=False, stream=io.StringIO(), independent_processes=learner.comm.size == 1, sync_batchnorm=True)


def check_convolutions(comm, run_dir: Path) -> dict:
    model = ConvNet()
    learner = fsdp_learner(sgd(model), comm, wrap="children")
    conv_session(model, learner, run_dir / "conv").train()
    got = whole(model)
    reference = ConvNet()
    conv_session(reference, LocalLearner(sgd(reference), LocalCommunicator()), run_dir / f"conv_ref{comm.rank}").train()
    expected = whole(reference)
    return {"relative_difference": relative_difference(got, expected), "units": len(learner.units),
            "running_var_difference": float((got["2.running_var"] - expected["2.running_var"]).abs().max())}


def check_clipping(comm, run_dir: Path) -> dict:
    model = char_model()
    lm_session(model, fsdp_learner(adamw(model), comm), run_dir / "clip", clip_grad_norm=0.05).train()
    got = whole(model)
    expected = reference_lm(run_dir, comm, "clip", clip_grad_norm=0.05)
    unclipped = reference_lm(run_dir, comm, "noclip")
    return {"relative_difference": relative_difference(got, expected),
            "clipping_changed_the_model": relative_difference(expected, unclipped)}


def check_settings(comm, run_dir: Path) -> dict:
    figures = {}
    expected = reference_lm(run_dir, comm, "settings")
    for name, options in {"activation_checkpointing": {"activation_checkpointing": True},
                          "no_reshard": {"reshard_after_forward": False},
                          "bfloat16": {"param_dtype": "bfloat16"}}.items():
        model = char_model()
        lm_session(model, fsdp_learner(adamw(model), comm, **options), run_dir / name).train()
        figures[name] = relative_difference(whole(model), expected)
    # driven by hand, without fold_gradient_scale: the learner scales the output's gradient itself
    model, reference = char_model(), char_model()
    learner = FSDPLearner(adamw(model), comm)
    learner.prepare(model)
    local = LocalLearner(adamw(reference), LocalCommunicator())
    generator = torch.Generator().manual_seed(3)
    for _ in range(4):
        tokens = torch.randint(0, VOCABULARY, (7, 9), generator=generator)
        share = torch.tensor_split(tokens, comm.size)[comm.rank]
        learner.begin_minibatch(len(share), len(tokens))
        if len(share):
            logits = model(share[:, :-1])
        else:
            logits = model(tokens[:0, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCABULARY), share[:, 1:].reshape(-1)) if len(share) \
            else logits.sum() * 0.0
        loss.backward()
        learner.step()
        local.begin_minibatch(len(tokens), len(tokens))
        nn.functional.cross_entropy(reference(tokens[:, :-1]).reshape(-1, VOCABULARY),
                                    tokens[:, 1:].reshape(-1)).backward()
        local.step()
    figures["hand_driven"] = relative_difference(whole(model), whole(reference))
    figures["hand_driven_worst"] = worst(whole(model), whole(reference))
    return figures


def _refusal(action) -> str:
    try:
        action()
    except ValueError as error:
        return str(error)
    return "(accepted)"


def check_refusals(comm, run_dir: Path) -> dict:
    def sharded(model, **options):
        learner = fsdp_learner(adamw(model), comm, **options)
        learner.shard(model, "cpu")
        return learner

    refused = {
        "no_match": _refusal(lambda: sharded(char_model(), wrap=["Bottleneck"])),
        "tied": _refusal(lambda: sharded(char_model(), wrap="children")),
        "cpu_offload": _refusal(lambda: sharded(char_model(), cpu_offload=True)),
        "bad_wrap": _refusal(lambda: fsdp_learner(adamw(char_model()), comm, wrap="layers")),
        "bad_dtype": _refusal(lambda: fsdp_learner(adamw(char_model()), comm, param_dtype="float16")),
    }
    for name, options in {"fp16": {"precision": "fp16"}, "compile": {"compile": True}}.items():
        model = char_model()
        refused[name] = _refusal(lambda: lm_session(model, fsdp_learner(adamw(model), comm), run_dir / name,
                                                    **options))
    return refused


def check_weight_ema(comm, run_dir: Path) -> dict:
    """The weight EMA of a sharded model against data_parallel's, its test pass, and its checkpoints resumed."""
    from safetensors.torch import load_file

    from dtrain.session import CheckpointConfig, TestConfig

    def run(name: str, sharded: bool, restore_from: Path | None = None):
        model = char_model()
        learner = fsdp_learner(adamw(model), comm) if sharded else \
            data_parallel_distributed_learner(adamw(model), comm)
        test = TestConfig(dtrain.MinibatchSource(token_sequences(), randomize=False, max_sweeps=1), minibatch_size=64)
        result = lm_session(model, learner, run_dir / name, ema_decay=0.8, test_config=test,
                            checkpoint_config=CheckpointConfig("checkpoint.pt", frequency=250, keep_last=5,
                                                               restore_from=restore_from)).train()
        average = load_file(str(run_dir / name / "model_ema.safetensors")) if comm.is_main else None
        return whole(model), result, average

    def first_checkpoint(name: str) -> Path:
        return min((run_dir / name).glob("checkpoint-*.pt"), key=lambda path: int(path.name.split("-")[1][:-3]))

    sharded, sharded_result, sharded_average = run("ema_fsdp", True)
    replicated, replicated_result, replicated_average = run("ema_dp", False)
    _, resumed_result, resumed_average = run("ema_fsdp_resumed", True, first_checkpoint("ema_fsdp"))
    _, _, from_sharded = run("ema_dp_from_fsdp", False, first_checkpoint("ema_fsdp"))
    _, _, from_replicated = run("ema_fsdp_from_dp", True, first_checkpoint("ema_dp"))
    figures = {"parameters": relative_difference(sharded, replicated),
               "test_ema_loss": abs(sharded_result.test_ema.loss - replicated_result.test_ema.loss),
               "ema_against_live": abs(sharded_result.test_ema.loss - sharded_result.test.loss),
               "restored": [None if result.restored_from is None else result.restored_from.name
                            for result in (resumed_result,)]}
    if comm.is_main:
        figures["average"] = relative_difference(sharded_average, replicated_average)
        figures["average_moved"] = relative_difference(sharded, sharded_average)  # an average, not the last weights
        figures["resumed"] = max(float((resumed_average[name] - sharded_average[name]).abs().max())
                                 for name in sharded_average)
        figures["replicated_from_sharded"] = relative_difference(from_sharded, sharded_average)
        figures["sharded_from_replicated"] = relative_difference(from_replicated, replicated_average)
    return figures


def check_hsdp(comm, run_dir: Path) -> dict:
    """``shard_over="host"`` with the job cut into two hosts (``comm.ranks_per_host``: half the ranks): one process's
    update; a host's ranks each hold ``1/R`` of the model; its sharded checkpoint resumed by the flat learner."""
    from dtrain.session import CheckpointConfig

    figures: dict = {"size": comm.size}
    previous, comm.ranks_per_host = comm.ranks_per_host, max(comm.size // 2, 1)
    try:
        model = char_model()
        learner = fsdp_learner(adamw(model), comm, shard_over="host")
        lm_session(model, learner, run_dir / "hsdp",
                   checkpoint_config=CheckpointConfig("checkpoint.pt", frequency=125, keep_last=5)).train()
        got = whole(model)
        figures["relative_difference"] = relative_difference(got, reference_lm(run_dir, comm, "hsdp"))
        figures["mesh"] = [list(learner.mesh.mesh.shape), list(learner.mesh.mesh_dim_names)]
        figures["bytes"] = comm.allgather_object(held_bytes(model, learner.optimizer))
        figures["bytes_whole"] = held_bytes(char_model(), None)[0]
        figures["describe"] = learner.describe()
    finally:
        comm.ranks_per_host = previous
    # the flat learner resumes the HSDP run's checkpoint at 280 (DCP reshards the 2-D shards) and ends where it did
    flat = char_model()
    resumed = fsdp_learner(adamw(flat), comm)
    result = lm_session(flat, resumed, run_dir / "hsdp_flat", checkpoint_config=CheckpointConfig(
        "checkpoint.pt", frequency=125, restore_from=run_dir / "hsdp" / "checkpoint-280.pt")).train()
    figures["restored_from"] = None if result.restored_from is None else result.restored_from.name
    figures["flat_resume_difference"] = relative_difference(whole(flat), got)
    return figures


def main() -> None:
    run_dir = Path(sys.argv[1])
    torch.set_num_threads(1)  # several ranks share two cores
    comm = create_communicator(backend=os.environ.get("WORKER_BACKEND", "gloo"), timeout_s=60)
    checks = {"attention": partial(check_attention, run_dir=run_dir),
              "convolutions": partial(check_convolutions, run_dir=run_dir),
              "clipping": partial(check_clipping, run_dir=run_dir),
              "settings": partial(check_settings, run_dir=run_dir),
              "refusals": partial(check_refusals, run_dir=run_dir),
              "weight_ema": partial(check_weight_ema, run_dir=run_dir),
              "hsdp": partial(check_hsdp, run_dir=run_dir)}
    only = os.environ.get("FSDP_CHECKS")
    if only:
        checks = {name: check for name, check in checks.items() if name in only.split(",")}
    run_checks(comm, checks)
    comm.finalize()


if __name__ == "__main__":
    main()
