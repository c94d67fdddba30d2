"""The ranks of one job of a sweep agree on its failure before the sweep goes on to the next job.

A job that fails on every rank at the same point (a bad setting, a refused checkpoint, a loss that
diverged: each found the same way on every rank) can end alone, and the next job starts on every
rank. A failure of one rank alone cannot: the others are inside a collective that will never
complete, so the sweep ends as a single run would. To tell the two apart without a collective
(which a rank stuck in another collective would answer wrongly), every failed rank writes its
failure to the job's rendezvous store, where the heartbeats also live, and waits a bounded time
for every other rank's.
"""
from __future__ import annotations

import datetime
import json
import time

_KEY = "dtrain/job-failure/{rank}"

#: seconds between looks at the store while waiting for the other ranks
_POLL_S = 0.05


def agree_on_failure(comm, message: str, code: int, kind: str, *, secondary: bool = False,
                     timeout_s: float = 60.0) -> tuple[str, int, str] | None:
    """Tells the other ranks that this rank's job failed and waits up to ``timeout_s`` for theirs.

    Args:
        comm: the job's communicator (one with a rendezvous store, ``comm.store_endpoint``).
        message, code, kind: this rank's one-line failure, exit code and ``"failed"``/``"diverged"``.
        secondary: the failure only reports that a peer went away (a broken collective), so
            another rank's failure is the one to report.

    Returns:
        ``(message, code, kind)`` to report for the job, the lowest rank's first-hand failure, when
        every rank failed; ``None`` when some rank did not report within ``timeout_s`` (it is still
        training, or stuck): the caller must then end the whole job.
    """
    endpoint = getattr(comm, "store_endpoint", None)
    if endpoint is None:
        return None
    import torch.distributed as dist

    deadline = time.monotonic() + timeout_s
    keys = [_KEY.format(rank=rank) for rank in range(comm.size)]
    try:
        store = dist.TCPStore(endpoint[0], endpoint[1], is_master=False, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=timeout_s))
        store.set(keys[comm.rank], json.dumps([message, code, kind, secondary]))
        while not store.check(keys):  # polled: the store's own wait logs its timeout as a warning
            if time.monotonic() > deadline:
                return None
            time.sleep(_POLL_S)
        failures = [json.loads(store.get(key)) for key in keys]
    except Exception:  # noqa: BLE001 -- a store that went away (rank 0 ended the job): no agreement
        return None
    first_hand = [failure for failure in failures if not failure[3]] or failures
    message, code, kind, _ = first_hand[0]
    return message, code, kind
