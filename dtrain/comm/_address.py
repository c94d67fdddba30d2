"""Choosing the rendezvous address that rank 0 announces to the other ranks."""
from __future__ import annotations

import ipaddress
import socket

LOOPBACK = "127.0.0.1"
_PROBE_ADDRESS = "192.0.2.1"  # TEST-NET-1: only used to ask the kernel for a route; no packet is sent


def choose_master_addr(*, single_node: bool, override: str | None = None, peer_host: str | None = None) -> str:
    """Return the address rank 0's rendezvous store should be reached at.

    ``override`` (from ``DTRAIN_MASTER_ADDR``/``MASTER_ADDR``) wins; a job on one node
    uses loopback, which needs no name service and no open firewall; otherwise
    :func:`outward_address` towards ``peer_host`` (a host running another rank).
    """
    if override:
        return override
    if single_node:
        return LOOPBACK
    return outward_address(peer_host)


def outward_address(peer_host: str | None = None) -> str:
    """Return this host's IPv4 address as seen from other nodes (never a loopback address).

    Tries, in order: the source address the kernel would use to reach ``peer_host``;
    a non-loopback address the host name resolves to (``/etc/hosts`` often maps it to
    ``127.0.1.1``, which other nodes cannot use); the source address of the default
    route; the fully qualified host name if it resolves.

    Raises:
        RuntimeError: none of these gives a reachable address (set ``DTRAIN_MASTER_ADDR``).
    """
    if peer_host:
        address = _route_source(peer_host)
        if address:
            return address
    address = _non_loopback_address(socket.gethostname())
    if address:
        return address
    address = _route_source(_PROBE_ADDRESS)
    if address is None:
        fqdn = socket.getfqdn()
        address = fqdn if _non_loopback_address(fqdn) else None  # the name, not its address, as a last resort
    if address is None:
        raise RuntimeError(
            f"cannot find an address of this node ({socket.gethostname()}) that the other nodes can reach: no route "
            f"to them and the host name does not resolve; set DTRAIN_MASTER_ADDR to this node's IP on the network "
            f"the ranks share")
    return address


def _non_loopback_address(name: str) -> str | None:
    """The first non-loopback IPv4 address ``name`` resolves to, or None (rank 0 would wait on it in vain)."""
    try:
        infos = socket.getaddrinfo(name, None, socket.AF_INET, socket.SOCK_STREAM)
    except OSError:
        return None
    for *_, sockaddr in infos:
        if not ipaddress.ip_address(sockaddr[0]).is_loopback:
            return sockaddr[0]
    return None


def _route_source(host: str) -> str | None:
    """The local IPv4 address used to send to ``host`` (a UDP connect sends nothing), or None."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, 9))
            address = probe.getsockname()[0]
    except OSError:
        return None
    return None if ipaddress.ip_address(address).is_loopback else address
