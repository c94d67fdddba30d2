"""The shipped config tree: every recipe composes and instantiates with every learner; typos fail early."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from dtrain.session.binding import StreamBinding
from dtrain.session.stream_checks import bind_sources
from hydra.errors import ConfigCompositionException
from hydra.utils import instantiate
from omegaconf import OmegaConf, open_dict

from tests.helpers.config import CONF, compose_config
from dtrain.testing.cifar_files import write_cifar10_binary
from dtrain.testing.image_files import write_image_map_files
from dtrain.comm import LocalCommunicator
from dtrain.session.from_settings import session_inputs
from dtrain.config import SCHEMAS, register_schema, register_schemas, validate

RECIPES = sorted(p.stem for p in (CONF / "recipe").glob("*.yaml"))
LEARNERS = sorted(p.stem for p in (CONF / "learner").glob("*.yaml"))
def test_the_tree_ships_the_documented_recipes_and_learners():
    assert {"digits", "cifar10"} <= set(RECIPES)
    assert {"local", "data_parallel", "quantized", "block_momentum"} <= set(LEARNERS)


def composed(recipe: str, learner: str, data_root) -> object:
    """The recipe with the learner, validated and resolved as the CLI resolves it, over small data files in
    the real formats under ``data_root``."""
    write_cifar10_binary(data_root, num_train=20, num_test=10)
    write_image_map_files(data_root, num_train=8, num_val=4)  # recipe imagenet's map files
    cfg = compose_config(f"+recipe={recipe}", f"learner={learner}", f"data.root={data_root}")
    assert validate(cfg) == []
    OmegaConf.resolve(cfg)
    return cfg


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_reads_its_data_and_its_model_takes_every_source(recipe, tmp_path):
    """Each source of the recipe gives a minibatch the model takes, with logits of the shape its target needs.
    The learner plays no part in this (it wraps the optimizer, not the model): checked once, with the default."""
    cfg = composed(recipe, "data_parallel", tmp_path)
    model = instantiate(cfg.model)
    binding = StreamBinding(session_inputs(cfg.session), cfg.session.target)  # as dtrain.build reads it
    for name in ("train", "test", "cv"):
        if cfg.source[name] is not None:
            source = instantiate(cfg.source[name])
            bind_sources(binding, {name: source})  # as the session does: samples are the target's steps
            batch = source.next_minibatch(8 if binding.is_default else 512)  # samples, or target steps
            with torch.no_grad():
                output = binding.forward(model.eval(), batch)
            if binding.is_default:
                assert output.shape == (batch.num_samples, cfg.model.num_classes)
                assert batch.labels.dtype == torch.int64
            else:  # a sequence recipe: logits for every step of its sequence target
                target = binding.target_of(batch)
                assert output.shape[:2] == target.data.shape and int(target.lengths.sum()) == batch.num_samples


@pytest.mark.parametrize("recipe, learner", [(recipe, learner) for recipe in RECIPES for learner in LEARNERS])
def test_every_recipe_instantiates_with_every_learner(recipe, learner, tmp_path):
    """Every learner composes into every recipe, validates, and wraps the recipe's optimizer; a two-level one
    refuses a single process in one line."""
    cfg = composed(recipe, learner, tmp_path)
    model = instantiate(cfg.model)
    optimizer = instantiate(cfg.optimizer)(model.parameters())
    if learner.startswith("two_level"):  # one process is one host: refused (docs/multi-host.md#two-levels)
        with pytest.raises(Exception, match="a two-level learner needs several hosts"):
            instantiate(cfg.learner, optimizer=optimizer, comm=LocalCommunicator())
        return
    learner_object = instantiate(cfg.learner, optimizer=optimizer, comm=LocalCommunicator())
    assert learner_object.optimizer is optimizer


def test_cifar10_recipe_converts_cntk_schedule_to_per_minibatch_rates():
    cfg = compose_config("+recipe=cifar10")
    assert cfg.session.minibatch_size == 64 and cfg.optimizer.lr == 0.1
    from dtrain.schedules import Schedule

    lr = Schedule(OmegaConf.to_container(cfg.session.lr_schedule["values"]), cfg.session.lr_schedule.epoch_size)
    per_sample = [0.0015625, 0.00046875, 0.00015625, 0.000046875, 0.000015625]
    for epoch, expected in zip((0, 20, 40, 60, 70), per_sample):
        assert cfg.optimizer.lr * lr(epoch * 50000) == pytest.approx(expected * 64)


@pytest.mark.parametrize("override, fragment", [
    ("session.minibatch_sise=5", "minibatch_sise"),
    ("learner.block_learning_rate=abc", "block_learning_rate"),
    ("session.max_samples=many", "max_samples"),
    ("optimizer.lrr=0.1", "lrr"),
])
def test_typos_and_wrong_types_fail_at_compose_time_naming_the_key(override, fragment):
    overrides = ["+recipe=digits", override]
    if override.startswith("learner.block"):
        overrides.insert(1, "learner=block_momentum")
    with pytest.raises(ConfigCompositionException, match=fragment):
        compose_config(*overrides)


def test_unknown_recipe_lists_the_available_ones():
    with pytest.raises(ConfigCompositionException, match=r"Could not find 'recipe/imagenette'(.|\n)*cifar10\n\tcmudict_g2p\n\tdigits"):
        compose_config("+recipe=imagenette")


@pytest.mark.parametrize("overrides, fragment", [
    ((), "no recipe chosen"),
    (("+recipe=digits", "session.minibatch_size=0"), "session.minibatch_size=0: expected a positive"),
    (("+recipe=digits", "session.max_samples=-10"), "session.max_samples=-10"),
    (("+recipe=digits", "learner=quantized", "learner.exchange.num_bits=0"),
     "learner.exchange.num_bits=0: expected a whole number of bits from 1 to 32"),
    (("+recipe=digits", "learner=quantized", "learner.exchange.num_bits=33"), "from 1 to 32"),
    (("+recipe=digits", "learner=quantized", "learner.freeze_variance=yes"),
     "learner.freeze_variance='yes': expected true, false or auto"),
    (("+recipe=digits", "learner=two_level_quantized", "learner.freeze_variance=1"),
     "learner.freeze_variance=1: expected true, false or auto"),
    (("+recipe=digits", "learner=block_momentum", "learner.block_momentum_as_time_constant=-3"), "time_constant=-3.0"),
    (("+recipe=digits", "learner=block_momentum", "learner.local_learning_rate=cntk"),
     "learner.local_learning_rate='cntk': expected one of share, full"),
    (("+recipe=digits", "learner=block_momentum", "+learner.num_quantization_bits=1"),
     "learner.num_quantization_bits=1: no longer a learner setting; write learner/exchange=quantized "
     "learner.exchange.num_bits=1"),
    (("+recipe=digits", "comm.backend=tcp"), "comm.backend='tcp'"),
    (("+recipe=digits", "learner=quantized", "learner.distributed_after=-1"),
     "learner.distributed_after=-1: expected a non-negative whole number of samples"),
    # block_size and distributed_after also take "auto", so a word other than that is refused here
    (("+recipe=digits", "learner=block_momentum", "learner.block_size=abc"),
     "learner.block_size='abc': expected a positive whole number of samples or auto"),
    (("+recipe=digits", "learner=quantized", "learner.distributed_after=soon"),
     "learner.distributed_after='soon': expected a non-negative whole number of samples or auto"),
    (("+recipe=digits", "session.checkpoint.preemption_signal=SIG_IGN"), "preemption_signal='SIG_IGN'"),
    (("+recipe=digits", "optimizer.lr=0"), "optimizer.lr=0"),
    # a schedule setting given without the values it shapes would be ignored
    (("+recipe=digits", "session.minibatch_size_schedule.epoch_size=100"),
     "session.minibatch_size_schedule.epoch_size=100 is set but session.minibatch_size_schedule.values is not"),
    (("+recipe=digits", "session.momentum_time_constant_schedule.warmup_samples=100"),
     "session.momentum_time_constant_schedule.warmup_samples=100 is set but"),
    (("+recipe=digits", "session.minibatch_size_schedule.values=[32,0]"),
     "session.minibatch_size_schedule.values[1] value=0: expected a positive whole number of samples"),
])
def test_out_of_range_values_are_all_reported_before_anything_runs(overrides, fragment):
    problems = validate(compose_config(*overrides))
    assert any(fragment in problem for problem in problems), problems


@pytest.mark.parametrize("override", ["session.minibatch_size_schedule.values=[[2,32],[1,64]]",
                                      "session.minibatch_size_schedule={values: [[2, 32], [1, 64]]}"])
def test_a_schedule_the_recipe_leaves_off_can_be_set_on_the_command_line(override):
    from dtrain.session.from_settings import schedule as _schedule

    cfg = compose_config("+recipe=digits", override)
    assert validate(cfg) == []
    schedule = _schedule(cfg.session.minibatch_size_schedule)
    schedule.set_sweep_size(1500)  # the digits' sweep, which training_session tells it
    assert [schedule(samples) for samples in (0, 2999, 3000, 4500)] == [32, 32, 64, 64]
    assert _schedule(compose_config("+recipe=digits").session.minibatch_size_schedule) is None


def test_an_lr_warm_up_alone_ramps_the_constant_lr():
    from dtrain.session.from_settings import schedule as _schedule

    cfg = compose_config("+recipe=digits", "session.lr_schedule.values=null", "session.lr_schedule.epoch_size=null",
                         "session.lr_schedule.warmup_samples=100")
    assert validate(cfg) == []
    schedule = _schedule(cfg.session.lr_schedule)
    assert [schedule(samples) for samples in (0, 49, 99, 100, 5000)] == pytest.approx([0.01, 0.5, 1.0, 1.0, 1.0])


def test_a_cntk_block_momentum_configuration_is_accepted_and_built_as_asked():
    """docs/semantics.md#block-momentum: time constant 0 (block momentum 0) and CNTK's local steps."""
    cfg = compose_config("+recipe=digits", "learner=block_momentum", "learner.block_momentum_as_time_constant=0",
                         "learner.local_learning_rate=share", "learner.block_size=32")
    assert validate(cfg, check_run_dir=False) == []
    learner = instantiate(cfg.learner, optimizer=torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1),
                          comm=LocalCommunicator())
    assert learner.time_constant == 0.0 and learner.local_learning_rate == "share"
    default = instantiate(compose_config("+recipe=digits", "learner=block_momentum").learner,
                          optimizer=torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1), comm=LocalCommunicator())
    assert default.local_learning_rate == "full"  # learner=block_momentum keeps its measured default


OPTIMIZERS = sorted(p.stem for p in (CONF / "optimizer").glob("*.yaml"))
#: the large-minibatch optimizers meet every recipe in the slow set, digits in the default one (time budget)
_LARGE_MINIBATCH = ("lamb", "lars", "rmsprop_warmup_sgd")
OPTIMIZER_RECIPES = [pytest.param(recipe, optimizer, marks=pytest.mark.slow)
                     if optimizer in _LARGE_MINIBATCH and recipe != "digits" else (recipe, optimizer)
                     for optimizer in OPTIMIZERS for recipe in RECIPES]


@pytest.mark.parametrize("recipe, optimizer", OPTIMIZER_RECIPES)
def test_every_optimizer_combines_with_every_recipe_and_its_momentum_settings(recipe, optimizer):
    cfg = compose_config(f"+recipe={recipe}", f"optimizer={optimizer}", *(["model.width=4"] if recipe == "imagenet" else []))
    assert validate(cfg, check_run_dir=False) == []
    model = instantiate(cfg.model)
    built = instantiate(cfg.optimizer)(model.parameters())
    group = built.param_groups[0]
    assert group["lr"] == cfg.optimizer.lr
    if "momentum" in cfg.optimizer:  # what a recipe or a momentum schedule sets acts on the optimizer
        group["momentum"] = 0.5
        for parameter in model.parameters():
            parameter.grad = torch.ones_like(parameter)
        built.step()
        assert group["momentum"] == 0.5 and group.get("betas", (0.5,))[0] == 0.5


def test_adam_momentum_is_beta1_and_matches_torch_adam():
    from dtrain.optimizers import Adam

    torch.manual_seed(0)
    weights = [torch.randn(5, requires_grad=True) for _ in range(2)]
    ours = Adam([weights[0]], lr=0.01, momentum=0.8, variance_momentum=0.99, weight_decay=0.1)
    theirs = torch.optim.Adam([weights[1]], lr=0.01, betas=(0.8, 0.99), weight_decay=0.1)
    with torch.no_grad():
        weights[1].copy_(weights[0])
    for step in range(3):
        for weight, optimizer in zip(weights, (ours, theirs)):
            weight.grad = torch.full_like(weight, float(step + 1)) * weight.detach()
            optimizer.step()
    assert torch.equal(weights[0], weights[1])


@pytest.mark.parametrize("overrides, fragments", [
    (("session.minibatch_size=0", "session.checkpoint.filename=sub/"),
     ("session.minibatch_size=0", "session.checkpoint.filename='sub/'")),
    (("optimizer.lr=nan", "model.dropout=inf", "comm.timeout_s=-inf"),
     ("optimizer.lr=nan", "model.dropout=inf", "comm.timeout_s=-inf")),
    (("+session.max_sample=640", "+model.hiden=3", "model.hidden=0"),
     ("session.max_sample: unknown key", "did you mean session.max_samples?", "model.hiden: unknown key",
      "model.hidden=0")),
])
def test_every_problem_is_reported_at_once_naming_each_key(overrides, fragments):
    problems = validate(compose_config("+recipe=digits", *overrides), check_run_dir=False)
    assert len(problems) == len(fragments) - ("did you mean session.max_samples?" in fragments), problems
    for fragment in fragments:
        assert any(fragment in problem for problem in problems), (fragment, problems)


def test_any_non_finite_number_is_refused_even_without_a_rule():
    cfg = compose_config("+recipe=cifar10")
    with open_dict(cfg):  # an untyped section (a user's component) with a number no rule knows
        cfg.source.train.transform.strength = float("nan")
    cfg.session.lr_schedule["values"][0][1] = float("inf")
    problems = validate(cfg, check_run_dir=False)
    assert any(p.startswith("source.train.transform.strength=nan: expected a finite number") for p in problems), problems
    assert any("session.lr_schedule.values[0] value=inf" in p for p in problems), problems


@pytest.mark.parametrize("make, fragment", [
    (lambda base: base / "file", "is a file, not a directory"),
    (lambda base: base / "empty", "is an empty file, not a directory"),
    (lambda base: base / "file" / "run", "is a file, so no directory can be made below it"),
])
def test_run_dir_that_cannot_be_a_directory_is_named(tmp_path, make, fragment):
    (tmp_path / "file").write_text("x")
    (tmp_path / "empty").write_bytes(b"")
    problems = validate(compose_config("+recipe=digits", f"run_dir={make(tmp_path)}"))
    assert len(problems) == 1 and problems[0].startswith(f"run_dir={make(tmp_path)}") and fragment in problems[0]


def test_run_dir_on_a_read_only_file_system_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    import dtrain.config

    # what access(2) answers for a read-only mount, even to root
    monkeypatch.setattr(dtrain.config.os, "access", lambda path, mode: not str(path).startswith(str(tmp_path)))
    for run_dir in (tmp_path, tmp_path / "new" / "run"):
        problems = validate(compose_config("+recipe=digits", f"run_dir={run_dir}"))
        assert len(problems) == 1 and "not writable" in problems[0] and "expected a writable directory" in problems[0]
    assert not (tmp_path / "new").exists()


def test_heartbeat_timeout_is_at_least_a_second():
    problems = validate(compose_config("+recipe=digits", "comm.heartbeat_timeout_s=0.5"), check_run_dir=False)
    assert problems == ["comm.heartbeat_timeout_s=0.5: expected at least 1 second"]


def test_hydra_flags_move_ahead_of_the_overrides_in_their_order():
    from dtrain.cli import flags_before_overrides

    assert flags_before_overrides(["+recipe=digits", "seed=1,2", "-m", "optimizer.lr=0.1", "~session.seed"]) == [
        "-m", "+recipe=digits", "seed=1,2", "optimizer.lr=0.1", "~session.seed"]
    assert flags_before_overrides(["lr=1", "--cfg", "job", "seed=3", "--info", "defaults"]) == [
        "--cfg", "job", "--info", "defaults", "lr=1", "seed=3"]
    assert flags_before_overrides(["--multirun", "a=1"]) == ["--multirun", "a=1"]
    assert flags_before_overrides(["a=1", "--config-dir", "/conf/x=y", "b=2"]) == ["--config-dir", "/conf/x=y", "a=1", "b=2"]


@pytest.mark.parametrize("flags", [[], ["--config-dir", "{conf}"], ["-cd", "{conf}"], ["--config-dir={conf}"],
                                   ["--cfg", "job"], ["-m"]], ids=["none", "config-dir", "cd", "config-dir=", "cfg", "m"])
@pytest.mark.parametrize("override, line", [
    ("optimizer.lr=[1", "optimizer.lr=[1: not a readable override (no viable alternative at input '[1'); expected "
                        "key=value"),
    ("session.target=text[1:]", "session.target=text[1:]: a value with brackets (a step slice) must be quoted on the "
                                "command line; expected 'session.target=\"text[1:]\"'"),
])
def test_an_unreadable_override_is_one_line_whatever_the_flags(tmp_path, flags, override, line):
    from dtrain.cli import check_overrides

    (tmp_path / "recipe").mkdir()
    problem = check_overrides([flag.format(conf=tmp_path) for flag in flags] + ["+recipe=digits", override])
    assert problem is not None and problem.startswith(line) and "\n" not in problem, problem


@dataclasses.dataclass
class _MineConfig:  # a user's schema, registered where it is defined
    _target_: str = "torch.nn.Identity"
    width: int = 3


def test_a_schema_registered_in_its_own_module_is_stored_and_types_a_users_option(tmp_path):
    from hydra.core.config_store import ConfigStore

    register_schema("schema/model", "test_mine", _MineConfig)
    register_schemas()
    assert ConfigStore.instance().load("schema/model/test_mine.yaml").node.width == 3
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "mine.yaml").write_text("defaults:\n  - /schema/model/test_mine@_here_\n  - _self_\n")
    from dtrain.cli import check_overrides

    assert check_overrides(["--config-dir", str(tmp_path), "+recipe=digits", "model=mine", "model.width=4"]) is None
    problem = check_overrides(["--config-dir", str(tmp_path), "+recipe=digits", "model=mine", "model.width=wide"])
    assert "model.width" in problem and "\n" not in problem, problem  # typed by the schema: refused at compose
    problem = check_overrides(["--config-dir", str(tmp_path), "+recipe=digits", "model=mine", "model.widht=4"])
    assert "widht" in problem and "\n" not in problem, problem


def test_dtrains_schemas_register_in_the_modules_that_define_them():
    from dtrain.config import DTrainConfig
    from dtrain.learners.settings import DiLoCoLearnerConfig
    from dtrain.optim import settings as optim_settings

    assert SCHEMAS[("schema", "config")] is DTrainConfig
    assert SCHEMAS[("schema/learner", "diloco")] is DiLoCoLearnerConfig
    assert all(SCHEMAS[("schema/optimizer", name)] is schema for name, schema in optim_settings.OPTIONS.items())
    assert {schema.__module__ for schema in SCHEMAS.values()} >= {
        "dtrain.learners.settings", "dtrain.exchange.settings", "dtrain.models.settings", "dtrain.data.settings",
        "dtrain.session.settings", "dtrain.session.objective_settings", "dtrain.optim.torch_settings"}


def test_a_config_dir_joins_the_composition_check(tmp_path):
    from dtrain.cli import check_overrides

    register_schemas()  # as python -m dtrain does before the check
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "mine.yaml").write_text("_target_: torch.nn.Identity\n")
    assert check_overrides(["--config-dir", str(tmp_path), "+recipe=digits", "model=mine"]) is None
    problem = check_overrides(["--config-dir", str(tmp_path), "+recipe=digits", "model=mien"])
    assert "Could not find 'model/mien'" in problem and "mine" in problem and "\n" not in problem, problem
    problem = check_overrides(["--config-dir", str(tmp_path / "nope"), "+recipe=digits"])
    assert problem == (f"--config-dir {tmp_path / 'nope'}: no such directory; expected a directory of configs "
                       f"(recipe/NAME.yaml, ...)")


@pytest.mark.parametrize("recipe, override, composed", [
    ("digits", "session.inputs={x: features}", {"x": "features"}),                      # over the default
    ("shakespeare_char", 'session.inputs={x: "text[:-1]"}', {"x": "text[:-1]"}),        # over a recipe's list
    ("cmudict_g2p", "session.inputs={src: graphemes}", {"src": "graphemes"}),           # replaced, not merged
    ("digits", "session.inputs=[features]", ["features"]),
])
def test_session_inputs_on_the_command_line_replaces_the_configs_whatever_its_kind(recipe, override, composed):
    from omegaconf import OmegaConf

    from dtrain.cli import replacing_overrides

    overrides = replacing_overrides([f"+recipe={recipe}", override])
    assert overrides == [f"+recipe={recipe}", "session.inputs=null", override]
    cfg = compose_config(*overrides)
    assert OmegaConf.to_container(cfg.session.inputs) == composed
    assert validate(cfg, check_run_dir=False) == []


def test_the_default_inputs_are_the_features_stream():
    cfg = compose_config("+recipe=digits")
    assert cfg.session.inputs == "features" and validate(cfg, check_run_dir=False) == []


def test_a_word_without_an_equals_sign_is_one_line_but_a_flags_value_is_left_to_hydra():
    from dtrain.cli import check_overrides

    for flags in ([], ["-m"]):
        assert check_overrides([*flags, "+recipe=digits", "foo"]) == (
            "foo: not an override (missing EQUAL at '<EOF>'); expected key=value (or +recipe=NAME, group=option, ~key) "
            "(python -m dtrain --help lists the recipes and groups)")
    assert check_overrides(["+recipe=digits", "--cfg", "job", "--package", "session"]) is None
    assert check_overrides(["+recipe=digits", "--info", "defaults"]) is None
