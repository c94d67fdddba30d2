"""What the benchmarks read from a finished ``python -m dtrain`` run: the records of its ``metrics.jsonl``
and its ``config.yaml``, so that a change of the console's wording cannot silently change a figure.

The few figures that no record holds (the bytes a rank sent over the whole run: the records carry only
the last step's) are read from the run's summary with one narrow pattern each, which exits with one
line naming what it looked for when the line is not there.
"""
from __future__ import annotations

import re
from pathlib import Path


def run_records(run_dir: Path) -> list[dict]:
    """Every record of ``run_dir/metrics.jsonl``, in order; exits with one line when the file is missing or damaged."""
    from dtrain.session.metrics import read_records

    path = Path(run_dir) / "metrics.jsonl"
    records, damage = read_records(path)
    if damage is not None or not records:
        raise SystemExit(f"{path}: {damage or 'no records'}; expected the metric records of a finished run")
    return records


def last_record(records: list[dict], kind: str) -> dict:
    """The last record of ``kind`` (train, cv, test, test_ema); exits with one line when the run wrote none."""
    found = [record for record in records if record.get("kind") == kind]
    if not found:
        kinds = sorted({str(record.get("kind")) for record in records})
        raise SystemExit(f"no {kind!r} record in the run's metrics.jsonl (it has: {', '.join(kinds)})")
    return found[-1]


def value(record: dict, key: str, scale: float = 1.0) -> float:
    """``record[key] * scale`` (100: a rate as a percentage); exits with one line when the record lacks ``key``."""
    if key not in record:
        raise SystemExit(f"the {record.get('kind')!r} record at {record.get('samples')} samples has no {key!r} "
                         f"(it has: {', '.join(record)})")
    return float(record[key]) * scale


def training_rate(records: list[dict]) -> float:
    """Samples/s of the training loop: the last training record's samples over the sum of every training
    period's ``period_s`` (the loop's wall time, evaluations along the way included; the final test is not)."""
    periods = [record for record in records if record.get("kind") == "train"]
    if not periods:
        raise SystemExit("no 'train' record in the run's metrics.jsonl: set session.progress_frequency above 0")
    return periods[-1]["samples"] / sum(value(record, "period_s") for record in periods)


def lr_scaling_text(run_dir: Path) -> str:
    """``0.05 x 16 = 0.8 (linear)``: the run's optimizer.lr, its ``session.lr_scaling`` factor and the scaled lr,
    from the run's ``config.yaml`` as dtrain computes them; ``""`` when the run scales nothing."""
    from omegaconf import OmegaConf

    from dtrain.session.from_settings import lr_scaling

    config = OmegaConf.load(Path(run_dir) / "config.yaml")
    scaling = lr_scaling(config.session)
    if scaling is None:
        return ""
    lr = float(config.optimizer.lr)
    return f"{lr:g} x {scaling.factor:.4g} = {lr * scaling.factor:.4g} ({scaling.rule})"


#: the summary's line of the bytes rank 0 sent over the whole job (metrics.jsonl holds each period's last step only)
_SENT = re.compile(r"^exchange: rank 0 sent ([\d,]+\.\d) MB to the other ranks", re.MULTILINE)


def megabytes_sent(output: str) -> float:
    """The megabytes rank 0 sent over the whole run, from the summary of a run of two or more ranks."""
    found = _SENT.search(output)
    if found is None:
        raise SystemExit(f"no {_SENT.pattern!r} line in the run's output: expected the summary of a finished run "
                         f"of two or more ranks whose learner counts its bytes")
    return float(found.group(1).replace(",", ""))
