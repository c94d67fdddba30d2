"""The CUDA paths on a machine with a GPU: every learner's collective code on CUDA tensors, NCCL, and the
command line training on the GPU. Skipped where ``torch.cuda.is_available()`` is False (CI has no GPU).

Run them with ``python -m pytest -m gpu`` on a machine with one GPU or more.
"""
from __future__ import annotations

import copy
import re
import shutil

import pytest
import torch
from hydra.utils import instantiate

from dtrain.learners.base import RunFacts
from dtrain.session import checkpoint

from tests.helpers.cli import run_dtrain
from tests.helpers.config import compose_config
from tests.helpers.mpi import run_mpi
from tests.helpers.thread_world import FakeWorld

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

#: each learner as a user picks it, with its defaults (the automatic warm starts: a quarter of the 8 steps)
LEARNERS = {
    "data_parallel": ["learner=data_parallel"],
    "quantized": ["learner=quantized"],
    "quantized 2-bit": ["learner=quantized", "learner.exchange.num_bits=2"],
    "powersgd": ["learner=powersgd"],
    "bf16": ["learner=data_parallel", "learner/exchange=bf16"],
    "fp16": ["learner=data_parallel", "learner/exchange=fp16"],
    "block_momentum": ["learner=block_momentum", "learner.block_size=64"],
    "diloco": ["learner=diloco", "learner.block_size=64"],
}


#: how far the CUDA run may drift from the CPU run, as a fraction of how far training moved the parameters:
#: PowerSGD orthogonalises its low-rank factors, which magnifies rounding (0.15 was seen on an H100)
DRIFT = {"powersgd": 0.3}


def _train_on(devices: list[str], overrides: list[str], steps: int = 8) -> list[list[torch.Tensor]]:
    """Two ranks in threads (rank r on ``devices[r]``), each with its own share of a fixed stream; returns
    every rank's final parameters, on the CPU."""
    config = compose_config("+recipe=digits", *overrides)
    torch.manual_seed(0)  # here, not in the threads, which share torch's global generator
    start = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.ReLU(), torch.nn.Linear(96, 10))

    def work(comm):
        model = copy.deepcopy(start).to(comm.device)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        learner = instantiate(config.learner, optimizer=optimizer, comm=comm)
        learner.plan(RunFacts(samples_per_sweep=1024, max_samples=steps * 32, minibatch_size=32))
        learner.prepare(model)
        generator = torch.Generator().manual_seed(comm.rank)
        for _ in range(steps):
            features, labels = torch.randn(16, 64, generator=generator), torch.randint(0, 10, (16,), generator=generator)
            learner.begin_minibatch(16, 32)
            loss = torch.nn.functional.cross_entropy(model(features.to(comm.device)), labels.to(comm.device))
            (loss * learner.fold_gradient_scale()).backward()
            learner.step()
        learner.synchronize()
        assert all(p.device.type == comm.device.type for p in model.parameters())
        return [p.detach().cpu().clone() for p in model.parameters()]

    return FakeWorld(2, devices=devices).run(work)


def _largest_difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


@pytest.mark.parametrize("name", list(LEARNERS))
def test_each_learner_on_cuda_agrees_with_its_cpu_peer_and_with_a_cpu_run(name):
    """Rank 0 on CUDA, rank 1 on the CPU: both apply the same exchanged update, so they agree to rounding
    (CUDA and CPU float32 differ in the last bits); the run stays close to the same run on two CPU ranks,
    where a lossy code flipped by that rounding may move it a little."""
    start = _train_on(["cpu"], LEARNERS[name], steps=0)[0]
    mixed, on_cpu = _train_on(["cuda", "cpu"], LEARNERS[name]), _train_on(["cpu"], LEARNERS[name])
    moved = _largest_difference(on_cpu[0], start)
    assert moved > 1e-2, f"{name}: training moved the parameters by only {moved}"
    between_ranks = _largest_difference(mixed[0], mixed[1])
    assert between_ranks < 1e-5, f"{name}: the CUDA rank and the CPU rank differ by {between_ranks}"
    from_cpu_run = _largest_difference(mixed[0], on_cpu[0])
    assert from_cpu_run < DRIFT.get(name, 0.1) * moved, f"{name}: CUDA run differs from the CPU run by {from_cpu_run} (moved {moved})"


def test_nccl_world_of_one_runs_every_collective_and_a_learner_step():
    """torch.distributed with NCCL (one rank: one GPU is enough) under the communicator and the learner."""
    from dtrain.comm.torch_dist import TorchDistCommunicator
    from dtrain.learners import DataParallelLearner

    comm = TorchDistCommunicator(backend="nccl", rank=0, size=1, local_rank=0, local_size=1,
                                 store=torch.distributed.HashStore())
    try:
        assert comm.device == torch.device("cuda", 0)
        tensor = torch.arange(4.0, device=comm.device)
        assert torch.equal(comm.allreduce(tensor.clone(), op="sum"), tensor)
        assert torch.equal(comm.allreduce_async(tensor.clone()).wait(), tensor)
        assert torch.equal(comm.broadcast(tensor.clone()), tensor)
        assert comm.allgather_object({"rank": 0}) == [{"rank": 0}]
        comm.barrier()

        torch.manual_seed(0)
        model = torch.nn.Linear(8, 3).to(comm.device)
        reference = torch.nn.Linear(8, 3).to(comm.device)
        reference.load_state_dict(model.state_dict())
        learner = DataParallelLearner(torch.optim.SGD(model.parameters(), lr=0.1), comm)
        plain = torch.optim.SGD(reference.parameters(), lr=0.1)
        learner.prepare(model)
        for step in range(3):
            features = torch.randn(5, 8, device=comm.device)
            learner.begin_minibatch(5, 5)
            model(features).square().mean().backward()
            learner.step()
            reference(features).square().mean().backward()
            plain.step()
            plain.zero_grad()
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))

        sub = comm.split(0)  # a sub-communicator is an NCCL group of its own, on the same GPU
        assert (sub.rank, sub.size, sub.device) == (0, 1, comm.device)
        assert torch.equal(sub.allreduce(tensor.clone(), op="sum"), tensor)
        assert comm.split(None) is None
        local, leaders = comm.host_groups()
        assert local.size == 1 and leaders is not None and leaders.size == 1
        assert torch.equal(leaders.allreduce(tensor.clone(), op="sum"), tensor)
        local.barrier()
    finally:
        comm.finalize()


def test_digits_recipe_trains_on_the_gpu_and_resumes_on_the_cpu(tmp_path):
    """The user's first command on a GPU machine trains there; its checkpoint carries on without a GPU."""
    first = run_dtrain("+recipe=digits", "run_dir=run", "session.max_samples=9000", cwd=tmp_path, gpu=True)
    assert first.returncode == 0, first.stderr
    assert f"parameters on cuda:0 ({torch.cuda.get_device_name(0)})" in first.stdout, first.stdout
    accuracy = float(re.search(r"test: accuracy ([\d.]+)%", first.stdout).group(1))
    assert accuracy >= 95.0, first.stdout
    state = checkpoint.load(tmp_path / "run" / "checkpoint-9000.pt")
    assert state["samples_seen"] == 9000
    on_cpu = run_dtrain("+recipe=digits", "run_dir=run", "session.max_samples=12000", "comm.backend=gloo",
                        cwd=tmp_path, gpu=True)
    assert on_cpu.returncode == 0, on_cpu.stderr
    assert "restored" in on_cpu.stdout and "at 9000 samples" in on_cpu.stdout, on_cpu.stdout


def test_synchronized_batchnorm_trains_on_the_gpu(tmp_path):
    """``session.sync_batchnorm=true`` on a BatchNorm model: the session's synchronized layers run on CUDA."""
    result = run_dtrain("+recipe=digits", "model.batch_norm=true", "session.sync_batchnorm=true", "run_dir=run",
                        "session.max_samples=9000", cwd=tmp_path, gpu=True)
    assert result.returncode == 0, result.stderr
    assert "parameters on cuda:0" in result.stdout, result.stdout
    assert float(re.search(r"test: accuracy ([\d.]+)%", result.stdout).group(1)) >= 95.0, result.stdout


@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="needs mpiexec")
def test_more_ranks_than_gpus_on_a_node(tmp_path):
    """``mpiexec -n K`` with K above the node's GPU count: the automatic backend does not give a rank no GPU."""
    ranks = torch.cuda.device_count() + 1
    result = run_mpi(ranks, ["-m", "dtrain", "+recipe=digits", f"run_dir={tmp_path / 'run'}",
                             "session.max_samples=2000"], timeout=240)
    assert result.returncode == 0, result.report()
    assert f"parameters on the CPU, {ranks} workers (mpi)" in result.stdout, result.stdout  # one node: MPI


def test_a_sequence_model_trains_on_the_gpu_as_on_the_cpu(tmp_path):
    """Sequences on CUDA: the padded data and the mask move to the GPU, the lengths stay on the CPU (where
    pack_padded_sequence wants them), and a causal attention LM ends where the CPU run ends."""
    import io

    import dtrain
    from dtrain.comm import LocalCommunicator
    from dtrain.session import SequenceCrossEntropy

    from tests.helpers.sequence_data import TinyCausalLM, token_sequences

    batch = dtrain.MinibatchSource(token_sequences()).next_minibatch(40).to(torch.device("cuda"))
    text = batch["text"]
    assert text.data.is_cuda and text.mask.is_cuda and text.lengths.device.type == "cpu"
    finals = []
    for device in ("cpu", "cuda"):
        torch.manual_seed(0)
        model = TinyCausalLM()
        learner = dtrain.LocalLearner(torch.optim.SGD(model.parameters(), lr=0.3),
                                      LocalCommunicator(device=torch.device(device)))
        dtrain.training_session(model, SequenceCrossEntropy(), learner, dtrain.MinibatchSource(token_sequences()),
                                40, max_samples=400, inputs=["text[:-1]"], target="text[1:]",
                                run_dir=tmp_path / device, tensorboard=False, stream=io.StringIO()).train()
        finals.append([p.detach().cpu() for p in model.parameters()])
    torch.manual_seed(0)
    moved = _largest_difference(finals[0], [p.detach() for p in TinyCausalLM().parameters()])
    assert _largest_difference(*finals) <= 1e-3 * max(moved, 1.0)


def test_the_noise_scale_on_the_gpu_is_the_cpu_one(tmp_path, capsys):
    from dtrain.noise_scale import main as noise_scale

    run_dir = tmp_path / "run"
    trained = run_dtrain("+recipe=digits", "session.max_samples=640", "session.checkpoint.frequency=640",
                         f"run_dir={run_dir}", cwd=tmp_path, gpu=True)
    assert trained.returncode == 0, trained.stderr[-2000:]
    rows = []
    for device in ("cpu", "cuda"):
        assert noise_scale([str(run_dir), "--minibatches", "16", "--device", device]) == 0
        rows.append([line for line in capsys.readouterr().out.splitlines() if line.startswith("| 640 |")])
    cpu, cuda = (float(row[0].split("|")[3].split("+-")[0].replace(",", "")) for row in rows)
    assert cuda == pytest.approx(cpu, rel=0.05)  # cuDNN may convolve in TF32: the ratio of differences amplifies it


def test_a_stream_on_the_gpu_holding_nan_is_named_without_a_wait_per_minibatch(tmp_path):
    """A transform that serves its features on the GPU (as DALI's GPU pipeline does): its NaN is found by a
    check queued on the device and read back once done, and named before the loss is judged."""
    import io

    import numpy as np

    from dtrain import LocalLearner, MinibatchSource, training_session
    from dtrain.data import ArrayDeserializer, DataError

    features = np.random.default_rng(0).normal(size=(64, 4)).astype(np.float32)
    data = ArrayDeserializer(features, np.arange(64) % 2, num_classes=2)

    def to_gpu_with_nan_at_40(batch, positions, seed):
        batch = batch.cuda()
        batch[torch.as_tensor(positions == 40, device="cuda")] = float("nan")
        return batch

    source = MinibatchSource(data, randomize=False, transform=to_gpu_with_nan_at_40)
    for _ in range(5):
        source.next_minibatch(8)  # samples 0-39: nothing waits, nothing is refused
    source.next_minibatch(8)
    with pytest.raises(DataError, match=r"^stream 'features': sample 40 of ArrayDeserializer .* holds NaN"):
        source.check_pending_values()

    model = torch.nn.Linear(4, 2).cuda()
    learner = LocalLearner(torch.optim.SGD(model.parameters(), lr=0.1))
    session = training_session(model, torch.nn.functional.cross_entropy, learner,
                               MinibatchSource(data, randomize=False, transform=to_gpu_with_nan_at_40), 8,
                               max_samples=64, progress_frequency=32, run_dir=tmp_path, tensorboard=False,
                               stream=io.StringIO(), device="cuda")
    with pytest.raises(DataError, match=r"sample 40 of ArrayDeserializer"):
        session.train()
