"""``logger=wandb``: the run in Weights & Biases (``pip install 'dtrain[wandb]'``; ``docs/callbacks-and-loggers.md#loggers``)."""
from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from dtrain.session.logger_requirements import check_writable_directory
from dtrain.loggers.tracking import (FAILED, PREEMPTED, TrackingLogger, recipe_name,
                                     run_name, sweep_dir)
from dtrain.session.callbacks import RunView

#: the modes a run may use: online (to the W&B server), offline (files to upload with ``wandb sync``), disabled
MODES = ("online", "offline", "disabled")

#: the exit code W&B records for a preempted run (dtrain's, ``dtrain.failures.EXIT_PREEMPTED``)
_PREEMPTED_EXIT_CODE = 75


class WandbLogger(TrackingLogger):
    """Logs the run to W&B: its config, the records of ``metrics.jsonl`` at their global sample count, and its
    outputs as a ``model`` artifact; a resumed run continues the same W&B run (its id in ``run_dir/wandb_run_id``).

    Args:
        mode: ``online``, ``offline`` or ``disabled``; ``None``: the ``WANDB_MODE`` environment variable, else
            ``online`` (an online run without W&B credentials is refused before training).
        project: the W&B project (default: the recipe's name).
        entity: the W&B user or team (default: your default entity).
        group: the run's group (default: in a sweep, the sweep's directory; else none).
        tags: the run's tags.
        name: the run's display name (default: the run directory's name; a sweep job: ``<sweep>/<job>``).
        dir: where W&B writes its files (``<dir>/wandb``; default: the run directory).
        settings: more ``wandb.Settings`` (default ``console: off``, ``silent: true``: dtrain's output is not
            copied, and the run's one line is dtrain's).

    Raises:
        ValueError: the wandb package is not installed, or ``mode`` is not one of :data:`MODES`.
    """

    package = "wandb"
    extra = "wandb"
    id_file = "wandb_run_id"
    tracker = "W&B"

    def __init__(self, mode: str | None = None, project: str | None = None, entity: str | None = None,
                 group: str | None = None, tags: Sequence[str] = (), name: str | None = None,
                 dir: str | Path | None = None, settings: dict | None = None):  # noqa: A002 - wandb.init's name
        super().__init__()
        mode = mode if mode is not None else os.environ.get("WANDB_MODE") or "online"
        if mode not in MODES:
            raise ValueError(f"WandbLogger mode={mode!r}: expected one of {', '.join(MODES)}")
        self.mode, self.project, self.entity, self.group = mode, project, entity, group
        self.tags, self.name, self.dir = list(tags or ()), name, Path(dir) if dir is not None else None
        self.settings = {"console": "off", "silent": True, **dict(settings or {})}
        self._run = None

    def _dir(self, run: RunView) -> Path:
        return self.dir if self.dir is not None else run.run_dir

    def check(self, run: RunView) -> None:
        super().check(run)
        if self.mode == "disabled":
            return
        # W&B writes below <dir>/wandb: a file or a read-only directory there fails wandb.init after the run's first
        # writes, so it is refused here, before any
        check_writable_directory(self._dir(run) / "wandb", "WandbLogger dir")
        if self.mode == "online" and not _has_credentials():
            raise ValueError("WandbLogger mode=online: no W&B credentials (run `wandb login` or set WANDB_API_KEY); "
                             "or use mode=offline and upload later with `wandb sync`")

    def _start(self, run: RunView, resume_id: str | None) -> str:
        import wandb

        directory = self._dir(run)
        directory.mkdir(parents=True, exist_ok=True)
        sweep = sweep_dir()
        self._run = wandb.init(
            mode=self.mode, project=self.project or recipe_name(run), entity=self.entity,
            group=self.group or (_group_name(sweep) if sweep is not None else None), tags=self.tags or None,
            name=self.name or run_name(run), dir=str(directory), id=resume_id,
            resume="allow", config=run.config or {}, allow_val_change=True, reinit="create_new",
            settings=wandb.Settings(**self.settings))
        where = {"offline": f"offline; upload with: wandb sync {Path(self._run.dir).parent}",
                 "online": self._run.url}.get(self.mode, self.mode)
        run.line(f"dtrain: W&B run {self._run.id} {'continued' if resume_id else 'started'} ({where})")
        return self._run.id

    def _log(self, values: dict[str, float], step: int, timestamp: float) -> None:
        self._run.log(values, step=step)

    def _log_files(self, paths: list[Path]) -> None:
        if not paths:
            return
        import wandb

        artifact = wandb.Artifact(f"{self._run.id}-outputs", type="model",
                                  description="dtrain run outputs: report.png, model.safetensors, best.safetensors")
        for path in paths:
            # immutable: no copy of the weights; dtrain replaces its outputs only by renaming a new file over them
            artifact.add_file(str(path), name=path.name, policy="immutable")
        self._run.log_artifact(artifact)

    def _end(self, status: str) -> None:
        import wandb

        run, self._run = self._run, None
        if status == PREEMPTED:
            run.mark_preempting()
            run.finish(exit_code=_PREEMPTED_EXIT_CODE)
        else:
            run.finish(exit_code=1 if status == FAILED else 0)
        # finish() returns before W&B's service has written everything down; its teardown waits for that, so the
        # run's files are complete here, also when the process then ends with os._exit (a preemption's exit 75);
        # a run of the user's own in this process keeps the service
        if wandb.run is None:
            wandb.teardown()


def _group_name(sweep: Path) -> str:
    """A sweep's group: its directory, relative to the working directory when below it (W&B allows 128 characters)."""
    try:
        name = str(sweep.relative_to(Path.cwd()))
    except ValueError:
        name = str(sweep)
    return name[-128:]


def _has_credentials() -> bool:
    """Whether wandb will find credentials without asking: the environment or the netrc file ``wandb login`` writes
    (a client that keeps them elsewhere is trusted: ``wandb.init`` then asks or fails itself)."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    try:
        from wandb.sdk.lib.wbauth.wbnetrc import read_netrc_auth
    except ImportError:
        return True
    try:
        return read_netrc_auth(host=os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai") is not None
    except Exception:  # noqa: BLE001 - an unreadable netrc: wandb.init reports it with its own words
        return True
