"""The launcher's network checks before the ranks start (ae/cli/network.py), on this machine's
loopback: the interface chosen, the user's own setting kept, node 0's port and address."""

from __future__ import annotations

import socket

import pytest

from ae.cli.network import NetworkError, Route, check_master, prepare_node, route_to


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_interface_that_routes_to_the_master_is_set_for_both_libraries() -> None:
    port = free_port()
    route = route_to("localhost", port)
    assert route == Route("127.0.0.1", "127.0.0.1", "lo")
    env: dict[str, str] = {}
    line = prepare_node(env, "127.0.0.1", port, node_rank=1)  # refused: node 0 not up yet, fine
    assert env == {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}
    assert f"node 1 reaches MASTER_ADDR 127.0.0.1:{port} via interface lo (127.0.0.1)" in line


def test_the_users_own_setting_wins() -> None:
    env = {"NCCL_SOCKET_IFNAME": "ib0"}
    line = prepare_node(env, "127.0.0.1", free_port(), node_rank=0)
    assert env == {"NCCL_SOCKET_IFNAME": "ib0", "GLOO_SOCKET_IFNAME": "lo"}
    assert "GLOO_SOCKET_IFNAME=lo, NCCL_SOCKET_IFNAME=ib0 (yours)" in line


def test_node_0_must_be_able_to_listen_on_the_master_port() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(NetworkError, match=rf"node 0 cannot listen on 127\.0\.0\.1:{port} "
                                               r"\(interface lo"):  # fmt: skip
            prepare_node({}, "127.0.0.1", port, node_rank=0)


def test_node_0_must_hold_the_master_address() -> None:
    route = Route("192.0.2.7", "127.0.0.1", "lo")  # TEST-NET-1: no host's address
    with pytest.raises(NetworkError, match=r"192\.0\.2\.7 is not an address of this host"):
        check_master(route, free_port(), node_rank=0)
