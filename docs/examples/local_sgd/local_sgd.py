"""Local SGD: every worker steps alone, and every `period` steps the workers average their models."""
from dtrain import checks
from dtrain.learners import ReplicatedLearner
from dtrain.learners.replicated import make_buffers_consistent


class LocalSGDLearner(ReplicatedLearner):
    kind = "local_sgd"  # the name written into checkpoints

    def __init__(self, optimizer, comm=None, period: int = 4, distributed_after: int = 0):
        super().__init__(optimizer, comm, distributed_after)
        self.period = checks.whole_number("period", period, 1, unit="steps")
        self.steps_since_average = 0

    def distributed_update(self) -> None:
        if self.local_samples > 0:
            self._step_optimizer()  # this worker's own step: no communication
        self.steps_since_average += 1  # the same count on every worker, so all average together
        if self.steps_since_average == self.period:
            self.average_models()

    def synchronize(self) -> None:  # before evaluation, checkpoints and the end of training
        if self.is_distributed() and self.model is not None:
            self.average_models()
        else:
            super().synchronize()

    def average_models(self) -> None:
        for parameter in self.parameters:
            self.comm.allreduce(parameter.detach(), op="mean")  # in place, on every worker
        make_buffers_consistent(self.model, self.comm, self.bucket_bytes)
        self.steps_since_average = 0
