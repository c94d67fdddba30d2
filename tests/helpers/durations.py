"""The longest test files first: what each test took in a recorded run, and the order that follows from it.

``pytest -n 2 --dist loadfile`` hands each worker a whole file at a time, in collection order, so a long
file collected last runs alone at the end while the other worker idles. Ordering the files longest first
(by the recorded seconds of the tests this run selected) keeps both workers busy to the end. The record,
``tests/durations.json``, is per test (``{node id: seconds}``, setup and teardown included) and is
refreshed by running the suites with ``--record-durations`` (docs/development.md); a test it does not
know counts as :data:`UNKNOWN_SECONDS`, so a new long file runs late until the record is refreshed.
"""
from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

#: where the recorded seconds per test live
RECORD = Path(__file__).resolve().parents[1] / "durations.json"
#: what a test missing from the record counts as (most are quicker than SMALLEST_RECORDED)
UNKNOWN_SECONDS = 0.2
#: tests quicker than this are not recorded (they count as UNKNOWN_SECONDS: the record stays small)
SMALLEST_RECORDED = 0.5


def recorded() -> dict[str, float]:
    """``{node id: seconds}`` of the last recorded run; empty without a record."""
    try:
        return json.loads(RECORD.read_text())
    except FileNotFoundError:
        return {}


def longest_files_first(items: list, seconds: dict[str, float]) -> None:
    """Sorts ``items`` (pytest's, in place) by their file's recorded seconds, longest first; tests keep their
    order within a file, so module fixtures and the order a file's tests rely on are unchanged."""
    per_file: dict[str, float] = defaultdict(float)
    for item in items:
        per_file[_file(item.nodeid)] += seconds.get(item.nodeid, UNKNOWN_SECONDS)
    items.sort(key=lambda item: -per_file[_file(item.nodeid)])


def record(measured: dict[str, float]) -> None:
    """Merges ``measured`` (``{node id: seconds}`` of this run) into the record: a default run and a slow run
    each update their own tests. Quick tests are dropped, as are tests whose file or function is gone."""
    merged = {**recorded(), **measured}
    kept = {node: round(value, 1) for node, value in sorted(merged.items())
            if value >= SMALLEST_RECORDED and _exists(node)}
    RECORD.write_text(json.dumps(kept, indent=0) + "\n")


def _file(node_id: str) -> str:
    return node_id.split("::", 1)[0]


def _exists(node_id: str) -> bool:
    """Whether the test's file exists and still defines its function (a renamed test's entry is dropped)."""
    path = RECORD.parent.parent / _file(node_id)
    function = node_id.rsplit("::", 1)[-1].split("[", 1)[0]
    return path.is_file() and f"def {function}(" in path.read_text()
