"""CNTK map files: both line forms, path resolution, and one-line errors naming file and line."""
from __future__ import annotations

import os

import numpy as np
import pytest

from dtrain.data import DataError, read_map_file


def _touch(path):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x")
    return path


def test_both_forms_blank_lines_relative_and_dots(tmp_path):
    _touch(tmp_path / "a" / "x.jpg")
    _touch(tmp_path / "y.png")
    absolute = _touch(tmp_path / "elsewhere" / "z.jpg")
    map_path = tmp_path / "train_map.txt"
    map_path.write_text(f"a/x.jpg\t2\n\n0\t.../y.png\t0\n{absolute}\t1\n")
    parsed = read_map_file(map_path)
    assert parsed.image_paths == (str(tmp_path / "a" / "x.jpg"), str(tmp_path / "y.png"), str(absolute))
    assert parsed.labels.tolist() == [2, 0, 1] and parsed.labels.dtype == np.int64
    assert parsed.line_numbers.tolist() == [1, 3, 4]
    assert parsed.where(1) == f"{map_path}:3"


@pytest.mark.parametrize("line, fragment", [
    ("just_a_path.jpg", "train_map.txt:2: expected 'path<TAB>label'"),
    ("a\tb\tc\td", "train_map.txt:2: expected 'path<TAB>label'"),
    ("x.jpg\t-1", "train_map.txt:2: label '-1' is not a non-negative integer"),
    ("x.jpg\tcat", "train_map.txt:2: label 'cat'"),
    ("s\tx.jpg\t1", "train_map.txt:2: sequence id 's'"),
    ("arch.zip@/x.jpg\t1", "zip references"),
])
def test_bad_lines_name_file_and_line(tmp_path, line, fragment):
    _touch(tmp_path / "x.jpg")
    (tmp_path / "train_map.txt").write_text(f"x.jpg\t0\n{line}\n")
    with pytest.raises(DataError, match=fragment.replace("|", r"\|")):
        read_map_file(tmp_path / "train_map.txt")


def test_missing_files_are_named_at_parse_time_unless_disabled(tmp_path):
    (tmp_path / "train_map.txt").write_text("gone.jpg\t0\n")
    with pytest.raises(DataError, match=r"1 image file\(s\) not found: .*gone.jpg \(line 1\)"):
        read_map_file(tmp_path / "train_map.txt")
    assert read_map_file(tmp_path / "train_map.txt", check_files=False).num_samples == 1


def test_missing_or_empty_map_file(tmp_path):
    with pytest.raises(DataError, match="not found"):
        read_map_file(tmp_path / "nope.txt")
    (tmp_path / "empty.txt").write_text("\n\n")
    with pytest.raises(DataError, match="lists no images"):
        read_map_file(tmp_path / "empty.txt")
    with pytest.raises(TypeError):
        read_map_file(3)
    assert os.path.exists(tmp_path / "empty.txt")
