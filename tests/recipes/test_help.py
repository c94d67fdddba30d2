"""``--help`` and ``--version``: dtrain's own texts, not Hydra's generic ones."""
from __future__ import annotations

import re

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CONF = ROOT / "conf"
CONSOLE_SCRIPT = Path(sys.executable).with_name("dtrain")


def run(*command: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(list(command), cwd=cwd, capture_output=True, text=True, timeout=120)


def _defaults_list(path: Path) -> dict[str, str | None]:
    """``group: option`` entries of a YAML file's defaults list (``null`` where none is chosen)."""
    entries = (yaml.safe_load(path.read_text()) or {}).get("defaults", [])
    return {key: value for entry in entries if isinstance(entry, dict) for key, value in entry.items()
            if not key.startswith("override ") and not key.startswith("/")}


def tree_groups(*directories: Path) -> dict[str, tuple[list[str], str | None]]:
    """``{group: (its YAML options, its default)}`` of the config trees, read from the files themselves: the
    root ``config.yaml``'s defaults list, and a nested group's (``learner/exchange``) its parent default's."""
    groups: dict[str, list[str]] = {}
    for directory in directories:
        for path in [*directory.glob("*/*.yaml"), *directory.glob("*/*/*.yaml")]:
            group = path.parent.relative_to(directory).as_posix()
            if group != "recipe":
                groups.setdefault(group, []).append(path.stem)
    defaults = _defaults_list(CONF / "config.yaml")
    for group, option in list(defaults.items()):
        if option and (CONF / group / f"{option}.yaml").is_file():
            defaults.update({f"{group}/{nested}": choice
                             for nested, choice in _defaults_list(CONF / group / f"{option}.yaml").items()})
    return {group: (sorted(set(options)), defaults.get(group)) for group, options in groups.items()}


def help_groups(text: str) -> dict[str, tuple[str, dict[str, tuple[bool, str]]]]:
    """``{group: (its heading line, {option: (marked the default, its description)})}`` of a --help text."""
    section = text.split("\nconfig groups (")[1].split("\n\nexamples:")[0]
    groups: dict[str, tuple[str, dict]] = {}
    for line in section.splitlines()[1:]:
        if re.match(r"  [^ ]", line):
            heading = line.strip()
            groups[heading.split("=", 1)[0]] = (heading, options := {})
        elif found := re.match(r"    ([^ ]+) +(\*?) +(.*)$", line):
            options[found[1]] = (found[2] == "*", found[3])
    return groups


def assert_help_shows_every_option(text: str, *directories: Path) -> None:
    """Each group's line lists every YAML option of its directory (and no other), sorted, with the default
    the tree chooses; each option has a line of description, and the default is marked."""
    shown = help_groups(text)
    expected = tree_groups(*directories)
    assert set(shown) == set(expected), (sorted(shown), sorted(expected))
    for group, (options, default) in expected.items():
        heading, described = shown[group]
        listed = re.match(rf"{re.escape(group)}=\[?([\w|,]+)\]?", heading)[1]
        listed = listed.split("," if "=[" in heading else "|")
        assert listed == options, (group, listed, options)  # every option, sorted
        assert list(described) == options, (group, list(described))
        assert all(description and description != "(no description)" for _, description in described.values()), group
        # prose, not a command to run (an option's header may also say what to run afterwards: "then: ...")
        assert not [o for o, (_, d) in described.items() if d.startswith(("then:", "python ", "pip "))], (group, described)
        if "=[" in heading:  # several at once: none unless chosen
            assert heading.endswith("(any of them, several at once; default: none)") and default is None, heading
        elif default is not None and len(options) > 1:
            assert heading.endswith(f"   (default: {default})") and described[default][0], (group, heading)
        assert [name for name, (marked, _) in described.items() if marked] == \
            ([default] if default in options and "=[" not in heading else []), group


@pytest.mark.parametrize("command", [
    (sys.executable, "-m", "dtrain", "--help"),
    (sys.executable, "-m", "dtrain", "-h"),
    pytest.param((str(CONSOLE_SCRIPT), "--help"), marks=pytest.mark.slow),  # the default set starts it in --version's test
    (sys.executable, "-m", "dtrain", "+recipe=digits", "--help"),
], ids=["python-m-help", "python-m-h", "console-script", "after-overrides"])
def test_help_is_dtrains_own_with_recipes_groups_options_and_examples(command, tmp_path):
    if not Path(command[0]).exists():
        pytest.skip("the dtrain console script is not installed in this environment")
    result = run(*command, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    text = result.stdout
    assert "Powered by Hydra" not in text and "schema/" not in text and "schema" not in text.split("examples:")[0]
    assert text.startswith("dtrain: declarative, distributed data-parallel training for PyTorch")
    for recipe in ("cifar10", "cmudict_g2p", "digits", "imagenet", "shakespeare_char"):
        assert f"\n  {recipe} " in text
    # every group of conf/ with all its options, sorted, its default marked, each option described; a nested
    # group (learner/exchange=NAME) has the default its parent's default option picks
    assert_help_shows_every_option(text, CONF)
    assert {"learner", "learner/exchange", "optimizer", "model", "source", "session"} <= set(help_groups(text))
    assert "1-bit SGD with error feedback" in text  # each option says what it is
    assert "\n    allreduce  * full-precision (float32) SUM all-reduce" in text
    for example in ("mpiexec -n 4 python -m dtrain", "python -m dtrain -m ", "run_dir=", "--config-dir"):
        assert example in text
    # what it points to for more is installed with dtrain: the pages --help TOPIC prints, not the repository's README
    more = text.split("read more:")[1]
    assert "docs/semantics.md" in more and "README" not in more
    head = re.split(r"\n    (?=\S)", more, maxsplit=1)[0]  # the lines above the list of topics
    for topic in ("your-model-and-data", "learners", "multi-host"):  # what the README's tour covers, as topics
        assert topic in head and f"\n    {topic} " in more, topic


def test_help_lists_the_recipes_and_options_of_a_config_dir(tmp_path):
    (tmp_path / "conf" / "recipe").mkdir(parents=True)
    (tmp_path / "conf" / "learner").mkdir()
    (tmp_path / "conf" / "recipe" / "mine.yaml").write_text("# @package _global_\n# my own recipe. More.\n")
    (tmp_path / "conf" / "learner" / "local_sgd.yaml").write_text("# learner=local_sgd: Local SGD, averaged every k steps.\n")
    result = run(sys.executable, "-m", "dtrain", "--config-dir", str(tmp_path / "conf"), "--help", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert re.search(r"\n  mine +my own recipe\.", result.stdout)  # in the name column, however wide
    assert_help_shows_every_option(result.stdout, CONF, tmp_path / "conf")
    assert re.search(r"\n +local_sgd +Local SGD, averaged every k steps\.", result.stdout)  # the config dir's own


def test_help_shows_callbacks_as_a_list_of_several_with_a_config_dirs_own(tmp_path):
    (tmp_path / "conf" / "callbacks").mkdir(parents=True)
    (tmp_path / "conf" / "callbacks" / "mine.yaml").write_text("# python -m dtrain callbacks=[mine]\n# my own callback.\n")
    result = run(sys.executable, "-m", "dtrain", "--config-dir", str(tmp_path / "conf"), "--help", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert_help_shows_every_option(result.stdout, CONF, tmp_path / "conf")
    assert "mine" in help_groups(result.stdout)["callbacks"][1]
    assert re.search(r"\n +mine +my own callback\.", result.stdout)


@pytest.mark.slow
def test_hydra_help_is_still_hydras(tmp_path):
    result = run(sys.executable, "-m", "dtrain", "--hydra-help", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "Hydra" in result.stdout


@pytest.mark.parametrize("command", [(sys.executable, "-m", "dtrain", "--version"),
                                     (str(CONSOLE_SCRIPT), "--version")],
                         ids=["python-m", "console-script"])
def test_version_prints_dtrains_version_and_exits_0(command, tmp_path):
    if not Path(command[0]).exists():
        pytest.skip("the dtrain console script is not installed in this environment")
    result = run(*command, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    expected = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert result.stdout == f"dtrain {expected}\n"


def test_the_hint_for_a_nested_group_names_the_parent_options_that_have_it(tmp_path):
    from dtrain.help import nested_group_hint

    (tmp_path / "learner").mkdir()
    (tmp_path / "learner" / "plain.yaml").write_text("defaults:\n  - _self_\n")
    (tmp_path / "learner" / "talks.yaml").write_text("defaults:\n  - exchange: allreduce\n  - _self_\n")
    message = "Could not override 'learner/exchange'. No match in the defaults list."
    assert nested_group_hint(tmp_path, message, ["learner=plain", "learner/exchange=bf16"]) == \
        "(learner=plain has no learner/exchange; learner/exchange=NAME goes with learner=talks)"
    assert nested_group_hint(tmp_path, message, ["learner/exchange=bf16"]).startswith("(the learner chosen has no")
    assert nested_group_hint(tmp_path, message.replace("exchange", "schedule"), []) is None  # no option has one
    assert nested_group_hint(tmp_path, "Could not find 'learner/nope'", ["learner=nope"]) is None


def test_help_topic_prints_that_documentation_page_and_help_lists_every_page(tmp_path):
    pages = sorted(page.stem for page in (ROOT / "docs").glob("*.md") if page.stem != "README")
    listing = run(sys.executable, "-m", "dtrain", "--help", cwd=tmp_path).stdout.split("read more:")[1]
    for page in pages:
        assert re.search(rf"\n    {re.escape(page)} +\S", listing), page
    result = run(sys.executable, "-m", "dtrain", "--help", "data", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout == (ROOT / "docs" / "data.md").read_text().rstrip("\n") + "\n"


def test_an_unknown_help_topic_is_refused_with_the_topics_there_are(tmp_path):
    result = run(sys.executable, "-m", "dtrain", "--help", "lerners", cwd=tmp_path)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.startswith("dtrain: error: --help lerners: no such help topic; expected one of ")
    assert "semantics" in result.stderr and len(result.stderr.strip().splitlines()) == 1
