"""The one exception type the data layer raises for bad data files and paths."""

from __future__ import annotations

__all__ = ["DataError"]


class DataError(ValueError):
    """A data set is missing, malformed or could not be fetched.

    Subclasses ``ValueError`` so callers that validate configuration can catch both alike.
    The message is always one line that names the file or directory and what was expected.
    """
