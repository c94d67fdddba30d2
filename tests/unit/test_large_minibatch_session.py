"""The large-minibatch toolkit inside a training session: lr scaling and its warm-up, the weight EMA,
RMSprop-to-SGD by samples seen, and a bit-identical resume of all of them."""
from __future__ import annotations

import io
import math
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file
from torch import nn

from dtrain import CheckpointConfig, LocalLearner, MinibatchSource, TestConfig, training_session
from dtrain.optim import LAMB, LARS, RMSpropWarmupSGD, norm_and_bias_groups
from dtrain.session import checkpoint
from dtrain.session.lr_scaling import LearningRateScaling, lr_scaling_problems
from dtrain.session.weight_ema import WeightEMA

from tests.helpers.toy_data import four_class_data


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 8), nn.LayerNorm(8),
                         nn.Linear(8, 4))


def _session(run_dir: Path, max_samples: int, optimizer_class=LARS, *, scaling=None, ema_decay=0.9, **settings):
    model = _model()
    optimizer = optimizer_class(norm_and_bias_groups(model), **settings)
    out = io.StringIO()
    session = training_session(model, nn.functional.cross_entropy, LocalLearner(optimizer),
                               MinibatchSource(four_class_data(), randomization_seed=3), 16, max_samples=max_samples,
                               progress_frequency=0, checkpoint_config=CheckpointConfig("checkpoint.pt", frequency=64),
                               test_config=TestConfig(MinibatchSource(four_class_data(40, seed=9), randomize=False, max_sweeps=1), 20),
                               lr_scaling=scaling, ema_decay=ema_decay, run_dir=run_dir, tensorboard=False, stream=out)
    return session, model, optimizer, out


@pytest.mark.slow  # three sessions each (8 s): the default suite's time budget; WeightEMA's own round trip below
@pytest.mark.parametrize("optimizer_class,settings", [(LARS, {"lr": 2.0, "eta": 0.01}), (LAMB, {"lr": 0.01})])
def test_resume_is_bit_identical_with_the_optimizer_state_and_the_weight_ema(tmp_path, optimizer_class, settings):
    scaling = LearningRateScaling("sqrt", 64, 16, warmup_samples=96)
    _session(tmp_path / "whole", 128, optimizer_class, scaling=scaling, **settings)[0].train()
    _session(tmp_path / "split", 64, optimizer_class, scaling=scaling, **settings)[0].train()
    session, *_ = _session(tmp_path / "split", 128, optimizer_class, scaling=scaling, **settings)
    assert session.train().restored_from == tmp_path / "split" / "checkpoint-64.pt"
    whole = checkpoint.load(tmp_path / "whole" / "checkpoint-128.pt")
    split = checkpoint.load(tmp_path / "split" / "checkpoint-128.pt")
    for part in ("model", "weight_ema"):
        assert whole[part].keys() == split[part].keys()
        assert all(torch.equal(whole[part][key], split[part][key]) for key in whole[part]), part
    for a, b in zip(whole["learner"]["optimizer"]["state"].values(), split["learner"]["optimizer"]["state"].values()):
        assert all(torch.equal(a[key], b[key]) for key in a)
    assert int(whole["weight_ema"]["n_averaged"]) == 8  # one update per optimizer step (128 / 16)
    ema_file = load_file(tmp_path / "split" / "model_ema.safetensors")
    assert all(torch.equal(ema_file[name], split["weight_ema"][f"module.{name}"]) for name in ema_file)


def test_the_weight_ema_follows_its_formula_and_copies_the_live_buffers(tmp_path):
    session, model, optimizer, out = _session(tmp_path, 96, torch.optim.SGD, ema_decay=0.8, lr=0.1)
    after_each_step = []
    optimizer.register_step_post_hook(lambda *_: after_each_step.append(
        [p.detach().clone() for p in model.parameters()]))
    result = session.train()
    expected = after_each_step[0]
    for weights in after_each_step[1:]:
        expected = [0.8 * e + 0.2 * w for e, w in zip(expected, weights)]
    for got, want in zip(session.ema.module.parameters(), expected):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    for got, live in zip(session.ema.module.buffers(), model.buffers()):
        assert torch.equal(got, live)
    assert result.test_ema is not None and result.test is not None and result.test_ema.loss != result.test.loss
    kinds = [OmegaConf.create(line)["kind"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert "test_ema" in kinds and "test" in kinds
    assert "test of the weight EMA (decay 0.8): accuracy" in out.getvalue()


def test_lr_scaling_warms_up_from_the_unscaled_lr_to_the_scaled_one(tmp_path):
    scaling = LearningRateScaling("linear", 64, 16, warmup_samples=64)
    session, _, optimizer, out = _session(tmp_path, 128, torch.optim.SGD, scaling=scaling, ema_decay=None, lr=0.1)
    seen = []
    optimizer.register_step_pre_hook(lambda *_: seen.append(optimizer.param_groups[0]["lr"]))
    session.train()
    samples = range(0, 128, 16)
    assert seen == pytest.approx([0.1 * (1 + 3 * min(1.0, (s + 1) / 64)) if s < 64 else 0.4 for s in samples])
    assert "lr 0.1 x 4 (linear, minibatch 64 / reference 16) = 0.4, warm-up from 0.1 over 64 samples" in out.getvalue()
    assert LearningRateScaling("sqrt", 1024, 64).factor == 4.0
    assert math.isclose(LearningRateScaling("sqrt", 1024, 64)(0), 4.0)  # no warm-up: scaled from the first step


def test_rmsprop_warmup_sgd_moves_to_sgd_by_global_samples(tmp_path):
    session, _, optimizer, _ = _session(tmp_path, 96, RMSpropWarmupSGD, ema_decay=None, lr=0.01,
                                        center_samples=32, period_samples=32)
    alphas = []
    optimizer.register_step_pre_hook(lambda *_: alphas.append(optimizer.param_groups[0]["alpha_sgd"]))
    session.train()
    # one step per 16 global samples: before, at and after the center of 32, all SGD from 48 on
    assert alphas == pytest.approx([0.5 * math.exp(-2), 0.5 * math.exp(-1), 0.5, 1.0, 1.0, 1.0])


def test_lr_scaling_rules():
    session = OmegaConf.create({"lr_scaling": "linear", "lr_reference_minibatch_size": None,
                                "minibatch_size_schedule": None})
    assert lr_scaling_problems(session) == ["session.lr_scaling=linear: expected session.lr_reference_minibatch_size="
                                            "SAMPLES, the global minibatch the learning rate was tuned at"]
    session.lr_reference_minibatch_size = 64
    assert lr_scaling_problems(session) == []
    session.minibatch_size_schedule = {"values": [64, 128]}
    assert "session.lr_scaling=linear with session.minibatch_size_schedule" in lr_scaling_problems(session)[0]
    with pytest.raises(ValueError, match="lr_scaling='cube': expected one of none, linear, sqrt"):
        LearningRateScaling("cube", 64, 16)


class EveryFourthStepLearner(LocalLearner):
    """A stand-in for a block learner: the ranks "hold one model" only after every fourth step."""

    def is_sync_point(self) -> bool:
        return self.samples_seen % 64 == 0  # 4 minibatches of 16


def test_between_syncs_the_weight_ema_counts_optimizer_steps_not_syncs(tmp_path):
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    after_each_step = []
    optimizer.register_step_post_hook(lambda *_: after_each_step.append(
        [p.detach().clone() for p in model.parameters()]))
    session = training_session(model, nn.functional.cross_entropy, EveryFourthStepLearner(optimizer),
                               MinibatchSource(four_class_data(), randomization_seed=3), 16, max_samples=160,
                               progress_frequency=0, ema_decay=0.8, run_dir=tmp_path, tensorboard=False,
                               stream=io.StringIO())
    session.train()
    assert len(after_each_step) == 10
    # taken in after steps 4 and 8 (the syncs) and 10 (the run's end): decay^4, then decay^2 for the last two
    expected = after_each_step[3]
    for weights, steps in ((after_each_step[7], 4), (after_each_step[9], 2)):
        expected = [0.8 ** steps * e + (1 - 0.8 ** steps) * w for e, w in zip(expected, weights)]
    assert session.ema.updates == 3 and session.ema.steps_since_update == 0
    for got, want in zip(session.ema.module.parameters(), expected):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def test_steps_not_yet_taken_in_survive_a_checkpoint_and_old_checkpoints_have_none():
    model = _model()
    ema = WeightEMA(model, 0.9)
    ema.after_step(model, True)
    ema.after_step(model, False)
    ema.after_step(model, False)
    resumed = WeightEMA(_model(), 0.9)
    resumed.load_state_dict(ema.state_dict())
    assert resumed.steps_since_update == 2 and resumed.updates == 1
    old = {key: value for key, value in ema.state_dict().items() if key != "steps_since_update"}
    resumed.load_state_dict(old)
    assert resumed.steps_since_update == 0


def test_the_weight_ema_starts_from_the_weights_after_the_first_update_not_the_initial_ones():
    model = _model()
    ema = WeightEMA(model, 0.9)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(1.0)  # the first optimizer step
    ema.after_step(model, ranks_hold_one_model=True)
    for averaged, weights in zip(ema.module.parameters(), model.parameters()):
        assert torch.equal(averaged, weights)  # a copy: 0.9 of the initial weights would be far from it


def test_the_weight_ema_state_round_trip_continues_bit_identically():
    model = _model()
    straight, first = WeightEMA(model, 0.9), WeightEMA(model, 0.9)
    steps = []
    for step in range(6):
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(0.1 * (step + 1))
        steps.append([p.detach().clone() for p in model.parameters()])
    for weights in steps[:3]:
        for parameter, value in zip(model.parameters(), weights):
            parameter.data.copy_(value)
        straight.update(model)
        first.update(model)
    resumed = WeightEMA(_model(), 0.9)
    resumed.load_state_dict(first.state_dict())
    for weights in steps[3:]:
        for parameter, value in zip(model.parameters(), weights):
            parameter.data.copy_(value)
        straight.update(model)
        resumed.update(model)
    assert resumed.updates == straight.updates == 6
    for a, b in zip(straight.state_dict().values(), resumed.state_dict().values()):
        assert torch.equal(a, b)
