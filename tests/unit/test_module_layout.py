"""The package's shape: no import cycles between dtrain's modules (lazy imports inside functions
included), and docstrings cite only what ships with the project or upstream sources."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import dtrain

PACKAGE = Path(dtrain.__file__).resolve().parent
ROOT = PACKAGE.parent


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """dtrain modules ``path`` imports anywhere in it (top level or inside a function)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        found.update(name for name in names if name in modules)
    return found


def test_no_import_cycles_between_modules():
    paths = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    modules = set(paths)
    # a package's __init__ re-exports its modules; only edges between plain modules form a real cycle
    graph = {name: {target for target in imports_of(path, modules) if target in paths
                    and not paths[target].name == "__init__.py"}
             for name, path in paths.items() if path.name != "__init__.py"}
    cycles = []

    def visit(node: str, stack: list[str], done: set[str]) -> None:
        for target in sorted(graph.get(node, ())):
            if target in stack:
                cycles.append(" -> ".join(stack[stack.index(target):] + [target]))
            elif target not in done:
                visit(target, stack + [target], done)
        done.add(node)

    done: set[str] = set()
    for name in sorted(graph):
        if name not in done:
            visit(name, [name], done)
    assert not cycles, cycles


def test_docstrings_cite_the_projects_own_docs_not_unshipped_notes():
    pattern = re.compile(r"reference/|ARCHITECTURE|convention \d")
    offenders = [f"{path.relative_to(ROOT)}:{number}" for folder in ("dtrain", "conf", "recipes", "benchmarks", "tests")
                 for path in (ROOT / folder).rglob("*") if path.suffix in (".py", ".yaml", ".md") and path.is_file()
                 and path.name != Path(__file__).name
                 for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1) if pattern.search(line)]
    assert not offenders, offenders
    cited = {match for path in PACKAGE.rglob("*.py")
             for match in re.findall(r"docs/semantics\.md#([a-z0-9-]+)", path.read_text())}
    anchors = {re.sub(r"[^a-z0-9 -]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
               for line in (ROOT / "docs" / "semantics.md").read_text().splitlines() if line.startswith("#")}
    assert cited and cited <= anchors, sorted(cited - anchors)


def test_compress_is_pure_maths_that_never_talks():
    """``compress/`` (quantizer, bit packing, stripes, PowerSGD's low-rank maths) imports nothing from the
    floors that talk or decide: ``comm/``, ``exchange/``, ``learners/``, ``session/``."""
    modules = {module_name(path) for path in PACKAGE.rglob("*.py")}
    upward = ("dtrain.comm", "dtrain.exchange", "dtrain.learners", "dtrain.session")
    found = {f"{module_name(path)} -> {target}"
             for path in (PACKAGE / "compress").rglob("*.py")
             for target in imports_of(path, modules) if target.startswith(upward)}
    assert not found, sorted(found)


def test_run_files_and_sweep_records_sit_below_the_session():
    """``dtrain.safe_files`` (writing into a shared run directory, never through a link) serves the session,
    the loggers, the sweep's records and ``build`` alike, so it imports no dtrain module; ``sweep/`` sits below
    the session (the session never imports it) and imports nothing from ``session/``."""
    modules = {module_name(path) for path in PACKAGE.rglob("*.py")}
    assert imports_of(PACKAGE / "safe_files.py", modules) == set()
    found = {f"{module_name(path)} -> {target}" for path in (PACKAGE / "sweep").rglob("*.py")
             for target in imports_of(path, modules) if target.startswith("dtrain.session")}
    assert not found, sorted(found)


def test_loggers_and_shipped_callbacks_sit_above_the_session():
    """``loggers/`` (the trackers) and ``callbacks/`` go through the session's callback interface, so the session
    imports nothing from them: the run's own record files (CSV, TensorBoard) are the session's."""
    modules = {module_name(path) for path in PACKAGE.rglob("*.py")}
    found = {f"{module_name(path)} -> {target}" for path in (PACKAGE / "session").rglob("*.py")
             for target in imports_of(path, modules) if target.startswith(("dtrain.loggers", "dtrain.callbacks"))}
    assert not found, sorted(found)


#: modules allowed past :data:`MODULE_LINES`, each with the one sentence that defends it
LONG_MODULES = {
    "dtrain/learners/block.py": "BlockLearner is one state machine (block counting, warm start, sync, outer step and "
                                "their checkpoint) whose methods read and write the same counters; split, one "
                                "invariant would span files",
}
#: the longest a module of the package may be without a sentence in :data:`LONG_MODULES`
MODULE_LINES = 800


def test_no_module_is_longer_than_800_lines_but_those_defended():
    lengths = {str(path.relative_to(ROOT)): len(path.read_text().splitlines()) for path in PACKAGE.rglob("*.py")}
    too_long = {name: lines for name, lines in lengths.items() if lines > MODULE_LINES and name not in LONG_MODULES}
    assert not too_long, f"modules over {MODULE_LINES} lines: {too_long}; split them or defend them in LONG_MODULES"
    stale = [name for name in LONG_MODULES if lengths.get(name, 0) <= MODULE_LINES]
    assert not stale, f"no longer over {MODULE_LINES} lines (or gone), drop them from LONG_MODULES: {stale}"
