"""Where gloo listens: the network interface of a rank's gloo device, across hosts.

Note on interfaces
------------------
docs/several-hosts.md ("gloo's interface") says why and when in full. Unless ``GLOO_SOCKET_IFNAME``
names an interface, torch binds gloo to the address the hostname resolves to, often loopback: across
hosts each rank would advertise a loopback address. So when ``GLOO_SOCKET_IFNAME`` is unset, the
hostname resolves only to loopback (or not at all) and the world spans several hosts
(``MASTER_ADDR`` is not this host's, or the launcher says so), ``choose`` picks the interface whose
address routes to ``MASTER_ADDR`` (the address the kernel would send from; on its own host, the
interface that holds it) and ``apply`` sets ``GLOO_SOCKET_IFNAME`` to it for this process, for
torch's default group and asyncomm's own. ``ASYNCOMM_GLOO_IFNAME=0`` turns the choice off;
``explain`` words a connection that fails anyway.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import re
import socket
import struct
from collections.abc import Iterator, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

_SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address


@dataclass(frozen=True)
class Choice:
    """The interface chosen for gloo, and why."""

    interface: str
    address: str
    reason: str


def choose(environ: Mapping[str, str], master_addr: str) -> Choice | None:
    """Return the interface gloo should use to reach ``master_addr``, or ``None`` to leave it.

    See the note on interfaces for when it leaves it.
    """
    if environ.get("GLOO_SOCKET_IFNAME") or environ.get("ASYNCOMM_GLOO_IFNAME") == "0":
        return None
    hostname = socket.gethostname()
    if not all(_is_loopback(a) for a in _resolve(hostname)):
        return None  # the hostname names a routable address: torch binds to it
    if _is_this_host(master_addr) and not _several_hosts(environ):
        return None  # one host: loopback is right
    source = route_to(master_addr)  # on MASTER_ADDR's own host: MASTER_ADDR itself
    if source is None or _is_loopback(source):
        return None
    interface = interface_of(source)
    if interface is None:
        return None
    return Choice(interface, source, f"the hostname {hostname!r} resolves to loopback only, "
                                     f"and {interface} ({source}) routes to MASTER_ADDR "
                                     f"{master_addr}")


def apply(environ: MutableMapping[str, str], master_addr: str) -> Choice | None:
    """Set ``GLOO_SOCKET_IFNAME`` in ``environ`` if ``choose`` picks an interface; return it."""
    choice = choose(environ, master_addr)
    if choice is not None:
        environ["GLOO_SOCKET_IFNAME"] = choice.interface
    return choice


def own_address(environ: Mapping[str, str]) -> str:
    """Return the address this rank's gloo device binds to (as torch picks it), or ``""``."""
    named = environ.get("GLOO_SOCKET_IFNAME", "").split(",")[0]
    if named:
        return next((address for name, address in interfaces() if name == named), "")
    found = _resolve(socket.gethostname())
    return found[0] if found else ""


def hosts_named(error: BaseException, hosts: Mapping[str, list[int]]) -> str | None:
    """Return ``error``'s words with the ranks at the address it names added, or ``None``.

    gloo names the peer of a failed connection by address (``[10.0.0.2]:41000``);
    the ranks there are what a user needs to know.
    """
    text = str(error)
    found = re.search(r"\[([^\]]+)\]:\d+", text)
    ranks = hosts.get(found.group(1)) if found is not None else None
    if found is None or not ranks or "(the host of rank" in text:
        return None
    said = f" (the host of rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))})"
    return text[:found.end()] + said + text[found.end():]  # before any advice, which is cut


def ranks_by_address(store: Any, size: int) -> dict[str, list[int]]:
    """Return the ranks at each gloo address, from ``store`` (every rank set its own before
    joining, as ``address/{rank}``); empty if the store cannot say."""
    try:
        addresses = store.multi_get([f"address/{r}" for r in range(size)])
    except (RuntimeError, AttributeError):
        return {}  # errors will name addresses only
    hosts: dict[str, list[int]] = {}
    for rank, address in enumerate(addresses):
        if address:
            hosts.setdefault(address.decode(), []).append(rank)
    return hosts


def route_to(host: str) -> str | None:
    """Return the local address the kernel sends from to reach ``host``, or ``None``.

    A connected UDP socket sends nothing: connecting only picks the route.
    """
    for family, address in _addresses(host):
        with contextlib.suppress(OSError), socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((address, 9))
            source: str = probe.getsockname()[0]
            return source
    return None


def interface_of(address: str) -> str | None:
    """Return the name of the interface that holds ``address``, or ``None``."""
    return next((name for name, held in interfaces() if held == address), None)


def interfaces() -> Iterator[tuple[str, str]]:
    """Yield (interface name, address) for this host's IPv4 and IPv6 addresses (Linux)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                answer = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, request)
            except OSError:
                continue  # no IPv4 address
            yield name, socket.inet_ntoa(answer[20:24])
    with contextlib.suppress(OSError), open("/proc/net/if_inet6") as table:
        for line in table:
            fields = line.split()
            if len(fields) >= 6:
                yield fields[5], str(ipaddress.IPv6Address(bytes.fromhex(fields[0])))


def explain(error: BaseException, rank: int) -> str | None:
    """Say what a gloo connection failure means and how to fix it; ``None`` if it is not one."""
    text = str(error)
    if "connect" not in text.lower():
        return None
    found = re.search(r"remote=\[([^\]]+)\]:(\d+)", text)
    if found is None:
        return None
    address, port = found.group(1), found.group(2)
    advice = ("set GLOO_SOCKET_IFNAME to the interface that reaches the other hosts "
              "(the same name on every host), or make each host's name resolve to its "
              "routable address")
    if _is_loopback(address):
        return (f"rank {rank}: gloo dialed {address}:{port}, a loopback address: a rank on "
                f"another host advertised its own loopback address (its hostname resolves "
                f"to it); {advice}")
    return f"rank {rank}: gloo could not connect to {address}:{port}; {advice}"


def _several_hosts(environ: Mapping[str, str]) -> bool:
    """Whether the launcher says that the world spans several hosts (torchrun, Slurm)."""
    try:
        local, world = environ.get("LOCAL_WORLD_SIZE"), environ.get("WORLD_SIZE")
        if local and world and int(local) < int(world):
            return True
        return int(environ.get("SLURM_NNODES") or environ.get("SLURM_JOB_NUM_NODES") or 1) > 1
    except ValueError:
        return False


def _resolve(host: str) -> list[str]:
    return [address for _, address in _addresses(host)]


def _addresses(host: str) -> list[tuple[socket.AddressFamily, str]]:
    try:
        found = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return []
    return [(family, str(sockaddr[0])) for family, _, _, _, sockaddr in found]


def _is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address.split("%")[0]).is_loopback
    except ValueError:
        return False


def _is_this_host(host: str) -> bool:
    """Whether ``host`` is a loopback address or an address of one of this host's interfaces."""
    found = _resolve(host)
    if not found:
        return False
    mine = {address for _, address in interfaces()}
    return all(_is_loopback(a) or a in mine for a in found)
