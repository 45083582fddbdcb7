"""The launcher's network checks before the ranks start (ae/job/network.py), on this machine's
loopback: the interface chosen, the user's own setting kept, node 0's port and address."""

from __future__ import annotations

import socket

import pytest

from ae.job.network import NetworkError, Route, check_master, prepare_node, route_to


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_interface_that_routes_to_the_master_is_set_for_both_libraries() -> None:
    port = free_port()
    route = route_to("localhost", port)
    assert route == Route("127.0.0.1", "127.0.0.1", "lo")
    env: dict[str, str] = {}
    # refused: node 0 is not up yet, which is fine
    line = prepare_node(env, "127.0.0.1", port, node_rank=1, hosts_store=False)
    assert env == {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}
    assert f"node 1 reaches MASTER_ADDR 127.0.0.1:{port} via interface lo (127.0.0.1)" in line


def test_the_users_own_setting_wins() -> None:
    env = {"NCCL_SOCKET_IFNAME": "ib0"}
    line = prepare_node(env, "127.0.0.1", free_port(), node_rank=0, hosts_store=True)
    assert env == {"NCCL_SOCKET_IFNAME": "ib0", "GLOO_SOCKET_IFNAME": "lo"}
    assert "GLOO_SOCKET_IFNAME=lo, NCCL_SOCKET_IFNAME=ib0 (yours)" in line


def test_node_0_must_be_able_to_listen_on_the_master_port() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(NetworkError, match=rf"node 0 cannot listen on 127\.0\.0\.1:{port} "
                                               r"\(interface lo"):  # fmt: skip
            prepare_node({}, "127.0.0.1", port, node_rank=0, hosts_store=True)


def test_node_0_must_hold_the_master_address() -> None:
    route = Route("192.0.2.7", "127.0.0.1", "lo")  # TEST-NET-1: no host's address
    with pytest.raises(NetworkError, match=r"192\.0\.2\.7 is not an address of this host"):
        check_master(route, free_port(), node_rank=0, hosts_store=True)


def test_a_port_left_in_time_wait_by_an_earlier_run_is_free_for_node_0() -> None:
    """A quick re-launch (or a SLURM requeue: the port comes from the job id) finds the earlier
    store's connections in TIME_WAIT; the store binds with SO_REUSEADDR, and so does the check."""
    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as c10d's TCPStore listens
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        conn, _ = server.accept()
        conn.close()  # the store's side closes first: its port is left in TIME_WAIT
        client.close()
    prepare_node({}, "127.0.0.1", port, node_rank=0, hosts_store=True)


def test_node_0s_other_tasks_only_check_that_the_leaders_store_answers() -> None:
    """SLURM, one task per process: every task on node 0 has node rank 0, but only the leader
    hosts the store; a task that starts after it finds the port taken, and that is fine."""
    with socket.socket() as store:
        store.bind(("127.0.0.1", 0))
        store.listen()
        port = store.getsockname()[1]
        line = prepare_node({}, "127.0.0.1", port, node_rank=0, hosts_store=False)
    assert f"node 0 reaches MASTER_ADDR 127.0.0.1:{port}" in line
