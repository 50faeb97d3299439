"""Which interface gloo gets across hosts, and how its connection failures are worded
(internals, on purpose: ``gloo_net`` and ``startup`` called directly)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import pytest
from test_hosts import LIMIT_S, _env

from asyncomm._backends import gloo_net, startup
from asyncomm.testing import network

REFUSED = RuntimeError(
    "Gloo connectFullMesh failed with [../third_party/gloo/gloo/transport/tcp/pair.cc:152] "
    "timed out connecting: SO_ERROR: Connection refused, remote=[127.0.0.1]:21930$2")
RESET = RuntimeError("[../gloo/transport/tcp/pair.cc:553] Connection closed by peer "
                     "[10.0.0.2]:40842. This is typically caused by a remote worker crashing.")


def test_a_refused_loopback_connection_says_what_to_set() -> None:
    said = gloo_net.explain(REFUSED, 3)
    assert said is not None
    assert said.startswith("rank 3: gloo dialed 127.0.0.1:21930, a loopback address")
    assert "GLOO_SOCKET_IFNAME" in said


def test_a_refused_routable_connection_names_the_address() -> None:
    refused = RuntimeError(str(REFUSED).replace("127.0.0.1", "10.1.2.3"))
    said = gloo_net.explain(refused, 0)
    assert said is not None and "10.1.2.3:21930" in said and "loopback" not in said


def test_other_errors_are_not_explained() -> None:
    assert gloo_net.explain(RuntimeError("Timed out waiting 1000ms for recv"), 0) is None
    assert gloo_net.explain(ValueError("connect me"), 0) is None


def test_a_lost_connection_names_the_ranks_at_its_address_before_the_advice() -> None:
    said = gloo_net.hosts_named(RESET, {"10.0.0.1": [0, 1], "10.0.0.2": [2, 3]})
    assert said is not None
    assert "peer [10.0.0.2]:40842 (the host of ranks 2, 3). This is typically" in said
    assert gloo_net.hosts_named(RuntimeError(said), {"10.0.0.2": [2, 3]}) is None  # once
    assert gloo_net.hosts_named(RESET, {"10.0.0.9": [5]}) is None
    one = gloo_net.hosts_named(RESET, {"10.0.0.2": [7]})
    assert one is not None and "(the host of rank 7)" in one


@pytest.mark.parametrize("environ", [
    {"GLOO_SOCKET_IFNAME": "eth1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"},
    {"ASYNCOMM_GLOO_IFNAME": "0", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"},
    {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4"},  # one host: loopback is right
    {"WORLD_SIZE": "4"},
])
def test_gloo_keeps_its_default_unless_several_hosts_need_an_interface(
        environ: dict[str, str]) -> None:
    assert gloo_net.choose(environ, "127.0.0.1") is None
    applied = dict(environ)
    assert gloo_net.apply(applied, "127.0.0.1") is None and applied == environ


def test_the_loopback_interface_is_found_by_its_address() -> None:
    assert ("lo", "127.0.0.1") in list(gloo_net.interfaces())
    assert gloo_net.route_to("127.0.0.1") == "127.0.0.1"
    assert gloo_net.interface_of("127.0.0.1") == "lo"
    assert gloo_net.route_to("no-such-host.invalid") is None


def test_failures_to_join_are_said_together_when_they_say_the_same() -> None:
    said = startup._said({2: "gloo dialed 127.0.0.1:1", 3: "gloo dialed 127.0.0.1:1",
                          5: "store timeout"})
    assert said == ("ranks 2, 3 failed to join: gloo dialed 127.0.0.1:1; "
                    "rank 5 failed to join: store timeout")


@pytest.fixture(scope="module")
def net() -> Iterator[network.Network]:
    with network.Network(2) as made:
        yield made


@pytest.mark.skipif(network.missing() is not None, reason=network.missing() or "")
@pytest.mark.timeout(600)
def test_each_host_gives_gloo_the_interface_that_reaches_the_first(net: network.Network) -> None:
    probe = ("from asyncomm._backends import gloo_net; "
             f"c = gloo_net.choose({{'WORLD_SIZE': '4', 'LOCAL_WORLD_SIZE': '2'}}, "
             f"'{net.addresses[0]}'); print(c.interface, c.address)")
    probes = [net.run(host, [sys.executable, "-c", probe], env=_env(), stdout=subprocess.PIPE,
                      stderr=subprocess.PIPE, text=True) for host in range(2)]
    for host, proc in enumerate(probes):
        out, err = proc.communicate(timeout=LIMIT_S)
        assert out.split() == [network.INTERFACE, net.addresses[host]], err
