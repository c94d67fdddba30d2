"""Lion (Chen et al. 2023, arXiv 2302.06675) as an outer optimizer: the sign of an interpolated momentum.

A plain torch optimizer: the block learner hands it the workers' mean model change as the gradient of the
model of the last sync, checkpoints its state and moves it to the model's device."""
import torch


class Lion(torch.optim.Optimizer):
    def __init__(self, params, lr: float = 0.1, betas=(0.9, 0.99), weight_decay: float = 0.0):
        if not lr > 0 or not all(0.0 <= beta < 1.0 for beta in betas):
            raise ValueError(f"Lion: lr={lr!r} must be above 0 and betas={betas!r} in [0, 1)")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                # exp_avg: a first moment, which dtrain's momentum correction scales with the inner lr
                m = self.state[p].setdefault("exp_avg", torch.zeros_like(p))
                update = (m * beta1 + p.grad * (1 - beta1)).sign_()
                p.mul_(1 - group["lr"] * group["weight_decay"]).add_(update, alpha=-group["lr"])
                m.mul_(beta2).add_(p.grad, alpha=1 - beta2)
