"""CNTK ImageDeserializer map files: one image per line, ``path<TAB>label`` or ``seqId<TAB>path<TAB>label``.

Format (``docs/semantics.md#data-formats``, CNTK ``articles/BrainScript-Image-reader.md``):
  * the label is a 0-based class index (a non-negative integer);
  * a relative path is resolved against the map file's directory, and a leading ``...``
    expands to that directory (CNTK's spelling of "next to the map file");
  * blank lines are skipped; the optional sequence id is checked to be a non-negative integer and
    kept as the image's key (``MapFile.sequence_keys``), by which a ``CompositeDeserializer`` joins
    it to other files (a line without one has its 0-based image index as key, as CNTK keys it by
    line); samples are read in line order.
CNTK's ``archive.zip@/inner.jpg`` paths are refused with a message saying to extract the archive.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dtrain.data._checks import check_bool
from dtrain.data.errors import DataError

__all__ = ["MapFile", "read_map_file"]

# At most this many missing files are named in the error (the count says how many in all).
_MISSING_SHOWN = 3


@dataclass(frozen=True)
class MapFile:
    """A parsed map file.

    Attributes:
        path: the map file itself.
        image_paths: absolute image paths, one per sample, in line order.
        labels: int64 ``[num_samples]`` 0-based class indices.
        line_numbers: int64 ``[num_samples]`` 1-based map-file line of each sample (for errors).
        sequence_keys: int64 ``[num_samples]`` key of each sample: its ``seqId`` column, or its 0-based
            index in the file where the line has none (None: every sample's index).
    """

    path: Path
    image_paths: tuple[str, ...]
    labels: np.ndarray
    line_numbers: np.ndarray
    sequence_keys: np.ndarray | None = None

    @property
    def num_samples(self) -> int:
        """Number of images listed."""
        return len(self.image_paths)

    def where(self, index: int) -> str:
        """``"train_map.txt:17"``: the file and line of sample ``index``, for error messages."""
        return f"{self.path}:{int(self.line_numbers[index])}"


def _resolve(image_path: str, directory: Path) -> str:
    if image_path.startswith("..."):
        image_path = str(directory) + image_path[3:]
    path = Path(image_path).expanduser()
    if not path.is_absolute():
        path = directory / path
    return os.path.normpath(path)


def read_map_file(path: str | os.PathLike, check_files: bool = True) -> MapFile:
    """Parse a CNTK image map file.

    Args:
        path: the map file (e.g. ``train_map.txt``).
        check_files: check once, with ``os.path.exists``, that every listed image exists
            (about a second per million local files); without it a missing image is reported
            when it is first read.

    Returns:
        The parsed ``MapFile``.

    Raises:
        TypeError: ``path`` is not a path.
        DataError: the map file is missing or empty, a line is not ``path<TAB>label`` or
            ``seqId<TAB>path<TAB>label``, a label is not a non-negative integer, a path is a zip
            reference, or (``check_files``) an image file does not exist. The message names the
            file and line.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"map file must be a path (str or os.PathLike), got {type(path).__name__}")
    check_files = check_bool("check_files", check_files)
    map_path = Path(path).expanduser()
    try:
        text = map_path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DataError(f"map file {map_path} not found; expected lines 'path<TAB>label'") from None
    except (OSError, UnicodeDecodeError) as error:
        raise DataError(f"map file {map_path} could not be read ({error}); expected UTF-8 text") from error
    directory = map_path.resolve().parent
    image_paths: list[str] = []
    labels: list[int] = []
    line_numbers: list[int] = []
    keys: list[int] = []
    for line_number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        fields = line.rstrip("\r").split("\t")
        where = f"{map_path}:{line_number}"
        if len(fields) == 3:
            sequence_id, image_path, label_text = fields
            if not sequence_id.strip().isdigit():
                raise DataError(f"{where}: sequence id {sequence_id!r} is not a non-negative integer; "
                                f"expected 'seqId<TAB>path<TAB>label'")
            keys.append(int(sequence_id))
        elif len(fields) == 2:
            image_path, label_text = fields
            keys.append(len(image_paths))
        else:
            raise DataError(f"{where}: expected 'path<TAB>label' or 'seqId<TAB>path<TAB>label' "
                            f"(tab-separated), got {line!r}")
        image_path = image_path.strip()
        label_text = label_text.strip()
        if not image_path:
            raise DataError(f"{where}: empty image path; expected 'path<TAB>label'")
        if "@" in image_path and ".zip@" in image_path.lower():
            raise DataError(f"{where}: zip references ({image_path!r}) are not supported; "
                            f"extract the archive and list the image files")
        if not label_text.isdigit():
            raise DataError(f"{where}: label {label_text!r} is not a non-negative integer; "
                            f"expected a 0-based class index")
        image_paths.append(_resolve(image_path, directory))
        labels.append(int(label_text))
        line_numbers.append(line_number)
    if not image_paths:
        raise DataError(f"map file {map_path} lists no images; expected lines 'path<TAB>label'")
    if check_files:
        missing = [index for index, image in enumerate(image_paths) if not os.path.exists(image)]
        if missing:
            shown = ", ".join(f"{image_paths[i]} (line {line_numbers[i]})" for i in missing[:_MISSING_SHOWN])
            raise DataError(f"map file {map_path}: {len(missing)} image file(s) not found: {shown}"
                            f"{', ...' if len(missing) > _MISSING_SHOWN else ''}; fix the paths "
                            f"(relative paths are resolved against {directory})")
    return MapFile(
        path=map_path,
        image_paths=tuple(image_paths),
        labels=np.asarray(labels, dtype=np.int64),
        line_numbers=np.asarray(line_numbers, dtype=np.int64),
        sequence_keys=np.asarray(keys, dtype=np.int64),
    )
