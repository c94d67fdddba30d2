"""``python -m dtrain +recipe=NAME [key=value ...]``: a thin Hydra layer over the Python API.

Every rank composes the same config; the communicator comes up first, so that a bad config or a
missing data set ends every rank with one clear line instead of a hang.
"""
from __future__ import annotations

import os
import re
import sys
import warnings
from pathlib import Path

import hydra
from omegaconf import DictConfig

from dtrain.build import check_model_outputs, save_config, train_from_config
from dtrain.comm import create_communicator, install_fail_fast, start_heartbeat
from dtrain.comm.base import first_line
from dtrain.config import register_schemas, validate
from dtrain.failures import (EXIT_BAD_INPUT, EXIT_PREEMPTED, UserError, continue_command, describe_failure, end_failed_sweep_job,
                             end_job, exit_bad_input, exit_preempted, fail_before_job, is_lost_peer, launch_position,
                             print_debug_traceback)
from dtrain.help import (MULTIPLE_CHOICE_GROUPS, UnknownTopic, config_dir, config_directories, nested_group_hint,
                         quick_answer)
from dtrain.learners.settings import RETIRED, retired_setting
from dtrain.session import TrainingDiverged
from dtrain.sweep import JobFailed, SweepJob, current_job, finish_sweep, record_outcome, start_sweep, sweep_outcomes


def run(cfg: DictConfig, job: SweepJob | None = None) -> float | None:
    """Builds everything from ``cfg``, trains, and returns the run's objective.

    The objective (``TrainingResult.objective``: test error, else the last cross-validation
    error, else the last training error) is what Hydra's sweepers minimise.

    Any failure ends every rank of the job with one line, the failing rank's first: a bad
    input (config, run directory, data set, checkpoint, a minibatch too large for memory) with
    ``dtrain: error: ...`` and exit code 2, anything else with the exception's one line and
    exit code 1 (``DTRAIN_DEBUG=1`` adds the traceback). Exceptions never reach Hydra, whose
    traceback printer and ``sys.exit`` would leave the other ranks waiting in ``MPI_Finalize``.

    In a sweep (``job``), a failure that every rank of the job meets ends the job alone: rank 0
    prints its line and every rank raises :class:`JobFailed` (Hydra's failed job), so the sweep goes
    on. A failure of some ranks only still ends the whole sweep as above, since the others are
    inside a collective that will never complete.
    """
    # every rank looks (only rank 0 writes): a rank that went on into start-up alone would leave the
    # launcher to tear down a half-started job. In a sweep, the file system is looked at once the
    # ranks can agree on what they saw (a rank going on to the next job alone would pair jobs wrongly)
    problems = validate(cfg, check_run_dir=job is None)
    if problems:
        fail_before_job("; ".join(problems), job=job)
    try:
        comm = create_communicator(cfg.comm.backend, timeout_s=cfg.comm.timeout_s, hierarchical=cfg.comm.hierarchical,
                                   ranks_per_host=cfg.comm.ranks_per_host)
    except Exception as error:  # noqa: BLE001 -- before the job exists; MPI start-up failures abort by themselves
        print_debug_traceback()
        message, code = describe_failure(error, cfg)
        fail_before_job(message, code, job=job)
    install_fail_fast(comm)
    heartbeat = start_heartbeat(comm, cfg.comm.heartbeat_timeout_s)  # comm.finalize() stops it
    failure = None
    try:
        if job is not None:
            _agree_on_the_file_system(comm, cfg)
        objective = train_from_config(comm, cfg, job)
    except Exception as error:  # noqa: BLE001 -- every failure ends the whole job, with one line
        print_debug_traceback()
        message, code = describe_failure(error, cfg)
        if job is None:
            end_job(comm, message, code, lost_peer=is_lost_peer(error))
        failure = (message, code, "diverged" if isinstance(error, TrainingDiverged) else "failed", is_lost_peer(error))
    if failure is not None:  # outside the except block: the failed job's objects are freed before the next job
        end_failed_sweep_job(comm, heartbeat, cfg, *failure)
    comm.finalize()  # stops the heartbeat once every rank has arrived: rank 0 may still be writing its outputs
    return objective


def _agree_on_the_file_system(comm, cfg: DictConfig) -> None:
    """In a sweep: the run directory and restore_from checks on every rank, one verdict for all.

    Raises:
        UserError: on every rank, when any rank found a problem (the first such rank's).
    """
    problems = comm.allgather_object(validate(cfg, check_run_dir=True))
    found = next((rank_problems for rank_problems in problems if rank_problems), None)
    if found:
        raise UserError("; ".join(found))


def sweep_run_dir(cfg: DictConfig) -> str | None:
    """In a sweep (``-m``), the job's own run directory, ``hydra.sweep.dir/<job number>``; ``None`` otherwise.

    Raises:
        UserError: ``run_dir`` was set on the command line of a sweep (every job would share it), or
            a launcher would start several independent copies of each job.
    """
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return None
    hydra_cfg = HydraConfig.get()
    if _overrides_key(hydra_cfg.overrides.task, "run_dir"):
        raise UserError(_RUN_DIR_IN_SWEEP)
    tasks = os.environ.get("SUBMITIT_LOCAL_NTASKS", "1")
    if tasks != "1":
        raise UserError(_submitit_local_copies(tasks))
    return hydra_cfg.runtime.output_dir


def _overrides_key(overrides, key: str) -> bool:
    """Whether one of Hydra's recorded command-line overrides (``key=v``, ``+key=v``, ``~key``) sets ``key``."""
    return any(override.lstrip("+~").split("=", 1)[0] == key for override in overrides)


def hydra_run_dir(cfg: DictConfig) -> str | None:
    """``hydra.run.dir=DIR`` on the command line of a single run: ``DIR``, which dtrain takes as ``run_dir``
    (Hydra's own way to name a run's directory must not be accepted and ignored); ``None`` otherwise.

    Raises:
        UserError: both ``hydra.run.dir`` and ``run_dir`` were given, naming different directories.
    """
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.RUN:
        return None
    hydra_cfg = HydraConfig.get()
    if not _overrides_key(hydra_cfg.overrides.hydra, "hydra.run.dir"):
        return None
    chosen = hydra_cfg.runtime.output_dir
    if _overrides_key(hydra_cfg.overrides.task, "run_dir") and os.path.abspath(cfg.run_dir) != os.path.abspath(chosen):
        raise UserError(f"hydra.run.dir={chosen} and run_dir={cfg.run_dir} name different run directories; "
                        f"expected one of them (dtrain writes into run_dir; hydra.run.dir=DIR is taken as run_dir=DIR)")
    return chosen


_RUN_DIR_IN_SWEEP = ("run_dir cannot be set in a sweep (-m): every job gets its own directory, hydra.sweep.dir/<job "
                     "number>; choose where with hydra.sweep.dir=DIR (the same DIR again resumes each job)")


def _submitit_local_copies(tasks: str) -> str:
    return (f"hydra/launcher=submitit_local with tasks_per_node={tasks} starts {tasks} independent copies of each job; "
            f"set hydra.launcher.tasks_per_node=1 (under Slurm, submitit_slurm's tasks of one job form one "
            f"distributed job)")


@hydra.main(version_base="1.3", config_path=config_dir(), config_name="config")
def _hydra_main(cfg: DictConfig) -> float | None:
    _composed.restore_error_printing()  # the task's own errors never reach Hydra (run ends every rank itself)
    job = current_job()
    if job is not None:
        return run_sweep_job(cfg, job)
    try:
        job_dir = sweep_run_dir(cfg) or hydra_run_dir(cfg)
    except UserError as error:
        exit_bad_input(str(error))
    if job_dir is not None:
        cfg.run_dir = job_dir
    return run(cfg)


def run_sweep_job(cfg: DictConfig, job: SweepJob) -> float | None:
    """One job of a sweep: rank 0 names it (``dtrain: job 1/3: optimizer.lr=-1``), then it runs in its own
    directory; how it ended is recorded for the sweep's summary, and a failure is raised to Hydra as
    :class:`JobFailed` (the sweep goes on)."""
    is_main = launch_position()[0] == 0
    if is_main:
        print(f"dtrain: {job.describe()}", flush=True)
    try:
        try:
            cfg.run_dir = sweep_run_dir(cfg)
        except UserError as error:
            fail_before_job(str(error), job=job)
        objective = run(cfg, job)
    except JobFailed as failure:
        record_outcome(job, failure.kind, code=failure.code, message=failure.message, write=is_main)
        raise
    record_outcome(job, "finished", objective=objective, write=is_main)
    return objective


def _sweeper_error(error: BaseException) -> str:
    """One line for an error of Hydra or a sweeper (a bad sweep override, a study with no finished trial)."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    if not isinstance(error, (HydraException, OmegaConfBaseException)):
        return describe_failure(error)[0]
    cause = error.__cause__
    return first_line(error) + (f" ({first_line(cause)})" if cause is not None and first_line(cause) else "") + \
        " (python -m dtrain +recipe=NAME --cfg job lists every key)"


def run_sweep(argv: list[str]) -> int:
    """``python -m dtrain -m ...``: runs Hydra's sweep, whose jobs fail alone (``run_sweep_job``), then
    prints its summary; returns the sweep's exit status (0: every job finished).

    Hydra's sweepers re-raise a failed job (the basic sweeper once its batch has run) and Optuna's
    stops at ``hydra.sweeper.max_failure_rate``, which is therefore 1.0 unless given. Their errors
    come back here (``HYDRA_FULL_ERROR``) instead of as Hydra's traceback.
    """
    start_sweep(argv)
    if "hydra/sweeper=optuna" in argv and not any(a.startswith("hydra.sweeper.max_failure_rate=") for a in argv):
        sys.argv.append("hydra.sweeper.max_failure_rate=1.0")  # failed trials are told as failed; the study goes on
    previous = os.environ.get("HYDRA_FULL_ERROR")
    os.environ["HYDRA_FULL_ERROR"] = "1"
    stopped_by = None
    try:
        _hydra_main()
    except JobFailed:
        pass  # a failed job the sweeper re-raised: it is in the outcomes already
    except Exception as error:  # noqa: BLE001 -- a sweeper or Hydra error: one line, not a traceback
        print_debug_traceback()
        stopped_by = _sweeper_error(error)
    finally:
        if previous is None:
            os.environ.pop("HYDRA_FULL_ERROR", None)
        else:
            os.environ["HYDRA_FULL_ERROR"] = previous
    is_main = launch_position()[0] == 0
    if stopped_by is not None and not sweep_outcomes():
        if is_main:
            print(f"dtrain: error: {stopped_by}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    return finish_sweep(is_main, stopped_by)


def available_recipes(argv: list[str]) -> list[str]:
    """Recipe names in the shipped tree and in any ``--config-dir``/``-cd`` given on the command line."""
    return sorted({p.stem for d in config_directories(config_dir(), argv) for p in (d / "recipe").glob("*.yaml")})


def check_recipe_argument(argv: list[str]) -> str | None:
    """One-line problem with ``+recipe=NAME`` on the command line (unknown name), else ``None``."""
    for argument in argv:
        if argument.startswith(("+recipe=", "recipe=")):
            name = argument.split("=", 1)[1]
            known = available_recipes(argv)
            if name not in known:
                return (f"unknown recipe {name!r}; expected one of {', '.join(known)} "
                        f"(or put your own recipe/{name}.yaml in a directory passed with --config-dir)")
    return None


def config_groups() -> list[str]:
    """The config group names (``learner``, ``optimizer``, ``session``, ...) of the shipped tree."""
    return sorted(p.name for p in Path(config_dir()).iterdir() if p.is_dir() and not p.name.startswith("."))


def check_overrides(argv: list[str], compose: bool = True) -> str | None:
    """Parses the overrides of ``argv``, then composes the config once, to turn Hydra's multi-line override
    errors into one line.

    The parse runs whatever flags are given (a typo is the same typo with ``-m`` or ``--cfg job``); the
    composition runs when the only flags are ``--config-dir``/``-cd`` (whose directory joins the search
    path, as Hydra's own run does): with any other flag (``--cfg``, ``-m``, ...) Hydra composes and reports
    by itself. ``compose=False`` leaves the composition to Hydra's run (:func:`run_single` reports its
    failure in the same line), which saves start-up one composition (about 0.4 s).
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    flags, overrides = split_arguments(argv)
    if any(flag in ("--shell-completion", "-sc") for flag in flags):
        return None  # its query=... is Hydra's completion request, not an override
    directories = config_directories(config_dir(), flags)
    missing = next((directory for directory in directories[1:] if not directory.is_dir()), None)
    if missing is not None:
        return f"--config-dir {missing}: no such directory; expected a directory of configs (recipe/NAME.yaml, ...)"
    # a word that is neither a flag, a flag's value nor key=value (a forgotten =) is read as Hydra reads it: an override
    strays = [word for index, word in enumerate(flags) if not word.startswith("-") and not (
        index > 0 and (flags[index - 1] in _HYDRA_OPTIONS_WITH_A_VALUE
                       or flags[index - 1] in ("--info", "-i") and word in _HYDRA_INFO_CHOICES))]
    parser, parsed = OverridesParser.create(), []
    for argument in [*overrides, *strays]:
        try:
            parsed.append(parser.parse_override(argument))
        except HydraException as error:
            return _unreadable_override(argument, error)
    for override in parsed:  # a learner setting of an earlier release: what to write now, before Hydra's "not in"
        prefix, _, key = override.key_or_group.rpartition(".")
        if prefix == "learner" and key in RETIRED:
            return retired_setting(key, None if override.is_delete() else override.input_line.split("=", 1)[1],
                                   prefix="learner.")
    groups = config_groups()
    for override in parsed:
        key = override.key_or_group
        if key in groups and key not in MULTIPLE_CHOICE_GROUPS and not isinstance(override.value(), str) \
                and not override.is_sweep_override():
            options = sorted({p.stem for directory in directories for p in (directory / key).glob("*.yaml")})
            return f"{override.input_line}: expected the name of one {key} option ({', '.join(options)})"
    if not compose or not composes_itself(flags):
        return None
    return _composition_problem(overrides, directories)


def composes_itself(flags: list[str]) -> bool:
    """Whether dtrain reports a config that cannot be composed (in one line) under these flags: only
    ``--config-dir``/``-cd`` given. With any other flag (``--cfg``, ``-m``, ...) Hydra composes and reports."""
    return not any(flag.startswith("-") and flag not in _CONFIG_DIR_FLAGS and not flag.startswith("--config-dir=")
                   for flag in _flag_names(flags))


class _HydraErrors:
    """Hydra's composition errors raised to dtrain (``HYDRA_FULL_ERROR=1``) until the task function starts,
    then Hydra's own setting again: while composing, Hydra would print them over several lines and exit 1."""

    def __init__(self) -> None:
        self.raising, self.previous, self.task_started = False, None, False

    def raise_them(self) -> None:
        self.raising, self.previous, self.task_started = True, os.environ.get("HYDRA_FULL_ERROR"), False
        os.environ["HYDRA_FULL_ERROR"] = "1"

    def restore_error_printing(self) -> None:
        self.task_started = True
        if not self.raising:
            return
        self.raising = False
        if self.previous is None:
            os.environ.pop("HYDRA_FULL_ERROR", None)
        else:
            os.environ["HYDRA_FULL_ERROR"] = self.previous


_composed = _HydraErrors()


def run_single(argv: list[str]) -> None:
    """Hydra's single run of ``argv``. Hydra composes the config (for its mode, then for the run); a config it
    cannot compose ends the process as :func:`check_overrides` would have said it, in one line with exit code
    2, without dtrain composing it a third time beforehand."""
    flags, overrides = split_arguments(argv)
    if not composes_itself(flags):
        _hydra_main()
        return
    _composed.raise_them()
    try:
        _hydra_main()
    except Exception as error:  # noqa: BLE001 -- only what Hydra raised before the task started is reported here
        if _composed.task_started:
            raise
        print_debug_traceback()
        directories = config_directories(config_dir(), flags)
        exit_bad_input(_composition_problem(overrides, directories) or _not_composed(overrides, error))
    finally:
        _composed.restore_error_printing()


def _unreadable_override(argument: str, error: Exception) -> str:
    """One line for an override Hydra's grammar cannot read, naming it."""
    value = argument.split("=", 1)[1] if "=" in argument else ""
    if "[" in value and not value.startswith(("[", "'", '"')):  # session.target=text[1:]: [ starts a list
        key = argument.split("=", 1)[0]
        return (f"{argument}: a value with brackets (a step slice) must be quoted on the command line; expected "
                f"'{key}=\"{value}\"' ({first_line(error)})")
    if "=" not in argument and not argument.startswith("~"):
        return (f"{argument}: not an override ({first_line(error)}); expected key=value (or +recipe=NAME, "
                f"group=option, ~key) (python -m dtrain --help lists the recipes and groups)")
    return (f"{argument}: not a readable override ({first_line(error)}); expected key=value, with a list as [a,b], a "
            f"mapping as {{k: v}} and a value holding brackets, braces or spaces quoted "
            f"(python -m dtrain +recipe=NAME --cfg job lists every key)")


def _composition_problem(overrides: list[str], directories: list[Path]) -> str | None:
    """Composes the config from ``overrides`` with ``directories`` (the shipped tree first) on the search path:
    Hydra's multi-line error as one line, or ``None``."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    search = list(overrides)
    if len(directories) > 1 and not any(argument.lstrip("+").startswith("hydra.searchpath=") for argument in overrides):
        search.append("hydra.searchpath=[" + ",".join(f"file://{d.resolve()}" for d in directories[1:]) + "]")
    try:
        with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
            compose("config", overrides=search)
    except (HydraException, OmegaConfBaseException) as error:
        lines = str(error).strip().splitlines()
        retired = re.search(r"^\s*full_key: learner\.(\w+)$", str(error), re.MULTILINE)
        if retired and retired.group(1) in RETIRED:  # in a config file: which file, and what to write now
            return f"{lines[0].split(': ', 1)[0]}: {retired_setting(retired.group(1), None)}"
        parts = [lines[0]]
        hint = nested_group_hint(config_dir(), lines[0], overrides)
        if hint:
            parts.append(hint)
        options = [line.strip() for line in lines if line.startswith("\t") and "provider=" not in line]
        if "Available options" in str(error) and options:
            parts.append(f"(available: {', '.join(options)})")
        missing = re.search(r"Could not load '([^/']+)/([^']+)'", lines[0])
        missing_listed = bool(missing) and missing.group(1) in MULTIPLE_CHOICE_GROUPS
        if missing_listed:  # Hydra lists no options for a list's entry
            group = missing.group(1)
            options = sorted({p.stem for directory in directories for p in (directory / group).glob("*.yaml")})
            parts.append(f"(available: {', '.join(options) or 'none'}; {group}=[NAME,...] takes several)")
        cause = error.__cause__
        if cause is not None and str(cause).strip():
            parts.append(first_line(cause))
            full_key = re.search(r"full_key: (\S+)", str(cause))
            if full_key and full_key.group(1) not in " ".join(parts):
                parts.append(f"(key {full_key.group(1)})")
        if not hint and not missing_listed and (len(parts) == 1 or "Available options" not in str(error)):
            parts.append("(python -m dtrain +recipe=NAME --cfg job lists every key)")
        return " ".join(parts)
    except Exception as error:  # noqa: BLE001 -- Hydra lets some malformed overrides through as raw errors
        return _not_composed(overrides, error)
    return None


def _not_composed(overrides: list[str], error: Exception) -> str:
    """One line for a composition that failed with an error that is not Hydra's or OmegaConf's own."""
    found = re.search(r"full_key: (\S+)", str(error))
    where = f"the override of {found.group(1)}" if found else f"the command line {' '.join(overrides)!r}"
    return (f"{where} could not be composed into a config ({type(error).__name__}: {first_line(error)}); "
            f"expected key=value pairs of the keys that python -m dtrain +recipe=NAME --cfg job lists")


#: what Hydra's ``--info`` may be followed by (its value is optional)
_HYDRA_INFO_CHOICES = frozenset({"all", "config", "defaults", "defaults-tree", "plugins", "searchpath"})


#: the flags after which dtrain still composes the config itself (a directory of the user's configs)
_CONFIG_DIR_FLAGS = frozenset({"--config-dir", "-cd"})


def _flag_names(flags: list[str]) -> list[str]:
    """The flags themselves, without the values of those that take one (``--cfg job``: ``--cfg``)."""
    return [flag for index, flag in enumerate(flags)
            if not (index > 0 and flags[index - 1] in _HYDRA_OPTIONS_WITH_A_VALUE)]


def check_sweep_arguments(argv: list[str]) -> str | None:
    """One-line problem with a sweep's command line (``-m``) before any job starts, else ``None``:
    ``run_dir`` given (every job would share it), or ``submitit_local`` with several tasks per job."""
    if not any(argument in ("-m", "--multirun") for argument in argv):
        return None
    values = {argument.lstrip("+~").split("=", 1)[0]: argument.split("=", 1)[1]
              for argument in argv if "=" in argument and not argument.startswith("-")}
    if "run_dir" in values:
        return _RUN_DIR_IN_SWEEP
    tasks = values.get("hydra.launcher.tasks_per_node", "1")
    if values.get("hydra/launcher") == "submitit_local" and tasks != "1":
        return _submitit_local_copies(tasks)
    return None


def flags_before_overrides(argv: list[str]) -> list[str]:
    """``argv`` with Hydra's flags (``-m``, ``--cfg job``, ...) moved ahead of the overrides, each group in
    its order: Hydra's parser takes the overrides as one run of positionals, so ``seed=1 -m lr=2`` would
    stop at ``lr=2`` with an argparse usage block."""
    flags, overrides = split_arguments(argv)
    return flags + overrides


def split_arguments(argv: list[str]) -> tuple[list[str], list[str]]:
    """``(flags, overrides)`` of a command line, each in its order. An override is ``key=value`` or ``~key``;
    anything else (a flag, or a flag's value: ``job`` after ``--cfg``, the path after ``--config-dir`` even
    with an ``=``) is Hydra's."""
    flags, overrides = [], []
    for index, argument in enumerate(argv):
        value_of_a_flag = index > 0 and argv[index - 1] in _HYDRA_OPTIONS_WITH_A_VALUE
        is_override = (not value_of_a_flag and not argument.startswith("-")
                       and ("=" in argument or argument.startswith("~")))
        (overrides if is_override else flags).append(argument)
    return flags, overrides


def replacing_overrides(argv: list[str]) -> list[str]:
    """``argv`` with each override of a key in :data:`REPLACED_KEYS` by a list or a mapping preceded by one setting
    that key to ``null``: the value given then replaces the config's instead of being merged into it (Hydra
    merges a mapping into a mapping key by key, and cannot merge a mapping into a list or a list into a mapping:
    ``session.inputs={x: x}`` over a recipe's ``{src: ..., tgt: ...}`` would pass ``src`` and ``tgt`` too)."""
    replaced = []
    for argument in argv:
        key, _, value = argument.partition("=")
        if key.lstrip("+") in REPLACED_KEYS and value.lstrip().startswith(("[", "{")):
            replaced.append(f"{key.lstrip('+')}=null")
        replaced.append(argument)
    return replaced


#: the settings whose value on the command line replaces the config's whole, whatever its kind (list or mapping)
REPLACED_KEYS = frozenset({"session.inputs"})


#: Hydra's options whose value is the next argument (``hydra --help``)
_HYDRA_OPTIONS_WITH_A_VALUE = frozenset({"--cfg", "-c", "--package", "-p", "--config-path", "-cp", "--config-name", "-cn",
                                         "--config-dir", "-cd", "--experimental-rerun"})


def _one_line_warning(message, category, filename, lineno, line=None) -> str:
    return f"dtrain: warning: {message}\n"


def main() -> None:
    """Entry point of ``python -m dtrain`` and the ``dtrain`` command."""
    warnings.formatwarning = _one_line_warning
    if "" not in sys.path and os.getcwd() not in sys.path:
        # the installed `dtrain` command imports your modules (model: {_target_: mymodels.MLP}) from the working
        # directory, as `python -m dtrain` does
        sys.path.insert(0, os.getcwd())
    flags, overrides = split_arguments(sys.argv[1:])  # flags ahead (flags_before_overrides)
    argv = sys.argv[1:] = flags + replacing_overrides(overrides)
    try:
        answer = quick_answer(argv)  # dtrain's own --help (Hydra's stays at --hydra-help), --help TOPIC and --version
    except UnknownTopic as error:
        exit_bad_input(str(error))
    if answer is not None:
        print(answer, end="")
        sys.exit(0)
    register_schemas()
    problem = check_recipe_argument(argv) or check_overrides(argv, compose=False) or check_sweep_arguments(argv)
    if problem:
        exit_bad_input(problem)
    if any(argument in ("-m", "--multirun") for argument in argv):
        sys.exit(run_sweep(argv))
    run_single(argv)


if __name__ == "__main__":
    main()


#: what other modules and tests import from here: the entry, and names that moved to dtrain.build and
#: dtrain.failures (re-exported so that ``from dtrain.cli import save_config`` keeps working)
__all__ = ["EXIT_BAD_INPUT", "EXIT_PREEMPTED", "UserError", "check_model_outputs", "config_dir", "continue_command",
           "describe_failure", "exit_preempted", "main", "run", "save_config"]
