"""Every bad input gives ONE line, ``dtrain: error: ...`` naming the key or file and what was expected,
a non-zero exit (2: the user's input), no traceback, and leaves the run directory byte-identical
(no file changed, none added), in a single process and under ``mpiexec -n 2``.

Each case runs the real ``python -m dtrain`` entry (``dtrain.cli.main``) in its own process
against a run directory holding a finished tiny run. Single-process cases are forked from one
interpreter that imported dtrain once (``tests/helpers/forked_dtrain.py``), which keeps the file fast; the
``mpiexec`` cases start real ranks.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.cli import RUNNER
from tests.helpers.mpi import plain_environment, run_mpi

# (id, arguments, fragments the line must hold). ``{run}`` is the finished run, ``{file}`` a file,
# ``{empty}`` an empty file, ``{readonly}`` a directory this user cannot write; run_dir={run} is
# added when a case names no run_dir. Each fragment names the key/file or says what was expected.
CASES = [
    # sizes, counts and frequencies
    ("minibatch-0", ["session.minibatch_size=0"], ["session.minibatch_size=0: expected a positive whole number"]),
    ("minibatch-negative", ["session.minibatch_size=-5"], ["session.minibatch_size=-5: expected"]),
    ("minibatch-word", ["session.minibatch_size=abc"], ["minibatch_size", "abc"]),
    ("max-samples-0", ["session.max_samples=0"], ["session.max_samples=0: expected"]),
    ("max-samples-negative", ["session.max_samples=-1"], ["session.max_samples=-1: expected"]),
    ("progress-negative", ["session.progress_frequency=-1"], ["session.progress_frequency=-1: expected"]),
    ("checkpoint-frequency", ["session.checkpoint.frequency=-5"], ["session.checkpoint.frequency=-5: expected"]),
    ("keep-last-1", ["session.checkpoint.keep_last=1"], ["session.checkpoint.keep_last=1: expected", "at least 2"]),
    ("checkpoint-filename-dir", ["session.checkpoint.filename=sub/"], ["session.checkpoint.filename='sub/': expected a file name"]),
    ("preemption-signal", ["session.checkpoint.preemption_signal=SIGFOO"], ["preemption_signal='SIGFOO': expected a signal name"]),
    ("cv-minibatch-0", ["session.cv.minibatch_size=0"], ["session.cv.minibatch_size=0: expected"]),
    ("cv-frequency", ["session.cv.frequency=-3"], ["session.cv.frequency=-3: expected"]),
    ("test-minibatch-0", ["session.test.minibatch_size=0"], ["session.test.minibatch_size=0: expected"]),
    ("test-max-samples-0", ["session.test.max_samples=0"], ["session.test.max_samples=0: expected"]),
    ("threads-0", ["session.num_threads=0"], ["session.num_threads=0: expected a whole number of threads"]),
    ("threads-negative", ["session.num_threads=-2"], ["session.num_threads=-2: expected"]),
    ("keep-host-memory-word", ["session.keep_host_memory=maybe"], ["keep_host_memory", "maybe"]),
    ("two-problems-at-once", ["session.minibatch_size=0", "session.checkpoint.filename=sub/"],
     ["session.minibatch_size=0: expected", "session.checkpoint.filename='sub/': expected"]),
    # schedules
    ("lr-schedule-word", ["session.lr_schedule.values=[[1,abc]]"], ["session.lr_schedule.values[0] value='abc': expected"]),
    ("lr-schedule-empty", ["session.lr_schedule.values=[]"], ["session.lr_schedule.values=[]: expected a non-empty list"]),
    ("lr-schedule-count-0", ["session.lr_schedule.values=[[0,1.0]]"], ["session.lr_schedule.values[0] count=0: expected"]),
    ("lr-schedule-nan", ["session.lr_schedule.values=[nan]"], ["session.lr_schedule.values[0] value=nan: expected"]),
    ("lr-schedule-triple", ["session.lr_schedule.values=[[1,2,3]]"], ["session.lr_schedule.values[0]=[1, 2, 3]: expected"]),
    ("lr-schedule-epoch-0", ["session.lr_schedule.epoch_size=0"], ["session.lr_schedule.epoch_size=0: expected"]),
    ("lr-warmup-negative", ["session.lr_schedule.warmup_samples=-1"], ["session.lr_schedule.warmup_samples=-1: expected"]),
    # optimizers
    ("lr-nan", ["optimizer.lr=nan"], ["optimizer.lr=nan: expected a positive finite number"]),
    ("lr-inf", ["optimizer.lr=inf"], ["optimizer.lr=inf: expected"]),
    ("lr-0", ["optimizer.lr=0"], ["optimizer.lr=0.0: expected"]),
    ("lr-negative", ["optimizer.lr=-0.1"], ["optimizer.lr=-0.1: expected"]),
    ("momentum-negative", ["optimizer.momentum=-1"], ["optimizer.momentum=-1.0: expected a number in [0.0, 1.0)"]),
    ("momentum-above-1", ["optimizer.momentum=1.5"], ["optimizer.momentum=1.5: expected"]),
    ("weight-decay-negative", ["optimizer.weight_decay=-1"], ["optimizer.weight_decay=-1.0: expected"]),
    ("dampening-2", ["optimizer.dampening=2"], ["optimizer.dampening=2.0: expected"]),
    ("nesterov-dampening", ["optimizer.nesterov=true", "optimizer.dampening=0.5"], ["optimizer.nesterov=true: expected"]),
    ("adam-eps-0", ["optimizer=adam", "optimizer.eps=0"], ["optimizer.eps=0.0: expected"]),
    ("adam-variance-1", ["optimizer=adam", "optimizer.variance_momentum=1"], ["optimizer.variance_momentum=1.0: expected"]),
    ("adam-lr-nan", ["optimizer=adam", "optimizer.lr=nan"], ["optimizer.lr=nan: expected"]),
    ("optimizer-unknown", ["optimizer=sgdd"], ["optimizer/sgdd", "available: adam, adamw, lamb, lars, rmsprop_warmup_sgd, sgd"]),
    # large minibatches (docs/large-minibatch.md)
    ("lars-eta-negative", ["optimizer=lars", "optimizer.eta=-0.001"], ["optimizer.eta=-0.001: expected a positive"]),
    ("lars-weight-decay-negative", ["optimizer=lars", "optimizer.weight_decay=-1"], ["optimizer.weight_decay=-1.0: expected"]),
    ("lamb-beta1-1", ["optimizer=lamb", "optimizer.momentum=1"], ["optimizer.momentum=1.0: expected a number in [0.0, 1.0)"]),
    ("lamb-eps-0", ["optimizer=lamb", "optimizer.eps=0"], ["optimizer.eps=0.0: expected a positive"]),
    ("rmsprop-warmup-period-0", ["optimizer=rmsprop_warmup_sgd", "optimizer.period_samples=0"],
     ["optimizer.period_samples=0: expected a positive whole number of samples"]),
    ("lr-scaling-no-reference", ["session.lr_scaling=linear"],
     ["session.lr_scaling=linear: expected session.lr_reference_minibatch_size"]),
    ("lr-scaling-unknown", ["session.lr_scaling=cubic", "session.lr_reference_minibatch_size=32"],
     ["session.lr_scaling='cubic': expected one of none, linear, sqrt"]),
    ("ema-decay-1", ["session.ema_decay=1"], ["session.ema_decay=1.0: expected a number in (0, 1)"]),
    ("ema-decay-0", ["session.ema_decay=0.0"], ["session.ema_decay=0.0: expected a number in (0, 1)"]),
    # models
    ("hidden-negative", ["model.hidden=-5"], ["model.hidden=-5: expected a whole number of units of at least 1"]),
    # a model of the user's own (--config-dir) whose module registers a rule: refused as a shipped model's
    ("user-model-rule", ["--config-dir", "{base}/user_conf", "+recipe=digits", "model=user_mlp", "model.hidden=-5"],
     ["model.hidden=-5: expected a whole number of units of at least 1"]),
    ("hidden-0", ["model.hidden=0"], ["model.hidden=0: expected"]),
    ("classes-1", ["model.num_classes=1"], ["model.num_classes=1: expected"]),
    ("classes-vs-data", ["model.num_classes=3"], ["model.num_classes=3", "10 classes", "expected model.num_classes=10"]),
    ("dropout-1", ["model.dropout=1.0"], ["model.dropout=1.0: expected"]),
    ("dropout-nan", ["model.dropout=nan"], ["model.dropout=nan: expected"]),
    ("model-target-unknown", ["model._target_=dtrain.models.Nope"], ["model: Error locating target 'dtrain.models.Nope'; expected an importable class"]),
    # losses and switches: ranges torch documents, and true or false written as such
    ("label-smoothing-negative", ["loss.label_smoothing=-0.1"],
     ["loss.label_smoothing=-0.1: expected a number in [0.0, 1.0]"]),
    ("compile-2", ["session.compile=2"], ["session.compile=2: expected true or false"]),
    ("warm-start-yes", ["learner=powersgd", "learner.exchange.warm_start=yes"],
     ["learner.exchange.warm_start='yes': expected true or false"]),
    # where and what a session trains and traces
    ("device-malformed", ["session.device=gpu"], ["session.device='gpu': expected auto, cpu, cuda or cuda:N"]),
    ("profile-active-0", ["session.profile.enabled=true", "session.profile.active=0"],
     ["session.profile.active=0: expected a whole number of minibatches of at least 1"]),
    # streams: which feed the model and the loss, and how samples are counted
    ("inputs-unknown-stream", ["session.inputs=[nope]"],
     ["session.inputs[0]='nope': the training data has no stream 'nope'; it has 'features', 'labels'"]),
    ("target-unknown-stream", ["session.target=label"], ["session.target='label': the training data has no stream 'label'"]),
    ("target-unparsed", ["session.target=a.b"], ["session.target='a.b': expected a stream name"]),
    ("target-slice-unquoted", ["session.target=labels[1:]"],
     ["session.target=labels[1:]: a value with brackets", "expected 'session.target=\"labels[1:]\"'"]),
    # the same typos with a directory of the user's configs (--config-dir): still one line each
    ("config-dir-list-unclosed", ["--config-dir", "{base}/user_conf", "+recipe=digits", "optimizer.lr=[1"],
     ["optimizer.lr=[1: not a readable override", "expected key=value"]),
    ("config-dir-slice-unquoted", ["--config-dir", "{base}/user_conf", "+recipe=digits", "session.target=labels[1:]"],
     ["session.target=labels[1:]: a value with brackets", "expected 'session.target=\"labels[1:]\"'"]),
    ("config-dir-retired-key", ["--config-dir", "{base}/user_conf", "+recipe=quantized_before"],
     ["In 'recipe/quantized_before': learner.num_quantization_bits: no longer a learner setting; write "
      "learner/exchange=quantized learner.exchange.num_bits=VALUE"]),
    ("config-dir-unknown-option", ["-cd", "{base}/user_conf", "+recipe=digits", "model=user_mpl"],
     ["model/user_mpl", "available:", "user_mlp"]),
    ("target-slice-no-steps", ['session.target="labels[1:]"'], ["'labels' is not a sequence stream"]),
    ("defining-stream-unknown", ["source.train.defining_stream=nope"], ["defining_stream='nope': the data has no stream"]),
    ("bucketing-without-sequences", ["source.train.length_bucketing=4"],
     ["length_bucketing=4: the data has no sequence stream"]),
    ("bucketing-negative", ["source.train.length_bucketing=-1"], ["source.train.length_bucketing=-1: expected"]),
    # communication
    ("backend-unknown", ["comm.backend=tcp"], ["comm.backend='tcp': expected one of auto, gloo, mpi, nccl, local"]),
    ("timeout-nan", ["comm.timeout_s=nan"], ["comm.timeout_s=nan: expected"]),
    ("timeout-0", ["comm.timeout_s=0"], ["comm.timeout_s=0.0: expected"]),
    ("heartbeat-negative", ["comm.heartbeat_timeout_s=-1"], ["comm.heartbeat_timeout_s=-1.0: expected"]),
    ("heartbeat-inf", ["comm.heartbeat_timeout_s=inf"], ["comm.heartbeat_timeout_s=inf: expected"]),
    ("hierarchical-unknown", ["comm.hierarchical=maybe"], ["comm.hierarchical='maybe': expected auto, true or false"]),
    ("hierarchical-true-one-host", ["comm.hierarchical=true"],  # one process, or mpiexec -n 2 on one host
     ["comm.hierarchical=true", "use comm.hierarchical=auto or false"]),
    ("ranks-per-host-0", ["comm.ranks_per_host=0"], ["comm.ranks_per_host=0: expected a positive whole number"]),
    ("ranks-per-host-not-dividing", ["comm.ranks_per_host=3"], ["comm.ranks_per_host=3 does not divide the job's"]),
    # learners
    ("bits-0", ["learner=quantized", "learner.exchange.num_bits=0"], ["learner.exchange.num_bits=0: expected"]),
    ("bits-33", ["learner=quantized", "learner.exchange.num_bits=33"], ["learner.exchange.num_bits=33: expected"]),
    ("sparse-top-k-0", ["learner=sparseloco", "learner.exchange.top_k=0"], ["learner.exchange.top_k=0: expected"]),
    ("sparse-top-k-above-chunk", ["learner=sparseloco", "learner.exchange.top_k=5000"],
     ["learner.exchange.top_k=5000: expected at most learner.exchange.chunk_size=4096"]),
    ("sparse-bits-0", ["learner=sparseloco", "learner.exchange.num_bits=0"], ["learner.exchange.num_bits=0: expected"]),
    ("outer-lr-negative", ["learner=local_sgd", "learner/outer_optimizer=adam", "learner.outer_optimizer.lr=-1"],
     ["learner.outer_optimizer: Invalid learning rate: -1"]),
    ("outer-setting-replaced", ["learner=diloco", "learner/outer_optimizer=adam", "learner.outer_learning_rate=0.5"],
     ["learner.outer_learning_rate=0.5 sets the learner's own outer step, which learner.outer_optimizer replaces"]),
    ("outer-optimizer-unknown", ["learner=local_sgd", "learner/outer_optimizer=lion"],
     ["Could not find 'learner/outer_optimizer/lion' (available: adam, nesterov, sgd)"]),
    ("outer-optimizer-on-data-parallel", ["learner=data_parallel", "learner/outer_optimizer=adam"],
     ["learner=data_parallel has no learner/outer_optimizer; learner/outer_optimizer=NAME goes with"]),
    ("overlap-on-data-parallel", ["learner=data_parallel", "learner.overlap=true"],
     ["Could not override 'learner.overlap'. Key 'overlap' not in 'DataParallelLearnerConfig'"]),
    ("overlap-two-level", ["learner=two_level_diloco", "learner.overlap=true"],
     ["learner.overlap=true: the two-level learners do not overlap their exchange between hosts yet"]),
    # the quantized learner's settings of earlier releases: what to write now
    ("retired-bits", ["learner=quantized", "learner.num_quantization_bits=4"],
     ["learner.num_quantization_bits=4: no longer a learner setting; write learner/exchange=quantized "
      "learner.exchange.num_bits=4"]),
    ("retired-error-feedback", ["learner=quantized", "learner.error_feedback=false"],
     ["learner.error_feedback=false: no longer a learner setting; write learner/exchange=quantized "
      "learner.exchange.error_feedback=false"]),
    ("retired-warm-start", ["learner=quantized", "learner.warm_start=local"],
     ["learner.warm_start=local: no longer a learner setting; write learner.warm_start_mode=local"]),
    ("bucket-0", ["learner.bucket_size_mb=0"], ["learner.bucket_size_mb=0.0: expected"]),
    ("bucket-nan", ["learner.bucket_size_mb=nan"], ["learner.bucket_size_mb=nan: expected"]),
    ("distributed-after", ["learner.distributed_after=-1"], ["learner.distributed_after=-1: expected"]),
    ("block-size-0", ["learner=block_momentum", "learner.block_size=0"], ["learner.block_size=0: expected"]),
    ("block-lr-0", ["learner=block_momentum", "learner.block_learning_rate=0"], ["learner.block_learning_rate=0.0: expected"]),
    ("block-time-constant", ["learner=block_momentum", "learner.block_momentum_as_time_constant=-3"],
     ["learner.block_momentum_as_time_constant=-3.0: expected"]),
    ("learner-unknown", ["learner=nope"], ["learner/nope", "available:"]),
    ("exchange-on-local", ["learner=local", "learner/exchange=bf16"],
     ["learner=local has no learner/exchange; learner/exchange=NAME goes with learner=block_momentum, data_parallel, "
      "diloco, local_sgd, powersgd, quantized, sparseloco, two_level_block_momentum, two_level_diloco, "
      "two_level_local_sgd, two_level_powersgd or two_level_quantized"]),
    # unknown keys, with and without +
    ("plus-misspelt-session", ["+session.max_sample=640"], ["session.max_sample: unknown key", "did you mean session.max_samples?"]),
    ("plus-misspelt-optimizer", ["+optimizer.momentun=0.9"], ["optimizer.momentun: unknown key", "did you mean optimizer.momentum?"]),
    ("plus-misspelt-model", ["+model.hiden=64"], ["model.hiden: unknown key", "did you mean model.hidden?"]),
    ("plus-misspelt-comm", ["+comm.timout_s=5"], ["comm.timout_s: unknown key", "did you mean comm.timeout_s?"]),
    ("plus-bits-on-block-momentum", ["learner=block_momentum", "+learner.num_quantization_bits=1"],
     ["learner.num_quantization_bits=1: no longer a learner setting; write learner/exchange=quantized "
      "learner.exchange.num_bits=1"]),
    ("misspelt", ["session.minibatch_sise=5"], ["minibatch_sise"]),
    ("group-list", ["session=[1,2]"], ["session=[1,2]: expected the name of one session option (default)"]),
    ("seed-negative", ["seed=-1"], ["seed=-1: expected"]),
    ("source-sweeps-0", ["source.train.max_sweeps=0"], ["source.train.max_sweeps=0: expected"]),
    ("source-seed-negative", ["source.train.randomization_seed=-1"], ["source.train.randomization_seed=-1: expected"]),
    # callbacks (conf/callbacks, or a _target_ of one's own): the option, the class, its arguments, its monitor
    ("callbacks-unknown-option", ["callbacks=[early_stoping]"],
     ["callbacks/early_stoping", "(available: best_checkpoint, early_stopping, time_limit;"]),
    ("callbacks-unknown-argument", ["callbacks=[early_stopping]", "+callbacks.early_stopping.patiense=3"],
     ["callbacks.early_stopping: EarlyStopping.__init__() got an unexpected keyword argument 'patiense'"]),
    ("callbacks-bad-value", ["callbacks=[early_stopping]", "callbacks.early_stopping.patience=0"],
     ["callbacks.early_stopping: EarlyStopping patience=0: expected a whole number of evaluations of at least 1"]),
    ("callbacks-target-missing", ["+callbacks.mine._target_=no_such_module.Callback"],
     ["callbacks.mine: Error locating target 'no_such_module.Callback'", "expected an importable class"]),
    ("callbacks-not-a-callback", ["+callbacks.mine._target_=collections.OrderedDict"],
     ["callbacks.mine: callback collections.OrderedDict has none of the events", "expected a dtrain.Callback"]),
    ("callbacks-not-a-block", ["+callbacks.mine=5"], ["callbacks.mine: expected a _target_ block"]),
    ("early-stopping-no-cv", ["callbacks=[early_stopping,best_checkpoint]"],
     ["EarlyStopping monitor='cv.error': this run writes no cv records", "expected one of the values it writes: "
      "train.loss, train.error"]),
    ("early-stopping-at-the-end", ["source.cv=${{source.test}}", "callbacks=[early_stopping]"],
     ["EarlyStopping monitor='cv.error': this run evaluates it only once, at its end, so it could never stop early; "
      "expected the cross-validation frequency (session.cv.frequency) below max_samples"]),
    ("best-checkpoint-unknown-key", ["source.cv=${{source.test}}", "callbacks=[best_checkpoint]",
                                     "callbacks.best_checkpoint.monitor=cv.top5_error"],
     ["BestCheckpoint monitor='cv.top5_error': cv records have no top5_error", "cv.loss, cv.error"]),
    # recipes
    ("recipe-unknown", ["+recipe=imagenette"], ["unknown recipe 'imagenette'; expected one of cifar10, cmudict_g2p, digits"]),
    ("recipe-missing", [], ["no recipe chosen", "+recipe=NAME"]),
    # run directories
    ("run-dir-empty-string", ["run_dir="], ["run_dir='': expected the path of a directory"]),
    ("run-dir-is-file", ["run_dir={file}"], ["run_dir={file}: is a file, not a directory; expected a directory"]),
    ("run-dir-is-empty-file", ["run_dir={empty}"], ["run_dir={empty}: is an empty file", "expected a directory"]),
    ("run-dir-below-file", ["run_dir={file}/sub"], ["run_dir={file}/sub: {file} is a file", "expected a path below a directory"]),
    ("run-dir-read-only", ["run_dir={readonly}/run"], ["run_dir={readonly}/run", "not writable", "expected a writable directory"]),
    # the run directory's own checkpoint and resources
    ("restore-off", ["session.checkpoint.restore=false"], ["already exists and restore is off"]),
    ("restore-from-missing", ["session.checkpoint.restore_from=nope.pt"],
     ["session.checkpoint.restore_from='nope.pt': no such file; expected a dtrain checkpoint file"]),
    ("restore-from-restore-off", ["session.checkpoint.restore_from={finished}/checkpoint-64.pt",
                                  "session.checkpoint.restore=false"],
     ["session.checkpoint.restore_from=", "expected session.checkpoint.restore=true"]),
    ("restore-from-other-model", ["run_dir={base}/fresh", "session.checkpoint.restore_from={finished}/checkpoint-64.pt",
                                  "model.hidden=16"], ["checkpoint {finished}/checkpoint-64.pt does not fit this model"]),
    # refused at the first minibatch (training on) or at the test (nothing left to train): after the resume's checks
    ("metric-k-above-classes", ["metric=top5_error", "metric.k=20"], ["metric top20_error needs at least 20 classes"]),
    ("metric-k-nothing-to-train", ["metric=top5_error", "metric.k=20", "session.max_samples=64"],
     ["metric top20_error needs at least 20 classes"]),
    ("minibatch-too-large", ["session.minibatch_size=1000000000000", "session.max_samples=2000000000000"],
     ["out of memory", "session.minibatch_size=1000000000000", "expected a minibatch that fits"]),
]
if torch.cuda.is_available():
    CASES.append(("backend-nccl-needs-gpus", ["comm.backend=nccl", "comm.timeout_s=-1"], ["comm.timeout_s=-1.0: expected"]))
else:
    CASES.append(("backend-nccl-without-cuda", ["comm.backend=nccl"], ["comm.backend='nccl': expected a machine with CUDA"]))
    CASES.append(("device-cuda-without-cuda", ["session.device=cuda"], ["session.device='cuda': expected a machine with CUDA"]))

#: the user's model of the ``user-model-rule`` case (imported from the working directory): its rule, registered
#: when the module is imported, is checked with every other rule before anything is built or written
USER_MODEL = """
import torch
from dtrain import checks
from dtrain.config import register_rule


class MLP(torch.nn.Module):
    def __init__(self, hidden: int = 32):
        super().__init__()
        checks.whole_number("hidden", hidden, low=1, unit="units")
        self.layers = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, hidden), torch.nn.ReLU(),
                                          torch.nn.Linear(hidden, 10))

    def forward(self, features):
        return self.layers(features)


@register_rule("user_mlp_model.MLP")
def mlp_problems(node, name):
    return checks.collect([lambda: checks.whole_number(f"{name}.hidden", node.hidden, low=1, unit="units")])
"""

#: the cases the default suite runs: one or two of each kind, each refused at another point (validation, composition,
#: instantiation, the run directory, the checkpoint, the first minibatch); the slow set runs every case
DEFAULT_CASES = {
    "minibatch-0", "two-problems-at-once", "threads-0", "lr-schedule-word", "lr-nan", "optimizer-unknown",
    "lars-eta-negative", "hidden-negative", "user-model-rule", "classes-vs-data", "compile-2", "device-malformed",
    "inputs-unknown-stream", "backend-unknown", "bits-0", "exchange-on-local", "plus-misspelt-session", "misspelt",
    "group-list", "recipe-unknown", "recipe-missing", "run-dir-empty-string", "run-dir-is-file", "run-dir-below-file",
    "restore-off", "restore-from-missing", "restore-from-other-model", "metric-k-above-classes",
    "metric-k-nothing-to-train", "minibatch-too-large", "config-dir-list-unclosed", "config-dir-slice-unquoted",
    "config-dir-unknown-option", "callbacks-unknown-option", "callbacks-unknown-argument", "callbacks-target-missing",
    "callbacks-not-a-callback", "early-stopping-no-cv", "early-stopping-at-the-end", "retired-bits",
    "sparse-top-k-above-chunk", "outer-setting-replaced", "overlap-two-level"}

# every case without a recipe of its own uses the digits recipe
# the last ones name the recipe after --config-dir
_RECIPE_FREE = {"recipe-unknown", "recipe-missing", "user-model-rule", "config-dir-list-unclosed",
                "config-dir-slice-unquoted", "config-dir-unknown-option", "config-dir-retired-key"}

# under mpiexec: failures before the communicator exists (validation, composition, the recipe) and
# after it (instantiation, the checkpoint, training), each reported once, by rank 0. One case per place a
# failure is found (each launch costs both ranks' start-up); every case runs in one process above
#: the default suite keeps one of each kind (before the communicator: lr-nan; after: restore-off), the slow set
#: one per further place: Hydra's composition, the recipe's name, building the model against the data, the run
#: directory, a minibatch too large, a component, a callback's check against the run, and the communicator's layout
MPI_CASES = ["lr-nan", "restore-off", *(pytest.param(case, marks=pytest.mark.slow) for case in (
             "plus-misspelt-session", "recipe-unknown", "classes-vs-data", "run-dir-is-file", "minibatch-too-large",
             "callbacks-not-a-callback", "early-stopping-no-cv")),
             pytest.param("hierarchical-true-one-host", marks=pytest.mark.slow),
             pytest.param("ranks-per-host-not-dividing", marks=pytest.mark.slow)]


def _arguments(case_id: str, arguments: list[str], places: dict[str, str]) -> list[str]:
    filled = [argument.format(**places) for argument in arguments]
    if not any(argument.startswith("run_dir=") for argument in filled):
        filled.append(f"run_dir={places['run']}")
    return filled if case_id in _RECIPE_FREE else ["+recipe=digits", *filled]


@pytest.fixture(scope="module")
def places(tmp_path_factory) -> dict[str, str]:
    """A finished tiny run (checkpoints, configs, metrics) and the odd paths the run_dir cases use."""
    base = tmp_path_factory.mktemp("bad_input")
    finished = subprocess.run(
        [sys.executable, "-m", "dtrain", "+recipe=digits", f"run_dir={base / 'finished'}", "session.max_samples=64",
         "session.checkpoint.frequency=32", "session.progress_frequency=32", "session.tensorboard=false"],
        cwd=base, env=plain_environment(), capture_output=True, text=True, timeout=300)
    assert finished.returncode == 0, finished.stderr
    assert len(list((base / "finished").glob("checkpoint-*.pt"))) == 2
    (base / "afile").write_text("not a directory\n")
    (base / "user_conf" / "model").mkdir(parents=True)
    (base / "user_conf" / "model" / "user_mlp.yaml").write_text("_target_: user_mlp_model.MLP\nhidden: 32\n")
    (base / "user_conf" / "recipe").mkdir()  # a recipe of an earlier release, with the quantized learner's bits
    (base / "user_conf" / "recipe" / "quantized_before.yaml").write_text(
        "# @package _global_\ndefaults:\n  - /recipe/digits\n  - override /learner: quantized\n"
        "learner:\n  num_quantization_bits: 2\n")
    (base / "user_mlp_model.py").write_text(USER_MODEL)
    (base / "empty").write_bytes(b"")
    readonly = base / "readonly"
    readonly.mkdir()
    readonly.chmod(0o555)
    return {"base": str(base), "finished": str(base / "finished"), "file": str(base / "afile"),
            "empty": str(base / "empty"), "readonly": str(readonly)}


class ForkedResults:
    """The single-process cases, run by two forking runners side by side, each on its own copy of the run.

    Every case is sent at once and the runners work through them in the background, but each test waits
    for its own result only (:meth:`get`): on a busy machine a slow case makes its own test slow, within
    that test's timeout, instead of making the shared fixture's setup run past it and error every test.
    """

    def __init__(self, places: dict[str, str], cases: list[tuple]) -> None:
        base = Path(places["base"])
        self._runners: list[subprocess.Popen] = []
        self._places: dict[str, dict[str, str]] = {}
        self._results: dict[str, dict] = {}
        self._runner_of: dict[str, int] = {}
        for index in range(2):
            run = base / f"run{index}"
            shutil.copytree(places["finished"], run)
            # no GPU for the runner: the cases are a CPU machine's (as in CI), and a CUDA driver started in the
            # runner would not survive its forks
            self._runners.append(subprocess.Popen([sys.executable, str(RUNNER)], cwd=base,
                                                  env=plain_environment(CUDA_VISIBLE_DEVICES=""),
                                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
            self._places[str(index)] = {**places, "run": str(run)}
        for number, (case_id, arguments, _) in enumerate(cases):
            runner, where = number % 2, self._places[str(number % 2)]
            self._runner_of[case_id] = runner
            watch = [where["run"], where["file"], where["empty"]]
            self._runners[runner].stdin.write(json.dumps({"id": case_id, "argv": _arguments(case_id, arguments, where),
                                                          "cwd": str(base), "watch": watch}) + "\n")
        for process in self._runners:
            process.stdin.close()  # the runner ends after the last case

    def get(self, case_id: str) -> dict:
        """The result of ``case_id`` (with the ``places`` it ran against), waiting for its runner to reach it."""
        runner = self._runner_of[case_id]
        while case_id not in self._results:
            line = self._runners[runner].stdout.readline()
            assert line, f"runner {runner} ended before case {case_id} (exit code {self._runners[runner].poll()})"
            try:
                result = json.loads(line)
            except json.JSONDecodeError:  # the rest of a line whose reading a timed-out test interrupted: its case fails alone
                continue
            self._results[result["id"]] = {**result, "places": self._places[str(runner)]}
        return self._results[case_id]

    def close(self) -> None:
        """Ends the runners: one whose every result was read must have ended cleanly; one whose tests were stopped
        early is ended at once."""
        codes = []
        for runner, process in enumerate(self._runners):
            sent = [case_id for case_id, index in self._runner_of.items() if index == runner]
            if all(case_id in self._results for case_id in sent):
                codes.append(process.wait(timeout=60))
            else:
                process.kill()
                process.wait()
            process.stdout.close()
        assert not any(codes), f"runners exited with {codes}"


@pytest.fixture(scope="module")
def single_process_results(places, request):
    """Every selected single-process case, started at once (:class:`ForkedResults`); each test waits for its own."""
    selected = {item.callspec.params["case_id"] for item in request.session.items
                if getattr(item, "originalname", None) == "test_bad_input_in_one_process"}
    results = ForkedResults(places, [case for case in CASES if case[0] in selected])
    yield results
    results.close()


def _check(case_id: str, result: dict, fragments: list[str], places: dict[str, str], *, mpi: bool = False) -> None:
    report = f"exit code {result['returncode']}\n--- stdout ---\n{result['stdout']}\n--- stderr ---\n{result['stderr']}"
    assert result["returncode"] == 2, report
    assert "Traceback" not in result["stdout"] and "Traceback" not in result["stderr"], report
    lines = [line for line in (result["stdout"] + result["stderr"]).splitlines() if "dtrain: error:" in line]
    assert len(lines) == 1, report
    line = lines[0]
    if mpi:
        assert line.startswith(("dtrain: error: ", "[rank 0/2] dtrain: error: ")), report
        assert "dtrain: error:" in result["stderr"].split("-----")[0], report  # before Open MPI's banner
    else:
        assert result["stderr"].strip().splitlines() == [line] and line.startswith("dtrain: error: "), report
    for fragment in fragments:
        assert fragment.format(**places) in line, (fragment, line)
    if case_id == "threads-0":
        assert "samples" not in line
    assert result["changed"] == [], f"files changed: {result['changed']}\n{report}"
    assert result.get("added", []) == [], f"files added: {result['added']}\n{report}"  # byte-identical directories


@pytest.mark.parametrize("case_id, arguments, fragments", [
    pytest.param(*case, id=case[0], marks=() if case[0] in DEFAULT_CASES else pytest.mark.slow) for case in CASES])
def test_bad_input_in_one_process(case_id, arguments, fragments, single_process_results):
    if case_id == "run-dir-read-only" and os.geteuid() == 0:
        pytest.skip("root may write into a read-only directory; the rule is covered by test_config")
    result = single_process_results.get(case_id)
    _check(case_id, result, fragments, result["places"])


@pytest.mark.parametrize("case_id", MPI_CASES)
def test_bad_input_under_mpiexec(case_id, places, tmp_path):
    _, arguments, fragments = next(case for case in CASES if case[0] == case_id)
    run = tmp_path / "run"
    shutil.copytree(places["finished"], run)
    where = {**places, "run": str(run)}
    watch = [run, Path(places["file"]), Path(places["empty"])]
    before = {p: p.read_bytes() for root in watch for p in ([root] if root.is_file() else root.rglob("*")) if p.is_file()}
    result = run_mpi(2, ["-m", "dtrain", *_arguments(case_id, arguments, where)], timeout=120)
    changed = [str(p) for p, content in before.items() if not p.exists() or p.read_bytes() != content]
    _check(case_id, {"returncode": result.returncode, "stdout": result.stdout, "stderr": result.stderr,
                     "changed": changed}, fragments, where, mpi=True)
