"""The files a run writes into its run directory: never through a planted link, the umask's
permissions for every one, a damaged metrics log set aside, a full disk named in one line."""
from __future__ import annotations

import csv
import errno
import io
import json
import os
from pathlib import Path

import pytest
import torch
from torch import nn

from dtrain import CheckpointConfig, LocalLearner, MinibatchSource, training_session
from dtrain.callbacks import BestCheckpoint
from dtrain.data import DataError
from dtrain.loggers import CsvLogger, TensorBoardLogger
from dtrain.session.checkpoint import CheckpointError
from dtrain.session.metrics import MetricsWriteError, MetricsWriter

from tests.helpers.toy_data import four_class_data


def tiny_session(run_dir: Path, max_samples: int = 64, **options):
    """A few minibatches of the toy data with checkpoints, test-free, printing into a string."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 4))
    return training_session(model, nn.functional.cross_entropy, LocalLearner(torch.optim.SGD(model.parameters(), lr=0.1)),
                            MinibatchSource(four_class_data(), randomization_seed=3), 16, max_samples=max_samples,
                            progress_frequency=32, checkpoint_config=CheckpointConfig("checkpoint.pt", frequency=64),
                            run_dir=run_dir, tensorboard=False, stream=io.StringIO(), **options)


def plant_link(run_dir: Path, name: str, victim: Path) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / name).unlink(missing_ok=True)
    (run_dir / name).symlink_to(victim)


@pytest.mark.parametrize("name, error", [(".lock", CheckpointError), ("metrics.jsonl", ValueError)])
def test_a_link_planted_where_dtrain_appends_or_locks_is_refused_in_one_line(tmp_path, name, error):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    plant_link(tmp_path / "run", name, victim)
    with pytest.raises(error) as caught:
        tiny_session(tmp_path / "run").train()
    message = str(caught.value)
    assert "\n" not in message and f"{tmp_path / 'run' / name} is a symbolic link (to {victim})" in message
    assert victim.read_text() == "precious\n"
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [name]  # nothing else written


def test_links_planted_at_names_dtrain_replaces_are_replaced_never_written_through(tmp_path):
    run = tmp_path / "run"
    # final names and the temporary names earlier versions wrote first
    names = ["metrics.csv", "model.safetensors", "report.png", ".metrics.csv.tmp", ".model.safetensors.tmp",
             ".report.png.tmp"]
    victims = {name: tmp_path / f"victim-{name.strip('.')}" for name in names}
    for name, victim in victims.items():
        victim.write_text("precious\n")
        plant_link(run, name, victim)
    tiny_session(run).train()
    assert all(victim.read_text() == "precious\n" for victim in victims.values())
    for name in ("metrics.csv", "model.safetensors", "report.png"):
        assert not (run / name).is_symlink() and (run / name).stat().st_size > 10, name


def test_the_config_is_written_as_a_new_file_beside_a_link_never_through_it(tmp_path):
    from omegaconf import OmegaConf

    from dtrain.cli import save_config

    victim = tmp_path / "victim.yaml"  # does not exist: a dangling link would create it
    plant_link(tmp_path / "run", "config.yaml", victim)
    assert save_config(OmegaConf.create({"seed": 0}), tmp_path / "run") == tmp_path / "run" / "config.1.yaml"
    assert not victim.exists() and (tmp_path / "run" / "config.1.yaml").read_text() == "seed: 0\n"


def test_every_output_file_gets_the_umask_permissions(tmp_path):
    old = os.umask(0o002)
    try:
        tiny_session(tmp_path).train()
    finally:
        os.umask(old)
    for name in ("model.safetensors", "report.png", "metrics.csv", "metrics.jsonl", "checkpoint-64.pt"):
        assert (tmp_path / name).stat().st_mode & 0o777 == 0o664, name


def test_a_damaged_metrics_log_is_set_aside_with_one_warning_and_the_run_resumes(tmp_path):
    tiny_session(tmp_path, 64).train()
    jsonl = tmp_path / "metrics.jsonl"
    damaged = jsonl.read_bytes() + b'{"kind": "train", "samples": \xbe\xff}\n' + b"[1, 2]\n"
    jsonl.write_bytes(damaged)
    session = tiny_session(tmp_path, 128)
    with pytest.warns(RuntimeWarning) as caught:
        result = session.train()
    assert result.restored_from == tmp_path / "checkpoint-64.pt" and result.samples_seen == 128
    [warning] = [str(w.message) for w in caught if "damaged" in str(w.message)]
    [aside] = list(tmp_path.glob("metrics.jsonl.damaged-*"))
    assert warning == (f"{jsonl} is damaged (line 3 is not UTF-8 text, and 1 more line); moved it aside to "
                       f"{aside.name} and continuing with a fresh metrics.jsonl holding its 2 readable records")
    assert aside.read_bytes() == damaged  # kept as it was
    records = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert [r["samples"] for r in records if r["kind"] == "train"] == [32, 64, 96, 128]
    with open(tmp_path / "metrics.csv", newline="") as table:
        assert [int(row["samples"]) for row in csv.DictReader(table)] == [32, 64, 96, 128]


def test_a_full_disk_while_rewriting_metrics_csv_names_it_and_leaves_no_temporary(tmp_path, monkeypatch):
    first = MetricsWriter(tmp_path, tensorboard=False)
    first.write("train", 16, loss=1.0, error=0.5)
    first.close()
    before = (tmp_path / "metrics.csv").read_bytes()

    def full_disk(self, rows):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(csv.DictWriter, "writerows", full_disk)
    writer = MetricsWriter(tmp_path, tensorboard=False)
    with pytest.raises(MetricsWriteError) as caught:
        writer.write("train", 32, loss=0.5, error=0.25)
    writer.close()
    assert str(caught.value) == (f"{tmp_path / 'metrics.csv'} could not be written (No space left on device); "
                                 f"metrics.jsonl has every record so far")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.csv", "metrics.jsonl"]  # no temporary left
    assert (tmp_path / "metrics.csv").read_bytes() == before


def test_a_failed_checkpoint_write_says_what_is_left_to_fall_back_on(tmp_path, monkeypatch):
    real_replace = os.replace

    def full_disk(source, destination):
        if Path(destination).name.startswith("checkpoint-"):
            raise OSError(errno.ENOSPC, "No space left on device")
        real_replace(source, destination)

    monkeypatch.setattr(os, "replace", full_disk)
    with pytest.raises(CheckpointError) as caught:
        tiny_session(tmp_path, 64).train()
    assert str(caught.value) == (f"checkpoint {tmp_path / 'checkpoint-64.pt'} could not be written (No space left "
                                 f"on device); there is no earlier checkpoint to fall back on")


def test_the_latest_config_is_the_last_one_a_resume_wrote(tmp_path):
    from dtrain.build import config_path, latest_config_path

    assert latest_config_path(tmp_path) == tmp_path / "config.yaml"  # none yet: the first job's name
    for expected in ("config.yaml", "config.1.yaml", "config.2.yaml"):
        written = config_path(tmp_path)
        assert written.name == expected
        written.write_text("{}")
        assert latest_config_path(tmp_path) == written


def test_generate_takes_the_weight_ema_only_when_the_latest_job_kept_one(tmp_path):
    from omegaconf import OmegaConf
    from safetensors.torch import save_model

    from dtrain.generate import load_run

    final, average = nn.Linear(2, 1), nn.Linear(2, 1)
    save_model(final, str(tmp_path / "model.safetensors"))
    save_model(average, str(tmp_path / "model_ema.safetensors"))
    job = {"model": {"_target_": "torch.nn.Linear", "in_features": 2, "out_features": 1},
           "source": {"train": {"deserializer": {"_target_": "builtins.dict"}}}, "session": {"ema_decay": 0.999}}
    OmegaConf.save(OmegaConf.create(job), tmp_path / "config.yaml")

    def loaded(weights):
        model, _, _, which = load_run(tmp_path, weights)
        return model.weight, which

    assert torch.equal(loaded("auto")[0], average.weight) and loaded("auto")[1] == "ema"
    assert torch.equal(loaded("last")[0], final.weight)
    # a resume without the EMA: the first job's model_ema.safetensors is older than model.safetensors
    OmegaConf.save(OmegaConf.create({**job, "session": {"ema_decay": None}}), tmp_path / "config.1.yaml")
    assert torch.equal(loaded("auto")[0], final.weight) and loaded("auto")[1] == "last"
    assert torch.equal(loaded("ema")[0], average.weight)  # asked for by name, it is still there
    with pytest.raises(ValueError, match="weights 'best': expected one of auto, last, ema"):
        load_run(tmp_path, "best")


def test_generate_leaves_a_weight_ema_below_its_horizon_unless_asked_for_it(tmp_path, capsys):
    from omegaconf import OmegaConf
    from safetensors.torch import save_model

    from dtrain.generate import load_run

    final, average = nn.Linear(2, 1), nn.Linear(2, 1)
    save_model(final, str(tmp_path / "model.safetensors"))
    save_model(average, str(tmp_path / "model_ema.safetensors"),
               metadata={"ema_below_horizon": "the weight EMA has taken in 5 optimizer steps, fewer than its horizon"})
    job = {"model": {"_target_": "torch.nn.Linear", "in_features": 2, "out_features": 1},
           "source": {"train": {"deserializer": {"_target_": "builtins.dict"}}}, "session": {"ema_decay": 0.999}}
    OmegaConf.save(OmegaConf.create(job), tmp_path / "config.yaml")
    model, _, _, which = load_run(tmp_path, "auto")
    assert which == "last" and torch.equal(model.weight, final.weight)
    assert "fewer than its horizon, so the final weights are used" in capsys.readouterr().err
    model, _, _, which = load_run(tmp_path, "ema")
    assert which == "ema" and torch.equal(model.weight, average.weight)


class _BadAt(torch.utils.data.Dataset):
    """256 samples of 6 features and 4 classes; ``dataset[bad_at]`` raises, has another shape, or holds NaN."""

    def __init__(self, bad_at: int | None = None, problem: str = "raise"):
        generator = torch.Generator().manual_seed(0)
        self.features = torch.randn(256, 6, generator=generator)
        self.labels = torch.randint(0, 4, (256,), generator=generator)
        self.bad_at, self.problem = bad_at, problem

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        if index == self.bad_at:
            if self.problem == "raise":
                raise OSError("corrupt record")
            if self.problem == "nan":
                return self.features[index] * float("nan"), int(self.labels[index])
            return self.features[index][:3], int(self.labels[index])
        return self.features[index], int(self.labels[index])


def dataset_session(run_dir: Path, dataset: _BadAt, max_samples: int, checkpoint_frequency: int = 64, **options):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 4))
    learner = LocalLearner(torch.optim.SGD(model.parameters(), lr=0.1))
    options = {"tensorboard": False, **options}
    return training_session(model, nn.functional.cross_entropy, learner, MinibatchSource(dataset, randomize=False), 16,
                            max_samples=max_samples, progress_frequency=32,
                            checkpoint_config=CheckpointConfig("checkpoint.pt", frequency=checkpoint_frequency),
                            run_dir=run_dir, stream=io.StringIO(), **options)


@pytest.mark.parametrize("bad_at, problem, message", [
    (137, "raise", r"_BadAt\[137\] raised OSError: corrupt record"),
    (50, "shape", r"stream 'features': _BadAt\[50\] has shape \[3\] but sample 0 has \[6\]"),
    (3, "raise", r"_BadAt\[3\] raised OSError"),  # in the first minibatch: refused before anything is written
    # named as the data's problem, not as a divergence of training
    (137, "nan", r"stream 'features': _BadAt\[137\] \(timeline position 137\) holds NaN; expected finite numbers"),
])
def test_a_run_refused_by_its_data_leaves_no_new_run_directory_behind(tmp_path, bad_at, problem, message):
    run_dir = tmp_path / "outputs" / "run"
    with pytest.raises(DataError, match=message):
        dataset_session(run_dir, _BadAt(bad_at, problem), 256, checkpoint_frequency=1000).train()
    assert list(tmp_path.iterdir()) == []  # the directories the run created are gone, its config and metrics too


def test_a_resumed_run_refused_by_its_data_loses_nothing_that_was_in_its_directory(tmp_path):
    dataset_session(tmp_path, _BadAt(), 64).train()
    (tmp_path / "notes.txt").write_text("the user's own file\n")
    before = {path: path.read_bytes() for path in tmp_path.rglob("*") if path.is_file()}
    with pytest.raises(DataError, match=r"_BadAt\[137\] raised OSError"):
        dataset_session(tmp_path, _BadAt(137), 256, checkpoint_frequency=1000).train()
    after = {path: path.read_bytes() for path in tmp_path.rglob("*") if path.is_file()}
    assert after == before  # byte-identical: its records taken back from the metrics files, nothing added


def test_a_resumed_run_refused_by_its_data_puts_back_its_best_checkpoint_and_record_files_outside_the_run(tmp_path):
    pytest.importorskip("tensorboard")
    run_dir, elsewhere = tmp_path / "run", tmp_path / "elsewhere"

    def callbacks():
        return [BestCheckpoint(monitor="train.loss", mode="max"), CsvLogger(elsewhere / "rows.csv"),
                TensorBoardLogger(elsewhere / "events")]

    dataset_session(run_dir, _BadAt(), 64, callbacks=callbacks(), tensorboard=None).train()
    before = {path: path.read_bytes() for path in tmp_path.rglob("*") if path.is_file()}
    assert run_dir / "best.safetensors" in before and elsewhere / "rows.csv" in before
    with pytest.raises(DataError, match=r"_BadAt\[137\] raised OSError"):
        dataset_session(run_dir, _BadAt(137), 256, checkpoint_frequency=1000, callbacks=callbacks(),
                        tensorboard=None).train()
    after = {path: path.read_bytes() for path in tmp_path.rglob("*") if path.is_file()}
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert after == before and [record["samples"] for record in records] == [32, 64]  # 96 replaced the best (max)


def test_a_run_that_saved_a_checkpoint_before_its_data_failed_keeps_its_directory(tmp_path):
    with pytest.raises(DataError, match=r"_BadAt\[137\]"):
        dataset_session(tmp_path / "run", _BadAt(137), 256, checkpoint_frequency=64).train()
    kept = sorted(path.name for path in (tmp_path / "run").glob("checkpoint-*.pt"))
    assert kept == ["checkpoint-128.pt", "checkpoint-64.pt"]  # to resume from once the data is fixed


def test_a_run_refused_by_its_data_keeps_a_run_directory_that_another_job_started_beside_it(tmp_path):
    """Both jobs' directories lie in outputs/, which the refused one created: the other one's stays."""
    session = dataset_session(tmp_path / "outputs" / "refused", _BadAt(137), 256, checkpoint_frequency=1000)
    session.restore()  # locks (and creates) its run directory, as train() does first
    (tmp_path / "outputs" / "other").mkdir()
    (tmp_path / "outputs" / "other" / "config.yaml").write_text("another job's\n")
    with pytest.raises(DataError, match=r"_BadAt\[137\]"):
        session.train()
    assert [path.relative_to(tmp_path).as_posix() for path in tmp_path.rglob("*")] == \
        ["outputs", "outputs/other", "outputs/other/config.yaml"]


def _linear_run(run_dir: Path, ema: bool) -> None:
    """A run directory as a finished run leaves it, for a ``torch.nn.Linear`` model (with its weight EMA or not)."""
    from omegaconf import OmegaConf
    from safetensors.torch import save_model

    save_model(nn.Linear(2, 1), str(run_dir / "model.safetensors"))
    if ema:
        save_model(nn.Linear(2, 1), str(run_dir / "model_ema.safetensors"))
    job = {"model": {"_target_": "torch.nn.Linear", "in_features": 2, "out_features": 1},
           "source": {"train": {"deserializer": {"_target_": "builtins.dict"}}}, "session": {"ema_decay": None}}
    OmegaConf.save(OmegaConf.create(job), run_dir / "config.yaml")


@pytest.mark.parametrize("ema", [False, True])
def test_generate_offers_the_other_weights_only_where_the_run_has_them(tmp_path, capsys, ema):
    from dtrain.generate import main

    _linear_run(tmp_path, ema)
    assert main([str(tmp_path)]) == 2  # a Linear model samples no text: refused after the weights line
    first = capsys.readouterr().err.splitlines()[0]
    assert first.startswith("dtrain.generate: weights from model.safetensors")
    assert ("--weights ema for model_ema.safetensors" in first) is ema, first


@pytest.mark.parametrize("damage", [
    pytest.param(lambda data: data[:100], id="cut-in-the-header"),
    pytest.param(lambda data: data[:len(data) - 4], id="cut-in-the-data"),
    pytest.param(lambda data: b"\0" * len(data), id="zeroed"),
    pytest.param(lambda data: b"", id="empty"),
])
def test_generate_refuses_damaged_weights_in_one_line(tmp_path, capsys, damage):
    from dtrain.generate import main

    _linear_run(tmp_path, ema=False)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(damage(weights.read_bytes()))
    assert main([str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith(f"dtrain.generate: error: {weights}: not a readable safetensors file"), err


def test_generate_refuses_weights_that_are_not_finite(tmp_path, capsys):
    from safetensors.torch import save_model

    from dtrain.generate import main

    _linear_run(tmp_path, ema=False)
    broken = nn.Linear(2, 1)
    with torch.no_grad():
        broken.bias.fill_(float("nan"))
    save_model(broken, str(tmp_path / "model.safetensors"))
    assert main([str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == (f"dtrain.generate: error: {tmp_path / 'model.safetensors'}: bias holds "
                                               f"NaN or infinity; expected the finite weights of a finished run")


@pytest.mark.parametrize("tool", ["dtrain.generate", "dtrain.noise_scale"])
@pytest.mark.parametrize("content, message", [
    pytest.param(b"model: [unclosed\n  x: : :\n", "not valid YAML (expected ',' or ']', but got ':' at line 2, column 4)",
                 id="broken-yaml"),
    pytest.param(bytes(range(128, 256)), "not a YAML text file", id="binary"),
    pytest.param(b"- a list\n", "has no model._target_, source.train, session", id="a-list"),
    pytest.param(b"seed: 0\nmodel: {}\n", "has no model._target_, source.train, session", id="not-a-run-config"),
])
def test_the_tools_refuse_a_config_that_is_not_a_runs_in_one_line(tmp_path, capsys, tool, content, message):
    import importlib

    _linear_run(tmp_path, ema=False)
    (tmp_path / "config.yaml").write_bytes(content)
    assert importlib.import_module(tool).main([str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert f"error: {tmp_path / 'config.yaml'}: {message}" in err, err
    assert err.endswith("expected the config a dtrain run writes") or "(its model, source and session)" in err, err


def test_generate_refuses_a_config_whose_training_data_has_no_deserializer(tmp_path, capsys):
    from dtrain.generate import main

    _linear_run(tmp_path, ema=False)
    (tmp_path / "config.yaml").write_text("model: {_target_: torch.nn.Identity}\nsource: {train: {x: 1}}\nsession: {}\n")
    assert main([str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == (f"dtrain.generate: error: {tmp_path / 'config.yaml'}: source.train has no "
                                               f"deserializer; expected the config a dtrain run writes")
