"""An elastic run's heals, commits and discards as ``metrics.jsonl`` records (``docs/fault-tolerance.md``)."""
from __future__ import annotations

from dtrain.session.metrics import MetricsWriter


class ElasticRecords:
    """An elastic run's heals, commits (with their groups) and discards as ``metrics.jsonl`` records of kind
    ``elastic``: those before the writer existed (a joiner heals at start-up), then each as it comes."""

    def __init__(self, groups, metrics: MetricsWriter, learner):
        self.groups, self.metrics, self.learner = groups, metrics, learner
        for event, facts in list(groups.unrecorded):
            self.record(event, facts)
        groups.listeners.append(self.record)

    def record(self, event: str, facts: dict) -> None:
        """Writes one event's record (``facts``: its groups, members, block samples, seconds, samples seen)."""
        self.groups.unrecorded.clear()  # recorded here
        samples = facts.get("samples_seen")
        self.metrics.write("elastic", int(self.learner.samples_seen if samples is None else samples), event=event,
                           groups=facts["groups"], members=facts["members"], block_samples=facts["samples"],
                           seconds=round(facts["seconds"], 4))

    def detach(self) -> None:
        """Stops recording (the run ended)."""
        self.groups.listeners.remove(self.record)


__all__ = ["ElasticRecords"]
