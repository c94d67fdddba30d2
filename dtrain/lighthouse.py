"""The coordinator of an elastic job: torchft's Lighthouse, with settings that suit syncs of a block learner.

``python -m dtrain.lighthouse [--port 29510] [--min-groups 1] [--heartbeat-timeout-s 2] [--join-timeout-s 1]``
starts torchft's ``LighthouseServer`` and prints its address (``http://HOST:PORT``), the value of every group's
``fault_tolerance.lighthouse``. It runs until interrupted (SIGINT or SIGTERM). It is a single point of failure:
while it is down no round can form, so the groups wait at their next sync until ``fault_tolerance.quorum_timeout_s``
(``docs/fault-tolerance.md``). torchft's own ``torchft_lighthouse`` serves as well.
"""
from __future__ import annotations

import argparse
import signal
import socket
import sys
import threading


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dtrain.lighthouse", description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=29510, help="port to listen on (0: any free one)")
    parser.add_argument("--min-groups", type=int, default=1, help="groups a quorum needs at least")
    parser.add_argument("--heartbeat-timeout-s", type=float, default=2.0,
                        help="a group silent this long is lost (the survivors' next round goes on without it)")
    parser.add_argument("--join-timeout-s", type=float, default=1.0,
                        help="how long a round waits for groups that are alive but not yet at the sync")
    args = parser.parse_args(argv)
    if args.min_groups < 1 or args.heartbeat_timeout_s <= 0 or args.join_timeout_s < 0 or args.port < 0:
        print("dtrain.lighthouse: expected --min-groups >= 1, --heartbeat-timeout-s > 0, --join-timeout-s >= 0 and "
              "--port >= 0", file=sys.stderr)
        return 2
    try:
        from torchft.coordination import LighthouseServer
    except ImportError as error:
        print(f"dtrain.lighthouse: needs torchft ({error}); install it with pip install \"dtrain[ft]\"",
              file=sys.stderr)
        return 2
    server = LighthouseServer(bind=f"[::]:{args.port}", min_replicas=args.min_groups,
                              join_timeout_ms=int(args.join_timeout_s * 1000), quorum_tick_ms=50,
                              heartbeat_timeout_ms=int(args.heartbeat_timeout_s * 1000))
    port = server.address().rsplit(":", 1)[1]
    print(f"dtrain: lighthouse at http://{socket.gethostname()}:{port} (min groups {args.min_groups}, a group "
          f"silent {args.heartbeat_timeout_s:g} s is lost)", flush=True)
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    stop.wait()
    server.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
