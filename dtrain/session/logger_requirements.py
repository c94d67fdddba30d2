"""What a logger needs before its run starts, checked when the session is built: its client package installed and
a directory it can write (``docs/callbacks-and-loggers.md#loggers``)."""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path


def require_package(logger, package: str, extra: str) -> None:
    """Refuses ``logger`` when its client ``package`` is not installed, naming the pip ``extra`` that installs it.

    Raises:
        ValueError: one line: ``<Logger> needs the <package> package: pip install 'dtrain[<extra>]' ...``.
    """
    if not package_installed(package):
        raise ValueError(f"{type(logger).__name__} needs the {package} package: pip install 'dtrain[{extra}]' "
                         f"(or leave logger={extra} out)")


def package_installed(name: str) -> bool:
    """Whether ``name`` imports as an installed package (a directory of that name in the working directory, such
    as W&B's own ``./wandb``, is not one)."""
    spec = importlib.util.find_spec(name)
    return spec is not None and spec.origin is not None


def check_writable_directory(path: Path, what: str) -> None:
    """Refuses a directory the logger could not create or write: ``path`` or its nearest existing parent is not a
    directory, or not writable by this user. Nothing is created.

    Raises:
        ValueError: one line naming ``what`` and ``path``.
    """
    path = Path(path).absolute()
    existing = path
    while not os.path.lexists(existing) and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ValueError(f"{what}: {path} cannot be a directory ({existing} is a file); expected a writable directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"{what}: {path} is not writable ({existing} is not writable by this user); expected a "
                         f"writable directory")
