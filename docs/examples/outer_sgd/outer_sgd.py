"""Outer SGD: local steps, and every block one plain SGD step on the workers' mean model change."""
from dtrain import checks
from dtrain.learners import BlockLearner


class OuterSGDLearner(BlockLearner):
    kind = "outer_sgd"  # the name written into checkpoints

    def __init__(self, optimizer, comm=None, outer_learning_rate: float = 0.5, block_size="auto",
                 distributed_after="auto", exchange=None):
        super().__init__(optimizer, comm, block_size=block_size, distributed_after=distributed_after,
                         exchange=exchange)
        self.outer_learning_rate = checks.positive_number("outer_learning_rate", outer_learning_rate)

    def outer_update(self, total_delta):
        # total_delta is D = sum_i (W_prev - W_i) over the workers; prev_parameters holds W_prev
        mean_delta = total_delta.div_(self.outer_comm.size)
        self.prev_parameters.sub_(mean_delta, alpha=self.outer_learning_rate)  # W = W_prev - lr * D / N

    def describe_block(self):
        return f"outer SGD lr {self.outer_learning_rate:g}"
