"""Learners: wrap a torch optimizer and decide how updates are made across workers."""
from dtrain.learners.base import Learner

__all__ = ["Learner"]
