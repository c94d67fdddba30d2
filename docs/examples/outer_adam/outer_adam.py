"""Outer Adam: local steps, and every block one Adam step on the workers' mean model change.

Its outer state is two flat tensors (Adam's moments), which the learner moves to the model's device and
checkpoints itself: the base's own outer state holds one."""
import torch

from dtrain import checks
from dtrain.learners import BlockLearner


class OuterAdamLearner(BlockLearner):
    kind = "outer_adam"  # the name written into checkpoints
    keeps_outer_state = False  # the base's one outer tensor goes unused: the moments below replace it

    def __init__(self, optimizer, comm=None, outer_learning_rate: float = 0.001, beta1: float = 0.9,
                 beta2: float = 0.99, eps: float = 1e-8, block_size="auto", distributed_after="auto", exchange=None):
        super().__init__(optimizer, comm, block_size=block_size, distributed_after=distributed_after,
                         exchange=exchange)
        self.outer_learning_rate = checks.positive_number("outer_learning_rate", outer_learning_rate)
        self.beta1 = checks.number_in_range("beta1", beta1, 0.0, 1.0, include_high=False)
        self.beta2 = checks.number_in_range("beta2", beta2, 0.0, 1.0, include_high=False)
        self.eps = checks.positive_number("eps", eps)
        self.outer_steps = 0
        self.moments = None  # [m, v], flat like prev_parameters; on the CPU between a restore and prepare()

    def prepare(self, model):
        super().prepare(model)  # one model on every worker; prev_parameters (W_prev) is on its device
        restored = self.moments  # load_state_dict's CPU copies when a checkpoint was restored first
        self.moments = [torch.zeros_like(self.prev_parameters) for _ in range(2)]
        for moment, saved in zip(self.moments, restored or []):
            moment.copy_(saved)  # to the model's device (and W_prev's dtype)

    def outer_update(self, total_delta):
        m, v = self.moments
        gradient = total_delta.div_(self.outer_comm.size)  # the mean change W_prev - W_i, Adam's gradient
        m.mul_(self.beta1).add_(gradient, alpha=1 - self.beta1)
        v.mul_(self.beta2).addcmul_(gradient, gradient, value=1 - self.beta2)
        self.outer_steps += 1
        denominator = (v / (1 - self.beta2 ** self.outer_steps)).sqrt_().add_(self.eps)
        step = self.outer_learning_rate / (1 - self.beta1 ** self.outer_steps)
        self.prev_parameters.addcdiv_(m, denominator, value=-step)  # W = W_prev - lr * m_hat / (sqrt(v_hat) + eps)

    def state_dict(self):
        state = super().state_dict()  # W_prev, the counters and the inner optimizer, as CPU copies
        # replicated: every worker made the same outer steps from the same sum
        state["outer_adam"] = {"moments": [moment.detach().cpu().clone() for moment in self.moments],
                               "outer_steps": self.outer_steps}
        return state

    def load_state_dict(self, state):
        super().load_state_dict(state)  # refuses another learner's checkpoint first
        saved = state["outer_adam"]
        self.outer_steps = int(saved["outer_steps"])
        if self.moments is None:  # before prepare(), which moves them to the model's device
            self.moments = [moment.clone() for moment in saved["moments"]]
        else:
            for moment, value in zip(self.moments, saved["moments"]):
                moment.copy_(value)

    def describe_block(self):
        return f"outer Adam lr {self.outer_learning_rate:g}, betas ({self.beta1:g}, {self.beta2:g})"
