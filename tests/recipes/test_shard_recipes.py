"""The character language model from shards on the command line (docs/examples/char_shards): Parquet and tar
shards written by the example train the recipe's model; a data directory without shards, a column the model
names and the shards lack, and a damaged shard are refused in one line, exit 2, nothing written."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.cli import run_dtrain

pytest.importorskip("pyarrow")
pytest.importorskip("webdataset")

WRITER = Path(__file__).resolve().parents[2] / "docs" / "examples" / "char_shards" / "write_shards.py"
SHORT = ["session.max_samples=4096", "session.progress_frequency=2048", "session.cv.frequency=null",
         "session.minibatch_size=1024", "model.context_length=32", "session.tensorboard=false"]


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("char_shards")
    subprocess.run([sys.executable, WRITER, out, "--shards", "3", "--context-length", "32"], check=True,
                   capture_output=True, cwd=WRITER.parents[3])
    return out


@pytest.mark.parametrize("kind", ["parquet", "tar"])
def test_the_language_model_trains_from_shards_written_by_the_example(kind, shards, tmp_path):
    result = run_dtrain("+recipe=shakespeare_char", f"source=char_{kind}", f"source.data_dir={shards / kind}",
                        f"run_dir={tmp_path / 'run'}", *SHORT, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "samples are steps of text[1:]" in result.stdout, result.stdout
    assert "(33,255 sequences, 1,064,160 samples per sweep)" in result.stdout, result.stdout
    window = "4,031 sequences (about 16 of 132 chunks)" if kind == "parquet" else "33,255 sequences (about 3 of 3 chunks)"
    assert f"dtrain: shards read in randomization windows of {window}" in result.stdout, result.stdout
    assert "finished: 4," in result.stdout and (tmp_path / "run" / "model.safetensors").is_file()


def test_shards_that_are_missing_lack_a_column_or_are_damaged_are_one_line(shards, tmp_path):
    refused = run_dtrain("+recipe=shakespeare_char", "source=char_parquet", f"source.data_dir={tmp_path / 'none'}",
                         f"run_dir={tmp_path / 'run'}", *SHORT, cwd=tmp_path)
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines()[-1].endswith(
        f": ParquetShards: shard {tmp_path / 'none' / 'train'} does not exist; expected a file, a directory or a "
        f"glob pattern"), refused.stderr
    assert not (tmp_path / "run").exists()

    refused = run_dtrain("+recipe=shakespeare_char", "source=char_parquet", f"source.data_dir={shards / 'parquet'}",
                         "source.train.deserializer.columns=[tokens]", f"run_dir={tmp_path / 'run'}", *SHORT,
                         cwd=tmp_path)
    assert refused.returncode == 2
    assert f"has no column 'tokens'; it has text" in refused.stderr.strip().splitlines()[-1], refused.stderr
    assert not (tmp_path / "run").exists()

    refused = run_dtrain("+recipe=shakespeare_char", "source=char_parquet", f"source.data_dir={shards / 'parquet'}",
                         "session.target=labels", f"run_dir={tmp_path / 'run'}", *SHORT, cwd=tmp_path)
    assert refused.returncode == 2
    assert "labels" in refused.stderr.strip().splitlines()[-1] and "text" in refused.stderr.strip().splitlines()[-1], \
        refused.stderr
    assert not (tmp_path / "run").exists()

    damaged = tmp_path / "damaged"
    (damaged / "train").mkdir(parents=True)
    for shard in sorted((shards / "tar" / "train").glob("*.tar")):
        (damaged / "train" / shard.name).write_bytes(shard.read_bytes()[:-5000])
    refused = run_dtrain("+recipe=shakespeare_char", "source=char_tar", f"source.data_dir={damaged}",
                         f"run_dir={tmp_path / 'run'}", *SHORT, cwd=tmp_path)
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines()[-1].split(": ", 3)[-1].startswith(
        f"TarShards: shard {damaged / 'train' / 'shard-00000.tar'} is not a readable tar file "
        f"(truncated or damaged"), refused.stderr
    assert not (tmp_path / "run").exists()
