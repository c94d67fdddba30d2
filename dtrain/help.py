"""dtrain's own ``--help`` and ``--version`` texts for the command line.

Hydra's generic help lists its internal ``schema/*`` groups and says nothing about recipes, so
``python -m dtrain --help`` prints this instead (``--hydra-help`` still prints Hydra's). The
groups and their options are discovered from the config tree(s) the run would use: the shipped
one and any ``--config-dir``, so a user's own recipes, models or learners appear too. Each
option's one-line description is the first sentence of the comment at the top of its YAML file.
"""
from __future__ import annotations

import re
import textwrap
from importlib import metadata
from pathlib import Path

#: groups that exist for the machinery, not for users to choose from
_HIDDEN_GROUPS = ("hydra", "schema")

_WIDTH = 100

_INTRO = """\
dtrain: declarative, distributed data-parallel training for PyTorch.

A run is composed from a recipe (the model, the data and the settings of a known example) and
config groups you can swap on the command line. The same command trains one process or, under
mpiexec/torchrun/srun, N processes with a distributed learner; sizes and frequencies count
global samples (all processes together; for sequences a sample is one step of the loss's target),
so the result does not depend on the process count.

usage: python -m dtrain +recipe=NAME [group=option ...] [key=value ...]
       dtrain +recipe=NAME ...            (the same, installed as a command)
       dtrain --help | --version | --hydra-help"""

_EXAMPLES = """\
  python -m dtrain +recipe=digits                            one process
  mpiexec -n 4 python -m dtrain +recipe=digits               4 processes, data-parallel
  mpiexec -n 4 python -m dtrain +recipe=cifar10 learner=quantized learner.distributed_after=50000
  python -m dtrain +recipe=digits optimizer.lr=0.1 session.max_samples=15000   override values
  python -m dtrain +recipe=digits --cfg job                  print the composed config, run nothing
  python -m dtrain -m +recipe=digits optimizer.lr=0.01,0.05,0.1               a sweep (one run each)
  python -m dtrain +recipe=digits run_dir=outputs/digits/2026-01-01_12-00-00  resume that run
  python -m dtrain --config-dir my_conf +recipe=mine         your own recipe/model/learner YAMLs"""

_MORE_HEAD = """\
  python -m dtrain --help TOPIC  prints one of these pages, installed with dtrain (docs/TOPIC.md in the
                                 repository; --help semantics: docs/semantics.md). Start with
                                 your-model-and-data, learners (choosing one) and multi-host (several nodes):"""

_MORE_TAIL = """\
  python -m dtrain +recipe=NAME --cfg job    every key of a composed config and its value"""


class UnknownTopic(ValueError):
    """``--help TOPIC`` named a page that does not exist."""


def config_dir() -> str:
    """The shipped config tree: ``dtrain/conf`` in an installed wheel, ``conf/`` in a source checkout."""
    package = Path(__file__).resolve().parent
    for candidate in (package / "conf", package.parent / "conf"):
        if (candidate / "config.yaml").is_file():
            return str(candidate)
    raise RuntimeError(f"dtrain's config tree is missing (looked in {package / 'conf'} and {package.parent / 'conf'})")


def docs_dir() -> Path | None:
    """The documentation pages: ``dtrain/docs`` in an installed wheel, ``docs/`` in a source checkout (one
    source, mapped into the wheel by ``pyproject.toml``); ``None`` when neither is there."""
    package = Path(__file__).resolve().parent
    for candidate in (package / "docs", package.parent / "docs"):
        if candidate.is_dir() and any(candidate.glob("*.md")):
            return candidate
    return None


def help_topics() -> dict[str, str]:
    """``{topic: title}`` of every documentation page (``docs/TOPIC.md``; the index ``README.md`` aside)."""
    directory = docs_dir()
    if directory is None:
        return {}
    topics = {}
    for page in sorted(directory.glob("*.md")):
        if page.stem != "README":
            first = page.read_text(encoding="utf-8").splitlines()[:1] or [""]
            topics[page.stem] = first[0].lstrip("# ").strip()
    return topics


def help_topic(name: str) -> str:
    """The text of documentation page ``name`` (``learners``, ``data``, ...), for ``--help TOPIC``.

    Raises:
        UnknownTopic: there is no such page; the message lists the pages there are.
    """
    directory = docs_dir()
    if directory is not None and name in help_topics():
        return (directory / f"{name}.md").read_text(encoding="utf-8")
    raise UnknownTopic(f"--help {name}: no such help topic; expected one of {', '.join(help_topics()) or '(none shipped)'}")


def quick_answer(argv: list[str]) -> str | None:
    """The text for ``--help``/``-h`` (dtrain's help; Hydra's stays at ``--hydra-help``), ``--help TOPIC`` (a
    documentation page) or ``--version``, ending in a newline; ``None`` for any other command line.

    Raises:
        UnknownTopic: ``--help TOPIC`` named no page.
    """
    for flag in ("--help", "-h"):
        if flag in argv:
            following = argv[argv.index(flag) + 1:argv.index(flag) + 2]
            if following and not following[0].startswith("-") and "=" not in following[0]:
                return help_topic(following[0]).rstrip("\n") + "\n"
    if "--help" in argv or "-h" in argv:
        return help_text(config_dir(), argv)
    if "--version" in argv:
        return f"dtrain {version()}\n"
    return None


def version() -> str:
    """dtrain's version: the installed distribution's, else the source tree's ``pyproject.toml``.

    Raises:
        RuntimeError: neither is available (a copy of the package without its metadata).
    """
    try:
        return metadata.version("dtrain")
    except metadata.PackageNotFoundError:
        pass
    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    if pyproject.is_file():
        import tomllib

        return tomllib.loads(pyproject.read_text())["project"]["version"]
    raise RuntimeError("dtrain's version is unknown: it is neither installed nor run from its source tree")


def config_directories(shipped: str | Path, argv: list[str]) -> list[Path]:
    """The shipped config tree followed by every ``--config-dir``/``-cd`` directory named in ``argv``."""
    directories = [Path(shipped)]
    for index, argument in enumerate(argv):
        if argument in ("--config-dir", "-cd") and index + 1 < len(argv):
            directories.append(Path(argv[index + 1]))
        elif argument.startswith("--config-dir="):
            directories.append(Path(argument.split("=", 1)[1]))
    return directories


def config_groups(directories: list[Path]) -> dict[str, dict[str, str]]:
    """``{group: {option: description}}`` of every user-facing group in ``directories`` (later ones
    add options; ``hydra`` and ``schema`` groups are left out). A group nested in another
    (``learner/exchange``) is chosen on the command line as ``learner/exchange=NAME``."""
    groups: dict[str, dict[str, str]] = {}
    for directory in directories:
        if not directory.is_dir():
            continue
        for path in sorted([*directory.glob("*/*.yaml"), *directory.glob("*/*/*.yaml")]):
            group = path.parent.relative_to(directory).as_posix()  # nested: "learner/exchange"
            if group.split("/")[0] in _HIDDEN_GROUPS:
                continue
            groups.setdefault(group, {})[path.stem] = describe_option(path)
    return {group: dict(sorted(options.items())) for group, options in sorted(groups.items())}


def describe_option(path: Path) -> str:
    """The first sentence of the prose comment at the top of a config file.

    The header comment is split into paragraphs at empty ``#`` lines; command lines (``python
    -m dtrain ...``, ``mpiexec ...``, and what to run afterwards, ``then: ...``) are skipped and the
    last paragraph is the description (a recipe's header starts with its commands, a group option's
    is a single paragraph).
    """
    paragraphs: list[list[str]] = [[]]
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        if not line.startswith("#"):
            break
        text = line[1:].strip()
        if not text:
            paragraphs.append([])
        elif not (text.startswith("@package") or line[1:].startswith("  ")
                  or re.match(r"(?:(python|mpiexec|torchrun|srun|dtrain)\b|then:)", text)):
            paragraphs[-1].append(text)
    prose = " ".join(next((p for p in reversed(paragraphs) if p), []))
    prose = re.sub(rf"^(?:\w+/)?{re.escape(path.parent.name)}={re.escape(path.stem)}:\s*", "", prose)
    return _first_sentence(prose)


def _first_sentence(text: str) -> str:
    """``text`` up to the first full stop outside parentheses that a space (or the end) follows."""
    depth = 0
    for index, char in enumerate(text):
        depth += {"(": 1, ")": -1}.get(char, 0)
        rest = text[index + 1:]
        if char == "." and depth == 0 and (not rest.strip() or rest[0].isspace()) \
                and not re.search(r"\b(al|e\.g|i\.e|etc)$", text[:index]):
            return text[:index + 1]
    return text


def default_choices(shipped: str | Path) -> dict[str, str]:
    """The option each group defaults to in the root ``config.yaml`` (``{"learner": "data_parallel", ...}``),
    and each nested group's in its parent's default option (``{"learner/exchange": "allreduce"}``)."""
    choices = _defaults_list(Path(shipped) / "config.yaml")
    for group, option in list(choices.items()):
        option_file = Path(shipped) / group / f"{option}.yaml"
        if option_file.is_file():
            choices.update({f"{group}/{nested}": choice for nested, choice in _defaults_list(option_file).items()})
    return choices


def _defaults_list(path: Path) -> dict[str, str]:
    """``group: option`` entries of a config file's defaults list."""
    choices = {}
    for line in path.read_text().splitlines():
        match = re.match(r"\s*-\s*([a-z_]+):\s*([A-Za-z0-9_]+)", line)
        if match:
            choices[match.group(1)] = match.group(2)
    return choices


def nested_group_hint(shipped: str | Path, hydra_message: str, argv: list[str]) -> str | None:
    """For Hydra's "Could not override 'learner/exchange'. No match in the defaults list.": which
    options of the parent group (``learner``) have that nested group, in words; else ``None``."""
    found = re.match(r"Could not override '([\w/]+)/(\w+)'\. No match in the defaults list", hydra_message)
    if not found:
        return None
    parent, nested = found.groups()
    having = sorted(path.stem for path in (Path(shipped) / parent).glob("*.yaml") if nested in _defaults_list(path))
    if not having:
        return None
    chosen = [argument.split("=", 1)[1] for argument in argv if argument.split("=", 1)[0] == parent]
    which = f"{parent}={chosen[-1]}" if chosen else f"the {parent} chosen"
    options = f"{', '.join(having[:-1])} or {having[-1]}" if len(having) > 1 else having[0]
    return f"({which} has no {parent}/{nested}; {parent}/{nested}=NAME goes with {parent}={options})"


#: config groups of which a run may choose several options at once (callbacks=[early_stopping,best_checkpoint])
MULTIPLE_CHOICE_GROUPS = ("callbacks", "logger")


def help_text(shipped: str | Path, argv: list[str]) -> str:
    """The whole ``--help`` text for a command line ``argv`` (its ``--config-dir`` options count)."""
    directories = config_directories(shipped, argv)
    groups = config_groups(directories)
    defaults = default_choices(shipped)
    recipes = groups.pop("recipe", {})
    sections = [_INTRO, "recipes (+recipe=NAME):\n" + _options(recipes, None)]
    group_lines = []
    for group, options in groups.items():
        default = defaults.get(group)
        if group in MULTIPLE_CHOICE_GROUPS:
            heading = f"  {group}=[" + ",".join(options) + "]   (any of them, several at once; default: none)"
        else:
            heading = f"  {group}=" + "|".join(options) + (f"   (default: {default})" if default and len(options) > 1 else "")
        group_lines.append(heading + "\n" + _options(options, default, indent=4))
    sections.append("config groups (group=option picks an option, * marks the default; group.key=value sets a value):\n"
                    + "\n".join(group_lines))
    sections.append("examples:\n" + _EXAMPLES)
    sections.append("read more:\n" + _MORE_HEAD + "\n" + _topic_lines() + "\n" + _MORE_TAIL)
    return "\n\n".join(sections) + "\n"


def _topic_lines() -> str:
    """One line per documentation page: ``    learners            Learners: ...``."""
    topics = help_topics()
    if not topics:
        return "    (no documentation pages found beside this installation)"
    width = max(len(name) for name in topics) + 2
    lines = [f"    {name:<{width}}{title}" for name, title in topics.items()]
    return "\n".join(line if len(line) <= _WIDTH else line[:_WIDTH - 4] + " ..." for line in lines)


def _options(options: dict[str, str], default: str | None, indent: int = 2) -> str:
    width = max((len(name) for name in options), default=0) + 2
    lines = []
    for name, description in options.items():
        marker = "*" if name == default else " "
        head = " " * indent + f"{name:<{width}}{marker} "
        body = textwrap.wrap(description or "(no description)", _WIDTH - len(head)) or [""]
        lines.append(head + body[0])
        lines.extend(" " * len(head) + more for more in body[1:])
    return "\n".join(lines)


__all__ = ["UnknownTopic", "config_directories", "config_groups", "default_choices", "describe_option", "docs_dir",
           "help_text", "help_topic", "help_topics", "nested_group_hint", "version"]
