"""Session settings of issue 12: micro-batches, gradient clipping, bf16 precision (one process, CPU)."""
from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
from torch import nn

from dtrain import LocalLearner, MinibatchSource, training_session

from tests.helpers.toy_data import four_class_data


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 4))


def train(run_dir: Path, model: nn.Module, *, lr: float = 0.1, momentum: float = 0.9, minibatch_size: int = 20,
          max_samples: int = 200, **options):
    learner = LocalLearner(torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum))
    session = training_session(model, nn.functional.cross_entropy, learner,
                               MinibatchSource(four_class_data(), randomize=True, randomization_seed=5),
                               minibatch_size=minibatch_size, max_samples=max_samples, run_dir=run_dir,
                               tensorboard=False, stream=io.StringIO(), **options)
    return session.train(), learner


def test_micro_batches_give_the_update_of_the_whole_minibatch(tmp_path):
    """Shares of 20 computed in passes of 3 (6 of 3 and one of 2): the same parameters as one pass."""
    whole, capped = make_model(), make_model()
    train(tmp_path / "whole", whole)
    passes = []
    capped.register_forward_hook(lambda module, inputs, output: passes.append(inputs[0].shape[0]))
    result, _ = train(tmp_path / "capped", capped, micro_batch_size=3)
    assert result.minibatches == 10
    assert passes[:7] == [3, 3, 3, 3, 3, 3, 2] and len(passes) == 70
    for name, parameter in whole.named_parameters():
        torch.testing.assert_close(dict(capped.named_parameters())[name], parameter, rtol=1e-5, atol=1e-6)
    assert not torch.equal(whole[0].weight, make_model()[0].weight)  # training did something


def test_clipping_matches_clip_grad_norm_on_the_minibatch_gradient(tmp_path):
    """One minibatch of 20 with clip_grad_norm=0.05: p - lr * clip(grad of the mean loss), by hand."""
    model, reference = make_model(), make_model()
    order = MinibatchSource(four_class_data(), randomize=True, randomization_seed=5).next_minibatch(20, 1, 0)
    loss = nn.functional.cross_entropy(reference(order.features), order.labels)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(list(reference.parameters()), 0.05)
    assert norm > 0.05  # the clip is active
    expected = [parameter - 0.1 * parameter.grad for parameter in reference.parameters()]
    train(tmp_path / "run", model, momentum=0.0, max_samples=20, clip_grad_norm=0.05)
    for parameter, wanted in zip(model.parameters(), expected):
        torch.testing.assert_close(parameter, wanted, rtol=1e-6, atol=1e-7)
    unclipped = make_model()
    train(tmp_path / "off", unclipped, momentum=0.0, max_samples=20)
    assert not torch.allclose(unclipped[0].weight, model[0].weight)


def test_bf16_autocasts_the_forward_on_the_cpu_and_trains(tmp_path):
    seen = []
    model = make_model()
    model.register_forward_hook(lambda module, inputs, output: seen.append(output.dtype))
    result, _ = train(tmp_path / "bf16", model, precision="bf16", max_samples=400)
    assert set(seen) == {torch.bfloat16}
    assert all(parameter.dtype == torch.float32 for parameter in model.parameters())
    assert result.last_training_error is not None and result.last_training_error < 0.5  # 4 classes: chance 0.75
    plain = []
    model = make_model()
    model.register_forward_hook(lambda module, inputs, output: plain.append(output.dtype))
    train(tmp_path / "fp32", model, max_samples=20)
    assert set(plain) == {torch.float32}


@pytest.mark.parametrize("options, message", [
    ({"micro_batch_size": 0}, "micro_batch_size=0: expected a positive whole number of samples"),
    ({"clip_grad_norm": -1.0}, "clip_grad_norm=-1.0: expected"),
    ({"precision": "16"}, "precision='16': expected one of 32, bf16, fp16"),
    ({"precision": "float16"}, "precision='float16': expected one of 32, bf16, fp16"),
])
def test_bad_session_settings_are_refused_naming_them(tmp_path, options, message):
    with pytest.raises(ValueError) as error:
        train(tmp_path, make_model(), **options)
    assert str(error.value).startswith(message)


def test_config_checks_the_new_session_settings():
    from test_config import compose_config

    from dtrain.config import validate

    problems = validate(compose_config("+recipe=digits", "session.micro_batch_size=0", "session.clip_grad_norm=-2",
                                       "session.precision=fp32", "session.tensorboard=null"), check_run_dir=False)
    assert any(p.startswith("session.micro_batch_size=0") for p in problems), problems
    assert any(p.startswith("session.clip_grad_norm=-2") for p in problems), problems
    assert any(p.startswith("session.precision='fp32'") for p in problems), problems
    assert not any("tensorboard" in p for p in problems), problems  # null: "when installed" is a valid choice
    good = validate(compose_config("+recipe=digits", "session.micro_batch_size=8", "session.clip_grad_norm=1.0",
                                   "session.precision=bf16"), check_run_dir=False)
    assert good == [], good


class OverflowOnCall:
    """Cross-entropy whose ``call``-th evaluation is multiplied by 1e38, so the scaled fp16 gradient overflows."""

    def __init__(self, call: int):
        self.call, self.calls = call, 0

    def __call__(self, output, labels):
        self.calls += 1
        loss = nn.functional.cross_entropy(output, labels)
        return loss * 1e38 if self.calls == self.call else loss


def train_fp16(run_dir: Path, model: nn.Module, loss, max_samples: int, **options):
    learner = LocalLearner(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    session = training_session(model, loss, learner, MinibatchSource(four_class_data(), randomize=True, randomization_seed=5),
                               minibatch_size=20, max_samples=max_samples, run_dir=run_dir, tensorboard=False,
                               **{"stream": io.StringIO(), **options}, precision="fp16")
    return session, session.train(), learner


def test_fp16_skips_an_overflowing_step_and_halves_the_scale(tmp_path):
    model = make_model()
    seen = []
    model.register_forward_hook(lambda module, inputs, output: seen.append(output.dtype))
    stream = io.StringIO()
    session, result, learner = train_fp16(tmp_path / "run", model, OverflowOnCall(3), 100, stream=stream)
    assert "fp16: 1 optimizer steps skipped for an inf/NaN gradient, loss scale now 32768" in stream.getvalue()
    assert set(seen) == {torch.float16}
    assert session.skipped_steps == 1
    assert session.loss_scaler.scale == 65536.0 / 2
    # the overflowing minibatch (the 3rd) changed nothing: the same parameters as a run that skips it
    assert all(torch.isfinite(parameter).all() for parameter in model.parameters())


def test_fp16_overflow_step_leaves_parameters_and_optimizer_untouched(tmp_path):
    """Two minibatches, the second overflowing: the parameters are those after the first."""
    after_first = make_model()
    train_fp16(tmp_path / "one", after_first, OverflowOnCall(99), 20)
    model = make_model()
    session, _, learner = train_fp16(tmp_path / "two", model, OverflowOnCall(2), 40)
    assert session.skipped_steps == 1 and learner.samples_seen == 40
    for parameter, wanted in zip(model.parameters(), after_first.parameters()):
        assert torch.equal(parameter, wanted)


def test_fp16_gradients_are_unscaled_before_the_optimizer_step(tmp_path):
    """fp16 and float32 make nearly the same first step: the optimizer never sees the 65536-fold gradient."""
    half, full = make_model(), make_model()
    train_fp16(tmp_path / "half", half, nn.functional.cross_entropy, 20)
    train(tmp_path / "full", full, max_samples=20)
    for a, b in zip(half.parameters(), full.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-3)


def test_fp16_loss_scale_is_checkpointed_and_resumes_bit_exactly(tmp_path):
    """A run interrupted after a skipped step resumes with the halved scale and ends bit-identical."""
    whole = make_model()
    whole_session, _, _ = train_fp16(tmp_path / "whole", whole, OverflowOnCall(2), 120)
    from dtrain import CheckpointConfig

    first = make_model()
    first_session, _, _ = train_fp16(tmp_path / "split", first, OverflowOnCall(2), 60,
                                     checkpoint_config=CheckpointConfig("ckpt.pt", frequency=60))
    from dtrain.session import checkpoint

    saved = checkpoint.load(sorted((tmp_path / "split").glob("ckpt*.pt"))[-1])
    assert saved["loss_scaler"]["scale"] == 32768.0
    resumed = make_model()
    resumed_session, _, _ = train_fp16(tmp_path / "split", resumed, OverflowOnCall(99), 120,
                                       checkpoint_config=CheckpointConfig("ckpt.pt", frequency=60))
    assert resumed_session.loss_scaler.state_dict() == whole_session.loss_scaler.state_dict()
    for a, b in zip(resumed.parameters(), whole.parameters()):
        assert torch.equal(a, b)


@pytest.mark.slow
def test_compile_trains_and_its_checkpoint_restores_into_a_plain_run(tmp_path):
    from dtrain import CheckpointConfig
    from dtrain.session import checkpoint

    compiled, plain = make_model(), make_model()
    _, learner = train(tmp_path / "run", compiled, max_samples=40, compile=True,
                       checkpoint_config=CheckpointConfig("ckpt.pt", frequency=40))
    train(tmp_path / "plain", plain, max_samples=40)
    assert learner.samples_seen == 40
    for a, b in zip(compiled.parameters(), plain.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)  # the same training, compiled
    saved = checkpoint.load(sorted((tmp_path / "run").glob("ckpt*.pt"))[-1])
    assert set(saved["model"]) == set(make_model().state_dict())  # plain names, no _orig_mod.
    from safetensors.torch import load_file

    assert set(load_file(tmp_path / "run" / "model.safetensors")) == set(make_model().state_dict())
    resumed = make_model()
    result, _ = train(tmp_path / "run", resumed, max_samples=80,
                      checkpoint_config=CheckpointConfig("ckpt.pt", frequency=40))
    assert result.restored_from is not None and result.samples_seen == 80


@pytest.mark.slow
def test_an_already_compiled_model_is_trained_and_saved_under_its_plain_names(tmp_path):
    model = make_model()
    learner = LocalLearner(torch.optim.SGD(model.parameters(), lr=0.1))
    session = training_session(torch.compile(model), nn.functional.cross_entropy, learner,
                               MinibatchSource(four_class_data()), minibatch_size=20, max_samples=20, run_dir=tmp_path,
                               tensorboard=False, stream=io.StringIO())
    assert session.model is model and session.forward_model is not model
    assert session.train().samples_seen == 20
    from safetensors.torch import load_file

    assert set(load_file(tmp_path / "model.safetensors")) == set(make_model().state_dict())  # no _orig_mod.


def test_a_model_that_cannot_be_compiled_is_one_line_naming_compile(tmp_path, monkeypatch):
    failure = type("BackendCompilerFailed", (RuntimeError,), {"__module__": "torch._dynamo.exc"})

    def broken_compile(model):
        def forward(features):
            raise failure("backend='inductor' raised:\nCppCompileError: no C++ compiler")
        return forward

    monkeypatch.setattr(torch, "compile", broken_compile)
    with pytest.raises(ValueError) as error:
        train(tmp_path, make_model(), max_samples=20, compile=True)
    message = str(error.value)
    assert "\n" not in message and message.startswith("compile=True: torch.compile (inductor) could not compile")
    assert "BackendCompilerFailed" in message and "session.compile=false" in message


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_reduced_precision_trains_on_cuda(tmp_path, precision):
    """One process on the GPU: the forward autocasts to the asked type, parameters stay float32 on CUDA,
    fp16's scale stays at its start when nothing overflows, and training learns."""
    from dtrain.comm import LocalCommunicator

    model = make_model()
    dtypes = []
    model.register_forward_hook(lambda module, inputs, output: dtypes.append(output.dtype))
    learner = LocalLearner(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), LocalCommunicator("cuda"))
    session = training_session(model, nn.functional.cross_entropy, learner,
                               MinibatchSource(four_class_data(), randomize=True, randomization_seed=5), minibatch_size=20,
                               max_samples=400, run_dir=tmp_path, tensorboard=False, stream=io.StringIO(),
                               precision=precision, clip_grad_norm=1.0, micro_batch_size=8)
    result = session.train()
    assert set(dtypes) == {torch.bfloat16 if precision == "bf16" else torch.float16}
    assert all(p.is_cuda and p.dtype == torch.float32 for p in model.parameters())
    assert result.last_training_error < 0.5
    if precision == "fp16":
        assert session.skipped_steps == 0 and session.loss_scaler.scale == 65536.0


@pytest.mark.parametrize("options", [{"clip_grad_norm": 1.0}, {"precision": "fp16"}])
def test_a_learner_stepping_the_optimizer_itself_is_refused_when_clipping_or_fp16(tmp_path, options):
    """Such a learner would silently train without clipping or unscaling; it is refused at its first step."""
    class BypassingLearner(LocalLearner):
        kind = "bypassing"

        def apply_update(self) -> None:
            self.optimizer.step()

    model = make_model()
    learner = BypassingLearner(torch.optim.SGD(model.parameters(), lr=0.1))
    session = training_session(model, nn.functional.cross_entropy, learner, MinibatchSource(four_class_data()),
                               minibatch_size=20, max_samples=20, run_dir=tmp_path, tensorboard=False,
                               stream=io.StringIO(), **options)
    with pytest.raises(ValueError, match=r"the bypassing learner calls optimizer.step\(\) itself.*_step_optimizer"):
        session.train()
    # without either setting it trains as before
    plain = BypassingLearner(torch.optim.SGD(model.parameters(), lr=0.1))
    assert training_session(model, nn.functional.cross_entropy, plain, MinibatchSource(four_class_data()), minibatch_size=20,
                            max_samples=20, run_dir=tmp_path / "plain", tensorboard=False,
                            stream=io.StringIO()).train().samples_seen == 20


def test_data_parallel_exchanges_once_after_passes_under_no_sync():
    """Passes under no_sync launch nothing; the last launches every bucket once, with the accumulated
    gradient, including a parameter only an earlier pass reached."""
    from test_data_parallel import _RecordingComm, make_model as make_deep_model

    from dtrain.learners import DataParallelLearner

    model = make_deep_model()
    comm = _RecordingComm()
    learner = DataParallelLearner(torch.optim.SGD(model.parameters(), lr=0.0), comm, bucket_size_mb=1e-3)
    learner.prepare(model)
    comm.calls.clear()
    learner.begin_minibatch(4, 8)
    with learner.no_sync():
        nn.functional.cross_entropy(model(torch.randn(2, 5)), torch.tensor([0, 1])).backward()
        model[4].bias.sum().backward()  # the last bias: reached by this earlier pass only
    assert comm.calls == [] and not learner.accumulating
    last_bias_grad = model[4].bias.grad.clone()
    model[4].weight.sum().backward()  # the last pass reaches only the last weight
    accumulated = [parameter.grad.clone() for parameter in model.parameters()]
    learner.step()
    assert len(comm.calls) == len(learner.buckets)  # once per bucket for the whole minibatch
    for parameter, local in zip(model.parameters(), accumulated):
        torch.testing.assert_close(parameter.grad, local * 4 / 8)  # the fake peer sends zeros
    torch.testing.assert_close(model[4].bias.grad, last_bias_grad * 0.5)
