"""Top-k sparsification with error feedback: each rank sends only its largest values, and keeps the rest for later."""
import torch

from dtrain import checks
from dtrain.exchange import ThreadedExchange, full_precision_allreduce_bytes


class TopK(ThreadedExchange):
    name = "topk"  # in progress lines and checkpoint identities

    def __init__(self, fraction: float = 0.01):
        super().__init__()
        self.fraction = checks.number_in_range("fraction", checks.positive_number("fraction", fraction), 0.0, 1.0)
        self.errors = {}  # per key: what this rank has not sent yet (its own state, saved in checkpoints)

    def identity(self):
        return {"name": self.name, "fraction": self.fraction}

    def describe(self):
        return f"top-{self.fraction:g}"

    def exchange_now(self, key, flat, shapes):
        error = self.errors.setdefault(key, torch.zeros_like(flat))
        flat.add_(error)  # error feedback: what earlier steps did not send
        k = max(1, int(self.fraction * flat.numel()))
        indices = flat.abs().topk(k).indices
        values = flat[indices]
        error.copy_(flat).index_fill_(0, indices, 0.0)  # everything but the sent values waits for later
        all_values, all_indices = self.comm.allgather(values), self.comm.allgather(indices)
        flat.zero_()
        for rank_values, rank_indices in zip(all_values, all_indices):  # the same order on every rank
            flat.index_add_(0, rank_indices, rank_values)
        self.bytes_sent_last_step += (self.comm.size - 1) * k * (values.element_size() + indices.element_size())
        self.full_precision_bytes_last_step += full_precision_allreduce_bytes(flat.numel(), self.comm.size)
        return flat

    def state_dict(self):
        self.drain()  # the worker thread may still be exchanging
        return {"name": self.name, "errors": {key: error.cpu().clone() for key, error in self.errors.items()}}

    def load_state_dict(self, state):
        self.errors = {key: error.to(self.comm.device) for key, error in state["errors"].items()}

    def reset(self):
        self.drain()
        self.errors = {}
