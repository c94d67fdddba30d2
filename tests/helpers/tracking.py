"""Reading back what the W&B and MLflow loggers wrote, with no server: W&B's offline ``.wandb`` files and an
MLflow file store."""
from __future__ import annotations

import os
import struct
from pathlib import Path

#: a .wandb file: a 7-byte header (":W&B", magic, version), then LevelDB-log blocks of records
_HEADER, _BLOCK, _RECORD_HEADER = 7, 32768, 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def wandb_records(path: Path) -> list:
    """The protobuf ``Record``s of one offline run file (``run-<id>.wandb``), in order."""
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a .wandb file"
    records, pending, offset = [], b"", _HEADER
    while offset + _RECORD_HEADER <= len(data):
        left_in_block = _BLOCK - offset % _BLOCK
        if left_in_block < _RECORD_HEADER:  # the block's tail is padding
            offset += left_in_block
            continue
        _checksum, length, kind = struct.unpack("<IHB", data[offset:offset + _RECORD_HEADER])
        if kind == 0 and length == 0:
            break
        chunk = data[offset + _RECORD_HEADER:offset + _RECORD_HEADER + length]
        offset += _RECORD_HEADER + length
        pending = chunk if kind in (_FULL, _FIRST) else pending + chunk
        if kind in (_FULL, _LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def wandb_offline_runs(directory: Path) -> list[Path]:
    """The ``.wandb`` files of every offline run under ``directory/wandb``, oldest first."""
    return sorted((Path(directory) / "wandb").glob("offline-run-*/run-*.wandb"))


def wandb_history(path: Path) -> list[dict]:
    """Each ``run.log`` of a .wandb file as ``{"_step": ..., key: value}``."""
    import json

    rows = []
    for record in wandb_records(path):
        if record.WhichOneof("record_type") == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            if record.history.HasField("step"):
                row["_step"] = record.history.step.num
            rows.append(row)
    return rows


def wandb_run_facts(path: Path) -> dict:
    """The run record of a .wandb file (id, project, group, config) and its end (exit code, artifacts)."""
    import json

    facts = {"artifacts": [], "exit_code": None, "preempting": False}
    for record in wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run = record.run
            facts.update(id=run.run_id, project=run.project, group=run.run_group, name=run.display_name,
                         config={item.key: json.loads(item.value_json) for item in run.config.update})
        elif kind == "artifact":
            facts["artifacts"].append(sorted(entry.path for entry in record.artifact.manifest.contents))
        elif kind == "exit":
            facts["exit_code"] = record.exit.exit_code
        elif kind == "preempting":
            facts["preempting"] = True
    return facts


def mlflow_client(uri: str):
    """An MlflowClient of a file store (allowed for this process, as the logger allows it)."""
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    return MlflowClient(uri)


def mlflow_runs(uri: str) -> list:
    """Every run of every experiment in the store at ``uri``."""
    client = mlflow_client(uri)
    experiments = [experiment.experiment_id for experiment in client.search_experiments()]
    return list(client.search_runs(experiments))


def mlflow_steps(uri: str, run_id: str, key: str) -> list[tuple[int, float]]:
    """``(step, value)`` of a metric's history, in the order logged."""
    return [(metric.step, metric.value) for metric in mlflow_client(uri).get_metric_history(run_id, key)]
