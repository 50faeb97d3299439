"""What every rank is doing, asked without the communicator that is stuck.

When a collective times out, or any operation stalls, the error (or warning) says what the
other ranks were doing at that moment: ``rank 1: broadcast #1 pending for 10.0 s``, ``rank
2: finished (closed this communicator)``.

Note on the side channel
------------------------
Each process serves the state of its communicators on a small TCP server run by its own
event loop: one listening socket, no thread, nothing done until a question comes. The
addresses are gathered once, when a world is joined, on asyncomm's private twin
communicator (the user's is never involved). A question names a communicator by its label,
the same on every member (``w1``, ``w1.2``: the second group split from the first world
this process joined); the answer lists the operations it has pending, oldest first, and
the last one it issued. What a rank's own router already knows is not asked: a peer that
said goodbye has finished, a peer found dead has failed. A rank whose loop is blocked, or
whose process is gone, does not answer within ``ANSWER_S``, and is said to. The server
listens on the address the ranks reach each other by: the one of ``GLOO_SOCKET_IFNAME``
when set, else the local address that routes to ``MASTER_ADDR`` when that is not this
host, else loopback (``ASYNCOMM_STATUS_HOST`` overrides).

Note on failure notices
-----------------------
The same server hears who failed (``tell``): a rank whose program raised, before it leaves
(answered once heard: it leaves only after its peers know), or the launcher, of a rank whose
process died. The listeners (``on_failure``: the communicators) fail what needs that rank,
naming it and why, before a broken connection or a probe would say less.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import re
import socket
import struct
import sys
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from asyncomm._core import settings

ANSWER_S = 1.0  # how long a rank has to answer
# ``ask``'s answer where a rank took the question but gave no answer in time: it is there,
# its event loop held (a blocking call), not gone
HELD: dict[str, Any] = {"state": "held"}
_REQUEST = b"asyncomm-status 1 "
# then JSON: [world label, rank, what it did, when (epoch s), whether its process is gone]
_NOTICE = b"asyncomm-failed 1 "
# A rank's lines to ``asyncomm run`` (which shows none of them): when it failed (epoch s),
# where it answers (world label, host:port)
FAILED_AT, SERVES_AT = "asyncomm-failed-at ", "asyncomm-serves-at "
_SHOWN = 3  # pending operations named per rank


Reporter = Callable[[], dict[str, Any]]  # a communicator's state (``Comm._status``)
_reporters: dict[str, weakref.WeakMethod[Reporter]] = {}
_servers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, str] = weakref.WeakKeyDictionary()
_listeners: list[weakref.WeakMethod[Callable[[str, int, str, bool], None]]] = []
failed: set[tuple[str, int]] = set()  # (world label, rank) of each failure told or heard
ending = False  # this process's program ended after a peer's failure; it waits to be ended


def register(label: str, reporter: Reporter) -> None:
    """Answer questions about the communicator ``label`` with ``reporter()`` (a bound
    method, held weakly)."""
    _reporters[label] = weakref.WeakMethod(reporter)


async def serve() -> str:
    """Start this loop's status server (once); return its ``host:port``."""
    loop = asyncio.get_running_loop()
    address = _servers.get(loop)
    if address is None:
        address = ""  # none: peers are told this rank gives no answer
        for host in dict.fromkeys((_bind_host(), "127.0.0.1")):
            try:
                server = await asyncio.start_server(_answer, host, 0)
            except OSError:
                continue
            address = f"{host}:{server.sockets[0].getsockname()[1]}"
            break
        _servers[loop] = address
    return address


def to_launcher(line: str) -> None:  # (on stderr, where ``asyncomm run`` started this rank)
    if settings.read().launched:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()


def on_failure(listener: Callable[[str, int, str, bool], None]) -> None:
    """Call ``listener(world, rank, what, gone)`` (a bound method, held weakly) for each
    notice."""
    _listeners.append(weakref.WeakMethod(listener))


def heard(world: str, rank: int, what: str, when: float, gone: bool) -> None:
    """Take a failure notice: note it, and tell the listeners."""
    failed.add((world, rank))
    for ref in list(_listeners):
        listener = ref()
        if listener is None:
            _listeners.remove(ref)
        else:
            listener(world, rank, what, gone)


async def tell(addresses: Iterable[str], world: str, rank: int, what: str, when: float,
               gone: bool = False) -> None:
    """Tell every rank at ``addresses`` that ``rank`` of ``world`` failed (its process
    ``gone``, or still leaving); return once each has heard (or not within ``ANSWER_S``)."""
    notice = _NOTICE + json.dumps([world, rank, what, when, gone]).encode() + b"\n"
    await asyncio.gather(*(_exchange(address, notice) for address in addresses))


async def ended(addresses: Iterable[str], world: str, limit: float) -> None:
    """Return once each rank at ``addresses`` ended its program (or is gone), or at ``limit``.

    A rank that cannot answer but is there (``HELD``: its loop held by a blocking call, a
    checkpoint saved with ``torch.save``) has not ended."""
    waiting, deadline = list(addresses), time.monotonic() + limit
    while waiting and time.monotonic() < deadline:
        states = await asyncio.gather(*(ask(a, world) for a in waiting))
        waiting = [a for a, state in zip(waiting, states, strict=True) if state is HELD or (
            state is not None and state.get("state") == "open" and not state.get("ending"))]
        if waiting:
            await asyncio.sleep(0.1)


async def _answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        line = await asyncio.wait_for(reader.readline(), ANSWER_S)
        state: dict[str, Any] = {"state": "unknown", "ending": ending}
        if line.startswith(_NOTICE):
            world, rank, what, when, gone = json.loads(line[len(_NOTICE):])
            heard(str(world), int(rank), str(what), float(when), bool(gone))
        elif line.startswith(_REQUEST):
            ref = _reporters.get(line[len(_REQUEST):].strip().decode(errors="replace"))
            reporter = ref() if ref is not None else None
            if reporter is not None:
                state = {**reporter(), "ending": ending}
        writer.write(json.dumps(state).encode() + b"\n")
        await writer.drain()
    except (OSError, asyncio.TimeoutError, asyncio.CancelledError, ValueError):
        pass  # a question cut short (or the loop ends): nobody waits for the answer
    finally:
        writer.close()


async def ask(address: str, label: str) -> dict[str, Any] | None:
    """Return the state of communicator ``label`` at ``address``; None without an answer."""
    return await _exchange(address, _REQUEST + label.encode() + b"\n")


async def _exchange(address: str, line: bytes) -> dict[str, Any] | None:
    """Send ``line`` to the server at ``address``; return its answer, None without one."""
    if ":" not in address:
        return None
    host, port = address.rsplit(":", 1)
    opened: list[asyncio.StreamWriter] = []

    async def question() -> dict[str, Any]:
        reader, writer = await asyncio.open_connection(host, int(port))
        opened.append(writer)
        writer.write(line)
        await writer.drain()
        answer: dict[str, Any] = json.loads(await reader.readline())
        return answer

    try:
        return await asyncio.wait_for(question(), ANSWER_S)
    except asyncio.TimeoutError:  # took the question (the kernel did), gave no answer
        return HELD if opened else None
    except (OSError, ValueError):
        return None
    finally:
        for writer in opened:
            writer.close()


def word(state: dict[str, Any] | None) -> str:
    """Say what a rank's ``state`` (an answer of ``ask``) means, in a few words."""
    if state is None or state is HELD:
        return f"no answer within {ANSWER_S:g} s (exited, or its event loop is blocked)"
    if state.get("state") == "closed":
        return "finished (closed this communicator)"
    if state.get("state") != "open":
        return "not started (has not made this communicator)"
    return _doing(state) + "".join(
        f"; running {name}.{method} for rank {caller} for {waited:.1f} s"
        for name, method, caller, waited in state.get("running", []))


def _doing(state: dict[str, Any]) -> str:
    """Say what an open rank's ``state`` says of its operations."""
    pending = state.get("pending", [])
    if pending:
        said = "; ".join(f"{_operation(*entry[:4], *entry[5:6])} pending for {entry[4]:.1f} s"
                         for entry in pending[:_SHOWN])
        more = len(pending) - _SHOWN + int(state.get("more", 0))
        return said + (f"; and {more} more" if more > 0 else "")
    timed_out = state.get("timed_out", [])
    if timed_out:  # its own deadline passed too (the same timeout, as often)
        entry = timed_out[-1]
        return f"{_operation(*entry[:4])} timed out {entry[4]:.1f} s ago, nothing else in flight"
    op, seq, *tensor = state.get("last", (None, 0))
    if not op:
        return "nothing issued on this communicator yet"
    return f"nothing in flight (last issued: {_operation(op, seq, None, None, *tensor)})"


def _operation(op: str, seq: int, peer: int | None, tag: int | None, tensor: str = "") -> str:
    where = "" if peer is None else f" peer {peer}"
    where += "" if tag is None else f" tag {tag}"
    return f"{op} #{seq}{where}" + (f" of {tensor}" if tensor else "")


def shape(kept: object) -> str:
    """Say what an operation moves, where it is one tensor: ``float32[10]`` (else "")."""
    dtype, dims = getattr(kept, "dtype", None), getattr(kept, "shape", None)
    if dtype is None or dims is None:  # (not imported: the launcher uses this module)
        return ""
    return f"{str(dtype).removeprefix('torch.')}[{', '.join(map(str, dims))}]"


def summary(states: Iterable[tuple[int, str]]) -> str:
    """Join ``(rank, words)`` pairs, ranks that say the same grouped: ``ranks 1, 2: ...``
    (words that differ only in their durations are the same: ``pending for 1.0-1.1 s``)."""
    grouped: dict[str, tuple[list[int], list[list[float]]]] = {}
    for rank, words in sorted(states):
        ranks, times = grouped.setdefault(_DURATION.sub("{}", words.replace("{", "{{")
                                                        .replace("}", "}}")), ([], []))
        ranks.append(rank)
        times.append([float(t) for t in _DURATION.findall(words)])
    return "; ".join(f"rank{'s' if len(ranks) > 1 else ''} {_ranks(ranks)}: "
                     + shape.format(*(_span(column) for column in zip(*times, strict=True)))
                     for shape, (ranks, times) in grouped.items())


_DURATION = re.compile(r"(\d+\.\d)(?= s\b)")


def _span(times: Sequence[float]) -> str:
    low, high = min(times), max(times)
    return f"{low:.1f}" if low == high else f"{low:.1f}-{high:.1f}"


def _ranks(ranks: Sequence[int]) -> str:
    if len(ranks) > 8:
        return f"{', '.join(map(str, ranks[:8]))} and {len(ranks) - 8} more"
    return ", ".join(map(str, ranks))


def _bind_host() -> str:
    """Return the address the ranks reach this process by (see the module note)."""
    chosen = settings.read().status_host
    if chosen:
        return chosen
    interface = os.environ.get("GLOO_SOCKET_IFNAME", "").split(",")[0].strip()
    if interface:
        with contextlib.suppress(OSError):
            return _interface_address(interface)
    master = os.environ.get("MASTER_ADDR", "")
    if master and not _is_local(master):
        with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((master, 1))  # no packet is sent: this only picks the route
            return str(s.getsockname()[0])
    return "127.0.0.1"


def _interface_address(name: str) -> str:
    """Return the IPv4 address of network interface ``name`` (Linux)."""
    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        packed = fcntl.ioctl(s.fileno(), siocgifaddr, struct.pack("256s", name[:15].encode()))
    return socket.inet_ntoa(packed[20:24])


def _is_local(host: str) -> bool:
    try:
        address = socket.gethostbyname(host)
    except OSError:
        return False
    return address.startswith("127.") or address == socket.gethostbyname(socket.gethostname())


