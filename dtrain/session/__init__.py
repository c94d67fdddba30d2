"""The training loop (``training_session``) and what it needs: configs, checkpoints, evaluation, output."""
from dtrain.session.configs import CheckpointConfig, CrossValidationConfig, TestConfig
from dtrain.session.evaluate import Evaluation, classification_errors, evaluate
from dtrain.session.binding import StreamBinding
from dtrain.session.decoding import DecodingErrors, GreedyDecodingErrors
from dtrain.session.distillation import Distillation
from dtrain.session.objectives import (ClassificationError, MeanAbsoluteError, MSELoss, Perplexity,
                                      SequenceCrossEntropy, SequenceError, TopKError)
from dtrain.session.session import TrainingCollapsed, TrainingDiverged, TrainingResult, TrainingSession, training_session

__all__ = [
    "ClassificationError", "DecodingErrors", "Distillation", "GreedyDecodingErrors", "MSELoss", "MeanAbsoluteError", "Perplexity", "SequenceCrossEntropy", "SequenceError", "StreamBinding",
    "TopKError",
    "CheckpointConfig", "CrossValidationConfig", "Evaluation", "TestConfig", "TrainingCollapsed", "TrainingDiverged",
    "TrainingResult", "TrainingSession", "classification_errors", "evaluate", "training_session",
]
