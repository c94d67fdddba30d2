"""``learner.shard=true`` on the two-level block learners, from the command line under a real mpiexec, on 2 simulated
hosts of 2 ranks (``comm.ranks_per_host=2``): each host's model sharded over its ranks (FSDP2), the outer scheme on
each rank's slice.

- the update of the unsharded two-level learner (DiLoCo's outer Nesterov step, block momentum's filter), BatchNorm
  statistics included, with half the bytes per rank per sync; gradient clipping by the host's whole norm;
- the sharded checkpoint resumed bit for bit on the same layout, and on another (2 hosts of 3 ranks) where it
  ends as the unsharded learner resumed there does;
- a lossy exchange (4 bits with error feedback) on the slices trains, each rank's residual in the sharded files
  and resumed bit for bit;
- the weight EMA kept on the slices: model_ema.safetensors as the unsharded learner's, resumed with the checkpoint;
- an unsharded checkpoint continued with shard=true as it continues without; refusals in one line: a sharded
  checkpoint restored without shards, a wrap policy that matches nothing.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.mpi import run_mpi

#: digits with BatchNorm, blocks of 3 global minibatches after a warm start of 24: 1,920 samples end a block
COMMON = ["-m", "dtrain", "+recipe=digits", "model.batch_norm=true", "learner.wrap=children",
          "learner.block_size=96", "learner.distributed_after=768", "session.progress_frequency=960",
          "session.tensorboard=false"]
HOSTS = ["comm.ranks_per_host=2"]
#: the weight EMA of the DiLoCo runs (a horizon of 10 optimizer steps: tested at 3,000 samples)
EMA = ["session.ema_decay=0.9"]

pytestmark = pytest.mark.timeout(600)


def run(run_dir: Path, *overrides: str, ranks: int = 4, check: bool = True):
    result = run_mpi(ranks, [*COMMON, *overrides, f"run_dir={run_dir}"], timeout=300)
    if check:
        assert result.returncode == 0, result.report()
    return result


def weights(run_dir: Path, file: str = "model.safetensors") -> dict[str, torch.Tensor]:
    return load_file(run_dir / file)


def largest_relative_difference(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    assert got.keys() == expected.keys()
    return max(float((got[name].double() - tensor.double()).abs().max() / tensor.double().abs().max().clamp_min(1e-12))
               for name, tensor in expected.items() if tensor.is_floating_point() and tensor.numel())


def bytes_per_sync(run_dir: Path) -> int:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return max(record.get("bytes_sent_per_step") or 0 for record in records if record["kind"] == "train")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """DiLoCo with a weight EMA, sharded and not, to 3,000 samples; the sharded one also stopped at 1,920 and resumed
    to 3,000."""
    root = tmp_path_factory.mktemp("two_level_shards")
    made = {}
    for shard in ("true", "false"):
        made["two_level_diloco", shard] = root / f"two_level_diloco-{shard}"
        run(made["two_level_diloco", shard], "learner=two_level_diloco", f"learner.shard={shard}", *HOSTS, *EMA,
            "session.max_samples=3000")
    resumed = made["resumed"] = root / "resumed"
    run(resumed, "learner=two_level_diloco", "learner.shard=true", *HOSTS, *EMA, "session.max_samples=1920")
    made["stopped"] = root / "stopped"
    shutil.copytree(resumed, made["stopped"])
    result = run(resumed, "learner=two_level_diloco", "learner.shard=true", *HOSTS, *EMA, "session.max_samples=3000")
    assert "restored" in result.stdout and "at 1920 samples" in result.stdout, result.stdout
    return made


def same_update(sharded: Path, unsharded: Path) -> None:
    assert largest_relative_difference(weights(sharded), weights(unsharded)) < 1e-5
    assert any("running_mean" in name for name in weights(sharded))  # BatchNorm statistics compared too
    # each rank sends its slice's delta: half of the leader's whole delta (plus the exact BatchNorm statistics)
    assert bytes_per_sync(sharded) < 0.55 * bytes_per_sync(unsharded)


def test_sharded_hosts_make_the_update_of_the_unsharded_two_level_learner(runs):
    same_update(runs["two_level_diloco", "true"], runs["two_level_diloco", "false"])


def test_the_weight_ema_on_the_slices_is_the_unsharded_learners(runs):
    """Each rank averages its slices at every sync (decay^k for the block's k steps): the gathered
    model_ema.safetensors equals the unsharded learner's, and it was tested (not the final weights again)."""
    sharded, unsharded = runs["two_level_diloco", "true"], runs["two_level_diloco", "false"]
    average = weights(sharded, "model_ema.safetensors")
    assert largest_relative_difference(average, weights(unsharded, "model_ema.safetensors")) < 1e-5
    assert largest_relative_difference(average, weights(sharded)) > 1e-3  # an average, not the last weights
    tests = {}
    for run_dir in (sharded, unsharded):
        for line in (run_dir / "metrics.jsonl").read_text().splitlines():
            record = json.loads(line)
            if record["kind"] in ("test", "test_ema"):
                tests[run_dir, record["kind"]] = record["loss"]
    assert abs(tests[sharded, "test_ema"] - tests[unsharded, "test_ema"]) < 1e-4, tests
    assert tests[sharded, "test_ema"] != tests[sharded, "test"], tests


def test_clipping_reads_the_sharded_gradients_and_clips_by_the_hosts_whole_norm(tmp_path):
    """``session.clip_grad_norm`` on sharded hosts clips each host's gradient by its whole norm (a collective over
    the host's shards), as the unsharded learner clips its host's all-reduced gradient. SGD with momentum over 60
    steps: clipping makes the sums round otherwise step by step, and Adam would carry that further."""
    for shard in ("true", "false"):
        result = run(tmp_path / shard, "learner=two_level_diloco", "optimizer=sgd", f"learner.shard={shard}", *HOSTS,
                     "session.clip_grad_norm=0.5", "session.max_samples=1920")
        assert "gradient clipped to global L2 norm 0.5" in result.stdout, result.stdout
    # with the clipping skipped on the sharded side (as it once was) the two ended 7.5 (relative) apart
    assert largest_relative_difference(weights(tmp_path / "true"), weights(tmp_path / "false")) < 1e-4


@pytest.mark.slow
def test_block_momentum_on_sharded_hosts_makes_the_unsharded_update(tmp_path):
    """BMUF's filter (its outer state ``sg`` on the slices) as DiLoCo's momentum is above."""
    for shard in ("true", "false"):
        run(tmp_path / shard, "learner=two_level_block_momentum", f"learner.shard={shard}", *HOSTS,
            "session.max_samples=3000")
    same_update(tmp_path / "true", tmp_path / "false")


def test_the_sharded_checkpoint_resumes_bit_for_bit(runs):
    stopped = runs["stopped"] / "checkpoint-1920.pt"
    assert stopped.is_dir() and (stopped / ".metadata").exists()  # sharded: DCP's files, one per writing rank
    assert len(list(stopped.glob("*.distcp"))) == 4
    for file in ("model.safetensors", "model_ema.safetensors"):  # the weight EMA's slices resumed too
        got, expected = weights(runs["resumed"], file), weights(runs["two_level_diloco", "true"], file)
        assert all(torch.equal(got[name], expected[name]) for name in expected), file


@pytest.mark.slow
def test_the_sharded_checkpoint_resumes_on_another_layout_as_the_unsharded_one_does(runs, tmp_path):
    """4 ranks (2 hosts of 2) to 6 (2 hosts of 3): DCP re-cuts the model, W_prev and the outer momentum; every host
    continues from host 0's inner optimizer state, as the unsharded learner does on another layout."""
    sharded, unsharded = tmp_path / "sharded", tmp_path / "unsharded"
    shutil.copytree(runs["stopped"], sharded)
    run(unsharded, "learner=two_level_diloco", "learner.shard=false", *HOSTS, *EMA, "session.max_samples=1920")
    for run_dir, shard in ((sharded, "true"), (unsharded, "false")):
        result = run(run_dir, "learner=two_level_diloco", f"learner.shard={shard}", "comm.ranks_per_host=3", *EMA,
                     "session.max_samples=2208", ranks=6)
        assert "at 1920 samples" in result.stdout, result.stdout
        assert ("sharded over its 3 ranks" in result.stdout) == (shard == "true"), result.stdout
    for file in ("model.safetensors", "model_ema.safetensors"):  # the weight EMA re-cut as the model is
        assert largest_relative_difference(weights(sharded, file), weights(unsharded, file)) < 1e-5, file


@pytest.mark.slow
def test_a_lossy_exchange_on_the_slices_trains_and_its_residuals_resume_bit_for_bit(tmp_path):
    """4 bits with error feedback: every rank's residual (of its slice) is written by that rank into the sharded
    files, not gathered by rank 0, and read back by the same rank: the resumed run ends exactly where the
    uninterrupted one does."""
    import torch.distributed.checkpoint as dcp

    lossy = ["learner=two_level_diloco", "learner.shard=true", *HOSTS, "learner/exchange=quantized",
             "learner.exchange.num_bits=4"]
    result = run(tmp_path / "whole", *lossy, "session.max_samples=2400")
    assert "sharded over its 2 ranks" in result.stdout, result.stdout
    test = [json.loads(line) for line in (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()
            if json.loads(line)["kind"] == "test"]
    assert test[-1]["accuracy"] > 0.7, test
    run(tmp_path / "resumed", *lossy, "session.max_samples=1920")
    metadata = dcp.FileSystemReader(str(tmp_path / "resumed" / "checkpoint-1920.pt")).read_metadata()
    residuals = {key: entry.size for key, entry in metadata.state_dict_metadata.items()
                 if key.startswith("rank") and "residual" in key}
    assert {key.split(".")[0] for key in residuals} == {"rank0", "rank1", "rank2", "rank3"}, residuals
    parameters = sum(tensor.numel() for name, tensor in weights(tmp_path / "whole").items()
                     if tensor.is_floating_point() and "running" not in name)
    assert all(size.numel() < 0.6 * parameters for size in residuals.values()), (residuals, parameters)  # a slice
    run(tmp_path / "resumed", *lossy, "session.max_samples=2400")
    got, expected = weights(tmp_path / "resumed"), weights(tmp_path / "whole")
    assert all(torch.equal(got[name], expected[name]) for name in expected)


def refusal(result) -> str:
    """The one line a refused run printed on stderr (exit 2)."""
    assert result.returncode == 2, result.report()
    lines = [line for line in result.stderr.splitlines() if "dtrain: error" in line]
    assert lines, result.stderr
    return lines[0]


def test_a_sharded_checkpoint_restored_without_shards_is_refused_in_one_line(runs, tmp_path):
    sharded = tmp_path / "sharded"
    shutil.copytree(runs["stopped"], sharded)
    line = refusal(run(sharded, "learner=two_level_diloco", "learner.shard=false", *HOSTS,
                       "session.max_samples=3000", check=False))
    assert "holds hosts sharded over their ranks (learner.shard=true)" in line and "learner.shard=true" in line, line
    assert len(list(sharded.glob("checkpoint-*"))) == 1 and not (sharded / "checkpoint-3000.pt").exists()


@pytest.mark.slow
def test_an_unsharded_checkpoint_continues_with_shards_as_it_continues_without(runs, tmp_path):
    """``learner.shard`` turned on for a run that has a checkpoint: ``W_prev``, the outer momentum and each rank's
    inner optimizer state are cut into its slices, the weight EMA into its shards, and the run ends where the same
    run continued unsharded does (to the sharded learner's own agreement, 1e-5)."""
    ends, said = {}, {}
    for shard in ("true", "false"):
        ends[shard] = tmp_path / shard
        shutil.copytree(runs["two_level_diloco", "false"], ends[shard])
        said[shard] = run(ends[shard], "learner=two_level_diloco", f"learner.shard={shard}", *HOSTS, *EMA,
                          "session.max_samples=3300").stdout
        assert "restored" in said[shard] and "at 3000 samples" in said[shard], said[shard]
    assert "are cut into each rank's slices" in said["true"], said["true"]
    assert "learner.shard: False -> True" in said["true"], said["true"]
    for file in ("model.safetensors", "model_ema.safetensors"):
        assert largest_relative_difference(weights(ends["true"], file), weights(ends["false"], file)) < 1e-5, file
    assert (ends["true"] / "checkpoint-3300.pt" / ".metadata").exists()  # it writes sharded checkpoints from there


@pytest.mark.parametrize("overrides, expected", [
    (("learner.wrap=[Transformer]",), "learner.wrap=[Transformer] matches no module"),
])
def test_what_sharded_hosts_cannot_do_is_refused_in_one_line(tmp_path, overrides, expected):
    line = refusal(run(tmp_path / "run", "learner=two_level_diloco", "learner.shard=true", *HOSTS,
                       "session.max_samples=3000", *overrides, check=False))
    assert expected in line, line
    assert not (tmp_path / "run" / "checkpoint-3000.pt").exists()
