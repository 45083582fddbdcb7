"""Multi-node networking, settled by each node's launcher before any rank starts.

The most common first failure of a multi-node job is the interface: gloo and NCCL advertise the
address their hostname resolves to, which on many machines is a loopback address (Debian's
`127.0.1.1 <hostname>`), so the peers cannot connect ("Gloo connectFullMesh failed ...
Connection refused, remote=[127.0.1.1]"). The kernel knows the right interface: the one whose
address it would use as the source of a packet to MASTER_ADDR. So, unless the user set them,
GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME are set to that interface for the ranks.

Before the ranks start, node 0 checks that it can listen on MASTER_ADDR:MASTER_PORT (the
rendezvous store runs there) and every other node that it can reach it; either failure is one
message naming the address, the port and the interface. No torch here: the launcher stays light.
"""

from __future__ import annotations

import errno
import socket
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass

import psutil

from ae.errors import UserError

SOCKET_IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
# A node that answers "connection refused" is up, its store not yet: torchrun waits for it.
_WAIT_ERRNOS = {errno.ECONNREFUSED}
CONNECT_TIMEOUT_S = 8.0  # no answer from MASTER_ADDR within this: unreachable


class NetworkError(UserError):
    """MASTER_ADDR cannot be resolved, routed, reached or (on node 0) listened on."""


@dataclass(frozen=True)
class Route:
    """How this host reaches MASTER_ADDR: the address it resolves to, the source address the
    kernel picks, and the interface that holds that source address."""

    master_ip: str
    source_ip: str
    interface: str


def route_to(master_addr: str, port: int) -> Route:
    """The kernel's own answer: connecting a UDP socket sends nothing, but picks the route."""
    try:
        master_ip = socket.gethostbyname(master_addr)
    except OSError as e:
        raise NetworkError(f"MASTER_ADDR: cannot resolve {master_addr!r}: {e}") from None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((master_ip, port))
        except OSError as e:
            raise NetworkError(
                f"MASTER_ADDR: no route from this host to {master_addr} ({master_ip}): "
                f"{e.strerror or e}"
            ) from None
        source_ip = s.getsockname()[0]
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == source_ip for a in addrs):
            return Route(master_ip, source_ip, name)
    raise NetworkError(f"MASTER_ADDR: the route to {master_ip} leaves from {source_ip}, which "
                       "no interface of this host holds")  # fmt: skip


def socket_env(env: Mapping[str, str], route: Route) -> dict[str, str]:
    """The interface variables to set for the ranks: those the user left unset."""
    return {var: route.interface for var in SOCKET_IFNAME_VARS if not env.get(var)}


def is_local_address(ip: str) -> bool:
    return any(
        a.family == socket.AF_INET and a.address == ip
        for addrs in psutil.net_if_addrs().values()
        for a in addrs
    )


def check_master(route: Route, port: int, node_rank: int, *, hosts_store: bool) -> None:
    """Node 0 holds MASTER_ADDR. The process that will host the rendezvous store (`hosts_store`:
    the job's leader) can listen on the port; every other one -- other nodes, and under SLURM's
    one-task-per-process layout node 0's other tasks, whose leader may already listen there --
    can reach it (a refusal means node 0 is up and its store not yet, which the ranks wait for);
    no answer within CONNECT_TIMEOUT_S, or no route, is an error."""
    where = f"{route.master_ip}:{port} (interface {route.interface}, source {route.source_ip})"
    if node_rank == 0 and not is_local_address(route.master_ip):
        raise NetworkError(
            f"MASTER_ADDR: {route.master_ip} is not an address of this host, but node 0 "
            "runs the rendezvous store there: set MASTER_ADDR to this node's address"
        )
    if hosts_store:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            # As the store itself binds: a port that an earlier run left in TIME_WAIT (a quick
            # re-launch, a SLURM requeue with the same job-derived port) is free; a listener is not.
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((route.master_ip, port))
                s.listen()
            except OSError as e:
                raise NetworkError(
                    f"MASTER_PORT: node 0 cannot listen on {where}: {e.strerror or e}"
                ) from None
        return
    try:
        with socket.create_connection((route.master_ip, port), timeout=CONNECT_TIMEOUT_S):
            return
    except OSError as e:
        if e.errno in _WAIT_ERRNOS:
            return
        reason = "no answer" if isinstance(e, TimeoutError) else (e.strerror or str(e))
        raise NetworkError(
            f"MASTER_ADDR: node {node_rank} cannot reach {where}: {reason}"
        ) from None


def prepare_node(
    env: MutableMapping[str, str], master_addr: str, port: int, node_rank: int, *, hosts_store: bool
) -> str:
    """Check this node's path to the master, set the ranks' interface variables in `env` (those
    the user left unset), and return the line saying what was chosen."""
    route = route_to(master_addr, port)
    check_master(route, port, node_rank, hosts_store=hosts_store)
    chosen = socket_env(env, route)
    env.update(chosen)
    kept = [f"{v}={env[v]} (yours)" for v in SOCKET_IFNAME_VARS if v not in chosen]
    return (
        f"Network: node {node_rank} reaches MASTER_ADDR {master_addr}:{port} via interface "
        f"{route.interface} ({route.source_ip}); "
        + ", ".join([*(f"{v}={i}" for v, i in chosen.items()), *kept])
    )
