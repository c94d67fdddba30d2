"""FrozenVariance: Adam's bias-corrected variance held from the first held step on, against the update's formula."""
from __future__ import annotations

import copy

import pytest
import torch

from dtrain.learners import frozen_variance as frozen_variance_module
from dtrain.learners.frozen_variance import UPDATE_RMS_LIMIT, FrozenVariance

LR, BETAS, EPS = 0.01, (0.9, 0.999), 1e-8


def adam_with_warm_start(optimizer_class, warm_steps: int, seed: int = 0):
    """A 3x4 parameter and its Adam-family optimizer after ``warm_steps`` ordinary steps on random gradients."""
    generator = torch.Generator().manual_seed(seed)
    parameter = torch.nn.Parameter(torch.randn(3, 4, generator=generator))
    optimizer = optimizer_class([parameter], lr=LR, betas=BETAS, eps=EPS)
    for _ in range(warm_steps):
        parameter.grad = torch.randn(3, 4, generator=generator)
        optimizer.step()
    return parameter, optimizer, generator


def held_step(parameter, optimizer, frozen: FrozenVariance, gradient: torch.Tensor) -> None:
    parameter.grad = gradient.clone()
    frozen.hold()
    optimizer.step()
    frozen.restore()


@pytest.mark.parametrize("warm_steps", [3, 40])
def test_each_held_step_divides_by_the_warm_starts_bias_corrected_variance_and_its_own_gradient(warm_steps):
    parameter, optimizer, generator = adam_with_warm_start(torch.optim.Adam, warm_steps)
    state = optimizer.state[parameter]
    beta1, beta2 = BETAS
    stored = state["exp_avg_sq"].clone()
    held = stored / (1 - beta2 ** warm_steps)  # what the last warm step divided by
    frozen = FrozenVariance(optimizer)
    for step in range(warm_steps + 1, warm_steps + 60):
        gradient = torch.randn(3, 4, generator=generator) * 10.0 ** (step % 3 - 1)  # sizes that differ from v's
        before, momentum = parameter.detach().clone(), state["exp_avg"].clone()
        held_step(parameter, optimizer, frozen, gradient)
        exp_avg = beta1 * momentum + (1 - beta1) * gradient
        denominator = (beta2 * held + (1 - beta2) * gradient ** 2 / (1 - beta2 ** step)).sqrt() + EPS
        update = -LR / (1 - beta1 ** step) * exp_avg / denominator
        rms = update.pow(2).mean().sqrt()
        expected = before + update * min(1.0, UPDATE_RMS_LIMIT * LR / float(rms))  # clipped to RMS lr where larger
        torch.testing.assert_close(parameter.detach(), expected, rtol=1e-5, atol=1e-7)
        # the state keeps the warm start's own variance, as stored, between steps (what checkpoints hold)
        assert torch.equal(state["exp_avg_sq"], stored)


def test_the_variance_held_as_stored_would_let_the_denominator_shrink_which_the_correction_prevents():
    """Why the bias correction is held too: with v held as stored, torch's growing correction 1 - beta2**t
    divides it by less and less (here by 0.0296 at step 30 and 0.181 at step 200: 2.5x larger steps)."""
    parameter, optimizer, generator = adam_with_warm_start(torch.optim.Adam, 30)
    frozen = FrozenVariance(optimizer)
    zero = torch.zeros(3, 4)
    for _ in range(170):
        held_step(parameter, optimizer, frozen, zero)  # momentum decays; the denominator is what matters
    state = optimizer.state[parameter]
    parameter.grad = torch.ones(3, 4)
    frozen.hold()
    live = state["exp_avg_sq"].clone()
    frozen.restore()
    # the next step (201) divides live by 1 - beta2**201: the same as the warm start's v / (1 - beta2**30)
    torch.testing.assert_close(live / (1 - BETAS[1] ** 201), state["exp_avg_sq"] / (1 - BETAS[1] ** 30))
    assert bool((live / state["exp_avg_sq"]).sqrt().min() > 2.4)  # the stored v alone: 2.4x larger steps


def test_a_restored_copy_is_corrected_from_the_step_it_was_first_taken_at_bit_for_bit():
    parameter, optimizer, generator = adam_with_warm_start(torch.optim.AdamW, 5)
    frozen = FrozenVariance(optimizer)
    gradients = [torch.randn(3, 4, generator=generator) for _ in range(8)]
    for gradient in gradients[:4]:
        held_step(parameter, optimizer, frozen, gradient)
    saved_parameter, saved_optimizer = parameter.detach().clone(), copy.deepcopy(optimizer.state_dict())
    saved_frozen = frozen.state_dict()
    assert saved_frozen == {"held_at_steps": [5.0]}
    for gradient in gradients[4:]:
        held_step(parameter, optimizer, frozen, gradient)
    straight = parameter.detach().clone()

    resumed_parameter = torch.nn.Parameter(saved_parameter.clone())
    resumed_optimizer = torch.optim.AdamW([resumed_parameter], lr=LR, betas=BETAS, eps=EPS)
    resumed_optimizer.load_state_dict(copy.deepcopy(saved_optimizer))
    resumed = FrozenVariance(resumed_optimizer)
    resumed.load_state_dict(saved_frozen)
    for gradient in gradients[4:]:
        held_step(resumed_parameter, resumed_optimizer, resumed, gradient)
    assert torch.equal(resumed_parameter.detach(), straight)

    # a checkpoint from before the step counts were saved: corrected from the resumed step instead
    older = torch.nn.Parameter(saved_parameter.clone())
    older_optimizer = torch.optim.AdamW([older], lr=LR, betas=BETAS, eps=EPS)
    older_optimizer.load_state_dict(copy.deepcopy(saved_optimizer))
    from_then = FrozenVariance(older_optimizer)
    from_then.load_state_dict({})
    held_step(older, older_optimizer, from_then, gradients[4])
    assert from_then.state_dict() == {"held_at_steps": [9.0]}
    assert not torch.equal(older.detach(), straight)


def test_nothing_is_held_before_the_optimizers_first_step_and_the_state_says_so():
    parameter = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.Adam([parameter], lr=LR)
    frozen = FrozenVariance(optimizer)
    assert frozen.state_dict() == {}
    held_step(parameter, optimizer, frozen, torch.ones(2))  # no variance yet: an ordinary first step
    assert frozen.state_dict() == {}
    held_step(parameter, optimizer, frozen, torch.ones(2))  # copied now, at step 1
    assert frozen.state_dict() == {"held_at_steps": [1.0]}


def test_a_held_update_that_outgrows_the_learning_rate_is_clipped_to_it_in_its_own_direction():
    """A variance held from small gradients, then gradients 1,000 times larger (a 1-bit exchange hands a weight its
    column's magnitude): unclipped, the step would be about 30 learning rates per weight (1 / sqrt(1 - beta2)), the
    growth that collapsed a 1-D convolutional classifier to chance; clipped, its RMS is one learning rate."""
    generator = torch.Generator().manual_seed(3)
    parameter = torch.nn.Parameter(torch.randn(8, 16, generator=generator))
    optimizer = torch.optim.Adam([parameter], lr=LR, betas=BETAS, eps=EPS)
    for _ in range(300):
        parameter.grad = 1e-3 * torch.randn(8, 16, generator=generator)
        optimizer.step()
    twin_parameter = torch.nn.Parameter(parameter.detach().clone())
    twin_optimizer = torch.optim.Adam([twin_parameter], lr=LR, betas=BETAS, eps=EPS)
    twin_optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    frozen, unclipped = FrozenVariance(optimizer), FrozenVariance(twin_optimizer)
    signs = torch.randn(8, 16, generator=generator).sign()  # a steady gradient: Adam's momentum builds up
    for step in range(5):
        gradient = signs * (1.0 + torch.rand(8, 16, generator=generator))
        before = parameter.detach().clone()
        held_step(parameter, optimizer, frozen, gradient)
        frozen_variance_module.UPDATE_RMS_LIMIT, limit = float("inf"), frozen_variance_module.UPDATE_RMS_LIMIT
        try:
            twin_before = twin_parameter.detach().clone()
            held_step(twin_parameter, twin_optimizer, unclipped, gradient)
        finally:
            frozen_variance_module.UPDATE_RMS_LIMIT = limit
        wanted = twin_parameter.detach() - twin_before
        unclipped_rms = float(wanted.pow(2).mean().sqrt())
        assert unclipped_rms > 1.5 * LR  # what the held variance alone would do
        made = parameter.detach() - before
        torch.testing.assert_close(made.pow(2).mean().sqrt(), torch.tensor(LR), rtol=1e-5, atol=0.0)
        if step == 0:  # the same state on both sides: the clipped step points where the unclipped one does
            torch.testing.assert_close(made, wanted * (LR / wanted.pow(2).mean().sqrt()), rtol=1e-4, atol=1e-6)  # float32 at 1
    assert unclipped_rms > 5 * LR  # and growing as the momentum builds
    assert (frozen.clipped_updates, frozen.held_updates) == (5, 5)
    assert (unclipped.clipped_updates, unclipped.held_updates) == (0, 5)


def test_a_held_update_within_the_learning_rate_is_the_optimizers_own_bit_for_bit():
    parameter, optimizer, generator = adam_with_warm_start(torch.optim.AdamW, 40)
    twin_parameter = torch.nn.Parameter(parameter.detach().clone())
    twin_optimizer = torch.optim.AdamW([twin_parameter], lr=LR, betas=BETAS, eps=EPS)
    twin_optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    frozen, twin = FrozenVariance(optimizer), FrozenVariance(twin_optimizer)
    for _ in range(20):
        gradient = 0.3 * torch.randn(3, 4, generator=generator)  # the warm start's scale: steps well within lr
        held_step(parameter, optimizer, frozen, gradient)
        twin_parameter.grad = gradient.clone()
        twin.hold()
        twin_optimizer.step()
        twin_optimizer.state[twin_parameter]["exp_avg_sq"].copy_(twin._kept[0].kept)  # restore without the clip
    assert frozen.clipped_updates == 0 and frozen.held_updates == 20
    assert torch.equal(parameter.detach(), twin_parameter.detach())
