"""The test suite's own layout: helpers come from ``tests.helpers``, never from edits of ``sys.path``,
and every multi-process worker script is launched by a test."""
from __future__ import annotations

import re
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
BENCHMARKS = TESTS.parent / "benchmarks"


def test_no_test_helper_or_worker_edits_sys_path():
    # monkeypatch.syspath_prepend stays allowed: a test putting its own temporary user files where
    # `python -m dtrain` would find them (the working directory), undone when the test ends
    pattern = re.compile(r"sys\.path\.(insert|append|extend)")
    offenders = [f"{path.relative_to(TESTS.parent)}:{number}"
                 for path in sorted([*TESTS.rglob("*.py"), *BENCHMARKS.glob("*.py")])
                 if path != Path(__file__).resolve()
                 for number, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    assert not offenders, f"import shared code from tests.helpers (or dtrain.testing) instead: {offenders}"


def test_every_worker_script_is_launched_by_a_test_module():
    """A worker script is named by a test module of tests/dist (or by the helper that launches it for them)."""
    tests = "\n".join(path.read_text() for path in [*TESTS.glob("dist/test_*.py"), *TESTS.glob("helpers/*.py")])
    unused = [worker.name for worker in sorted(TESTS.glob("dist/_*_worker.py")) if worker.name not in tests]
    assert not unused, unused


def test_test_module_names_are_unique_across_folders():
    """pytest imports test modules by their base name (the folders are not packages): two files of one
    name stop the whole run at collection."""
    names = [path.name for path in TESTS.rglob("test_*.py")]
    assert sorted({name for name in names if names.count(name) > 1}) == []


def test_unit_tests_start_no_command_line_run_and_no_mpiexec():
    """tests/unit holds in-process tests; a test that runs ``python -m dtrain`` or mpiexec belongs in tests/recipes
    or tests/dist, where the suite's slow, process-starting cases are found and budgeted."""
    pattern = re.compile(r"run_dtrain|run_mpi|launch_checks|start_ranks|mpiexec_path|forked_dtrain|\"-m\", \"dtrain\"")
    offenders = [f"{path.relative_to(TESTS.parent)}:{number}"
                 for path in sorted(TESTS.glob("unit/*.py")) if path != Path(__file__).resolve()
                 for number, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    assert not offenders, offenders


def test_the_longest_files_run_first_and_each_file_keeps_its_order(tmp_path, monkeypatch):
    """xdist's loadfile hands out files in this order: the longest first (by the record), a file's tests kept
    in their order, a test missing from the record counted as 0.2 s."""
    from types import SimpleNamespace

    from tests.helpers import durations

    items = [SimpleNamespace(nodeid=n) for n in ("tests/a.py::one", "tests/a.py::two", "tests/b.py::one",
                                                  "tests/c.py::one", "tests/c.py::two", "tests/c.py::three")]
    durations.longest_files_first(items, {"tests/b.py::one": 30.0, "tests/a.py::two": 4.0})
    assert [i.nodeid for i in items] == ["tests/b.py::one", "tests/a.py::one", "tests/a.py::two",
                                         "tests/c.py::one", "tests/c.py::two", "tests/c.py::three"]
    monkeypatch.setattr(durations, "RECORD", tmp_path / "tests" / "durations.json")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "a.py").write_text("def one(): ...\ndef two(): ...\ndef three(x): ...\n")
    durations.RECORD.write_text('{"tests/a.py::one": 9.0, "tests/a.py::two": 3.0, "tests/gone.py::x": 5.0, '
                                '"tests/a.py::renamed[1]": 5.0}')
    durations.record({"tests/a.py::one": 0.1, "tests/a.py::three[2]": 7.04})  # a run of a's tests, one now quick
    assert durations.recorded() == {"tests/a.py::three[2]": 7.0, "tests/a.py::two": 3.0}


def test_the_recorded_durations_name_tests_that_exist():
    """tests/durations.json orders the suite: a record of files that were renamed away orders nothing."""
    from tests.helpers import durations

    record = durations.recorded()
    assert record, "tests/durations.json is missing: pytest --record-durations writes it"
    files = {node.split("::")[0] for node in record}
    assert all((durations.RECORD.parent.parent / name).exists() for name in files), sorted(files)
