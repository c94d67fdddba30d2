"""``learner=fsdp`` under a real mpiexec: 2 ranks by default, 4 ranks (slow).

One launch per world size runs every check of ``_fsdp_worker.py``; each check is asserted in its own test
(``tests.helpers.checks``).
"""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.checks import CheckLaunch, launch_checks

WORKER = Path(__file__).with_name("_fsdp_worker.py")

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module", params=[2, pytest.param(4, marks=pytest.mark.slow)], ids=lambda n: f"nprocs={n}")
def launch(request, tmp_path_factory) -> CheckLaunch:
    """One run of every check of ``_fsdp_worker.py`` on ``nprocs`` ranks (Gloo)."""
    run_dir = tmp_path_factory.mktemp(f"fsdp{request.param}")
    return launch_checks(request.param, [WORKER, run_dir / "runs"], run_dir / "checks", timeout=280)


def test_a_sharded_transformer_makes_the_update_of_one_process(launch: CheckLaunch) -> None:
    """AdamW on a char transformer, tokens shared unevenly, with and without micro-batches: the same parameters as
    data_parallel (bit for bit without micro-batches at 2 ranks: both sum two values) and as one process (to
    Adam's amplified rounding); every parameter sharded; model.safetensors equals the one-process run's."""
    figures = launch.result("attention")
    for micro in ("None", "9"):
        assert figures[f"sharded_micro{micro}"] and figures[f"units_micro{micro}"] == 2, figures
        assert figures[f"relative_difference_to_data_parallel_micro{micro}"] <= 2e-6, figures
        assert figures[f"relative_difference_micro{micro}"] <= 1e-5, figures
        assert figures[f"uneven_minibatches_micro{micro}"] > 0, figures
    assert figures["moved_by"] > 0.1, figures
    assert figures["weights_same_names"] and figures["weights_difference"] <= 1e-5, figures


def test_each_rank_holds_its_share_of_the_parameters_and_optimizer_state(launch: CheckLaunch) -> None:
    """ZeRO-3's memory: the ranks' parameter shards add up to the whole model, each at most 1/N of it plus a row of
    each tensor (FSDP2 cuts every tensor along its first dimension); AdamW's two moments likewise, at twice the
    parameters' bytes; data_parallel holds the whole model on every rank."""
    figures = launch.result("attention")
    size, held, whole_bytes = figures["size"], figures["bytes"], figures["bytes_replicated"]
    parameters, state, rows = [entry[0] for entry in held], [entry[1] for entry in held], held[0][2]
    assert sum(parameters) == whole_bytes and sum(state) == 2 * whole_bytes, figures
    slack = rows  # a first-dimension row of each parameter: what an uneven cut may add to a rank's share
    assert slack < whole_bytes / (2 * size), figures  # so that a rank holding more than its share fails below
    assert max(parameters) <= whole_bytes / size + slack, figures
    assert max(state) <= 2 * (whole_bytes / size + slack), figures


def test_hsdp_shards_inside_each_host_and_makes_the_update_of_one_process(launch: CheckLaunch) -> None:
    """``learner.shard_over=host`` with the job as two hosts of N/2 ranks: a (replicate, shard) mesh, one process's
    update, each rank holding its host's share (2/N; at 2 ranks the whole model), and a checkpoint the flat learner
    resumes to the same end."""
    figures = launch.result("hsdp")
    size, held, whole_bytes = figures["size"], figures["bytes"], figures["bytes_whole"]
    per_host = size // 2
    assert figures["mesh"] == [[2, per_host], ["replicate", "shard"]], figures
    assert figures["relative_difference"] <= 1e-5, figures
    parameters, rows = [entry[0] for entry in held], held[0][2]
    assert sum(parameters) == 2 * whole_bytes, figures  # each host holds the whole model once
    assert max(parameters) <= whole_bytes / per_host + rows and min(parameters) >= whole_bytes / per_host - rows, figures
    expected = "replicated over the 2 hosts (HSDP)" if per_host > 1 else "held whole by each of the 2 hosts' one rank"
    assert expected in figures["describe"], figures
    assert figures["restored_from"] == "checkpoint-280.pt" and figures["flat_resume_difference"] <= 1e-5, figures


def test_a_sharded_convnet_with_sync_batchnorm_makes_the_update_of_one_process(launch: CheckLaunch) -> None:
    """SGD with momentum on Conv1d + BatchNorm, one unit per child, sync_batchnorm: one process's parameters and
    BatchNorm statistics."""
    figures = launch.result("convolutions")
    assert figures["units"] == 4 and figures["relative_difference"] <= 1e-6, figures
    assert figures["running_var_difference"] <= 1e-6, figures


def test_clipping_uses_the_global_norm_across_shards(launch: CheckLaunch) -> None:
    figures = launch.result("clipping")
    assert figures["clipping_changed_the_model"] > 0.01, figures  # the clipping acted
    assert figures["relative_difference"] <= 1e-5, figures


def test_every_setting_is_honoured(launch: CheckLaunch) -> None:
    """Activation checkpointing and keeping gathered parameters change nothing in the update; bfloat16 compute
    changes it a little (it is used); a loop that never folds the share into the loss gets the same update."""
    figures = launch.result("settings")
    assert figures["activation_checkpointing"] <= 1e-5 and figures["no_reshard"] <= 1e-5, figures
    assert 1e-4 < figures["bfloat16"] < 0.5, figures
    assert figures["hand_driven"] <= 1e-4, figures


def test_the_weight_ema_is_kept_in_shards_as_data_parallel_keeps_it_whole(launch: CheckLaunch) -> None:
    """``session.ema_decay`` with sharded parameters: model_ema.safetensors (gathered) and the EMA's test pass equal
    data_parallel's to the parameters' own agreement; the EMA's pass leaves the live weights as they were; a resume
    at the same world size ends on the same average bit for bit, and data_parallel resumes fsdp's checkpoint (and
    fsdp data_parallel's) to the same average."""
    figures = launch.result("weight_ema")
    assert figures["parameters"] <= 2e-6, figures
    assert figures["average"] <= 2e-6 and figures["test_ema_loss"] <= 1e-5, figures
    assert figures["average_moved"] > 1e-3 and figures["ema_against_live"] > 1e-4, figures  # the average was tested
    assert figures["restored"] == [figures["restored"][0]] and figures["restored"][0].startswith("checkpoint-"), figures
    assert figures["resumed"] == 0.0, figures
    assert figures["replicated_from_sharded"] <= 1e-5 and figures["sharded_from_replicated"] <= 1e-5, figures


def test_what_cannot_be_sharded_is_refused_in_one_line(launch: CheckLaunch) -> None:
    refused = launch.result("refusals")
    assert refused["no_match"].startswith("learner.wrap=[Bottleneck] matches no module of CharTransformer"), refused
    assert "read_out.weight is tied to a parameter of token_embedding" in refused["tied"], refused
    assert refused["cpu_offload"].startswith("learner.cpu_offload=true: this run trains on the CPU"), refused
    assert refused["bad_wrap"].startswith("wrap='layers': expected blocks, children"), refused
    assert refused["bad_dtype"].startswith("param_dtype='float16': expected one of float32, bfloat16"), refused
    assert refused["fp16"].startswith("session.precision=fp16 with learner=fsdp"), refused
    assert refused["compile"].startswith("session.compile=true with learner=fsdp"), refused
    assert all("\n" not in line for line in refused.values()), refused
