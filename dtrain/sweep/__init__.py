"""Hydra sweeps (``python -m dtrain -m ...``): which job is running, how each ended, the sweep's
summary and exit status (``outcomes``), and how the ranks of a job agree on its failure (``agreement``)."""
from dtrain.sweep.agreement import agree_on_failure
from dtrain.sweep.outcomes import (JobFailed, JobOutcome, SweepJob, SweepStart, current_job, exit_status,
                                   finish_sweep, record_outcome, start_sweep, sweep_outcomes)

__all__ = ["JobFailed", "JobOutcome", "SweepJob", "SweepStart", "agree_on_failure", "current_job", "exit_status",
           "finish_sweep", "record_outcome", "start_sweep", "sweep_outcomes"]
