"""asyncomm's compiled part (``asyncomm build``) against its Python twins, and ranks with and
without it talking to each other on both backends."""

from __future__ import annotations

import collections
import functools
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import msgpack
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncomm import _native
from asyncomm._core import outbox, small
from asyncomm._core.errors import ProtocolError
from asyncomm._core.messages import PACKET, PREAMBLE
from asyncomm._core.settings import cache_dir
from asyncomm.testing import run_script

NATIVE = small.NATIVE
built = pytest.mark.skipif(NATIVE is None, reason="not built (asyncomm build)")
DTYPES = list(small._DTYPES.values())
SHAPES = [(), (0,), (3,), (2, 3), (1, 2, 1, 2), (4, 0, 2)]


def _tensor(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    return (torch.arange(max(1, torch.Size(shape).numel())) % 2)[:torch.Size(shape).numel()
                                                                   ].reshape(shape).to(dtype)


def _python_hook(code: int, payload: bytes) -> object:
    if code != 3:
        raise ProtocolError(f"frame structure has an unknown extension {code}")
    return small.inline_buffer(payload)


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return (type(a) is type(b) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a, b))
    return type(a) is type(b) and (a == b or repr(a) == repr(b))  # (a NaN is not itself)


def test_a_build_is_found_when_there_and_only_then(tmp_path: Path) -> None:
    assert _native.load(tmp_path) is None  # nothing built there
    target = _native.directory(tmp_path)
    target.mkdir(parents=True)
    (target / f"{_native.name()}.so").write_bytes(b"not a library")
    assert _native.load(tmp_path) is None  # broken: Python twins instead, no error
    assert cache_dir({"ASYNCOMM_CACHE": str(tmp_path)}) == tmp_path
    assert cache_dir({"XDG_CACHE_HOME": "/x"}) == Path("/x/asyncomm")


@pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler")
def test_asyncomm_build_builds_and_checks_its_twins() -> None:
    proc = subprocess.run([sys.executable, "-m", "asyncomm", "build"], capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert str(_native.directory(cache_dir())) in proc.stdout


@built
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_compiled_encoding_is_the_pythons(dtype: torch.dtype) -> None:
    for shape in SHAPES:
        t = _tensor(dtype, shape)
        body = small.encode(t)
        assert body is not None and body == small.encode(t, compiled=False), shape
        assert NATIVE.encode(t, small.BYTES, 16) == body
        made, again = small.decode(body), small.decode(body)
        assert _same(made, small.read_structure(body, _python_hook)), (dtype, shape)
        assert _same(made, t) and isinstance(again, torch.Tensor)
        if t.numel():  # each made with memory of its own
            assert made.data_ptr() != again.data_ptr()


@built
def test_the_compiled_encoding_leaves_the_rest_to_python() -> None:
    x = torch.arange(6.0).reshape(2, 3)
    z = torch.tensor([1 + 2j, 3 - 1j])
    others = {
        "not contiguous": (x.t(), small.BYTES, 16),
        "a neg view": (torch._neg_view(x), small.BYTES, 16),
        "a conj view": (z.conj(), small.BYTES, 16),
        "a subclass": (torch.nn.Parameter(x), small.BYTES, 16),
        "too large": (torch.zeros(100), 300, 16),
        "too many dims": (x, small.BYTES, 1),
        "a list of one not laid out": ([1, x.t()], small.BYTES, 16),
        "a tuple in a list": ([1, (2, 3)], small.BYTES, 16),
        "a tuple": ((1, x), small.BYTES, 16),
        "bytes": ([b"x"], small.BYTES, 16),
        "a float key": ({1.5: 1}, small.BYTES, 16),
        "an int beyond 64 bits": ([2**64], small.BYTES, 16),
        "an int key beyond 64 bits": ({-2**63 - 1: 0}, small.BYTES, 16),
        "a str not UTF-8": (["\ud800"], small.BYTES, 16),
        "a key not UTF-8": ({"\ud800": 1}, small.BYTES, 16),
        "a list too large": ([x, x], 40, 16),
        "a dict too large": ({"x": x}, 30, 16),
        "nested too deep": (functools.reduce(lambda a, _: [a], range(40), [1]), small.BYTES, 16),
        "a subclass of dict": (collections.OrderedDict(a=1), small.BYTES, 16),
    }
    for why, (obj, room, ndim) in others.items():
        assert NATIVE.encode(obj, room, ndim) is None, why
        try:
            twin: object = small.encode(obj, room, ndim, compiled=False)
        except (TypeError, ValueError) as exc:  # (a str not UTF-8: UnicodeEncodeError)
            twin = type(exc)
        try:
            ours: object = small.encode(obj, room, ndim)
        except (TypeError, ValueError) as exc:
            ours = type(exc)
        assert ours == twin, why
    assert small.decode(small.encode(z.conj())).tolist() == z.conj().tolist()


_SCALARS = (st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1)
            | st.floats(allow_nan=False) | st.text(max_size=40))
_TENSORS = st.builds(_tensor, st.sampled_from(DTYPES), st.sampled_from(SHAPES))


@built
@settings(max_examples=300, deadline=None)
@given(st.lists(_SCALARS | _TENSORS, max_size=20) | st.recursive(
    _SCALARS | _TENSORS, lambda inner: st.lists(inner, max_size=5)
    | st.dictionaries(st.text(max_size=8) | st.integers(-2**63, 2**64 - 1), inner, max_size=5),
    max_leaves=30))
def test_the_compiled_encoding_of_a_list_is_the_pythons(items: object) -> None:
    body = small.encode(items)
    assert body == small.encode(items, compiled=False)
    if type(items) in (list, dict):
        assert NATIVE.encode(items, small.BYTES, 16) == body


@built
def test_the_compiled_functions_refuse_bad_calls_with_errors() -> None:
    """Wrong arguments are a Python error, never a crash."""
    x = torch.ones(1)
    calls = [lambda: NATIVE.encode(1), lambda: NATIVE.encode(torch.ones(1), "8", 16),
             lambda: NATIVE.inline(_python_hook, 16, 3), lambda: NATIVE.unpack_packet(3, 16),
             lambda: NATIVE.unpack_packet(b"", "x"), lambda: NATIVE.unpack_message(b"", 99),
             lambda: NATIVE.keep(b"\1"), lambda: NATIVE.keep(b"\1\0\5"), lambda: NATIVE.keep(7),
             # a descriptor whose bytes are not its shape's: 2 floats declaring 64 bytes, and
             # a shape whose product overflows
             lambda: NATIVE.keep(bytes([9, 0, 1]) + struct.pack("<QQ", 2, 64)),
             lambda: NATIVE.keep(bytes([9, 0, 2]) + struct.pack("<QQQ", 2**40, 2**40, 0)),
             lambda: NATIVE.setup(5), lambda: NATIVE.setup([(1,)]),
             lambda: NATIVE.setup([(999, x)])]
    for call in calls:
        with pytest.raises((TypeError, ValueError)):
            call()
    assert NATIVE.unpack_message(bytearray(8), 99, 16, 0, tuple) is None  # beyond the buffer
    for src, wrap in ((0, list), ("0", tuple), (0, 5)):
        with pytest.raises(TypeError):
            NATIVE.unpack_message(bytearray(32), 16, 16, src, wrap)
    with pytest.raises(ProtocolError):  # not an int code: the twin's to refuse
        NATIVE.inline(_python_hook, 16, 3.0, b"")
    with pytest.raises(ProtocolError):  # nor a code beyond a C long
        NATIVE.inline(_python_hook, 16, 2**70, b"")
    # a failed setup changed nothing: the dtypes are known still
    assert NATIVE.encode(torch.ones(2), small.BYTES, 16) == small.encode(torch.ones(2),
                                                                          compiled=False)


def _hooks() -> tuple[object, object]:
    twin = _python_hook
    return functools.partial(NATIVE.inline, twin, 16), twin


def _outcome(hook: object, code: int, payload: bytes) -> object:
    try:
        return hook(code, payload)  # type: ignore[operator]
    except ProtocolError:
        return ProtocolError
    except Exception as exc:  # what the twin raises, the compiled hook must raise too
        return type(exc)


@built
@settings(max_examples=300, deadline=None)
@given(st.sampled_from([t for t in DTYPES if t is not torch.bool]),
       st.sampled_from([(2,), (3, 1), ()]), st.integers(0, 3), st.binary(max_size=40),
       st.integers(-2, 3))
def test_the_compiled_hook_makes_what_python_would(dtype: torch.dtype, shape: tuple[int, ...],
                                                   how: int, noise: bytes, code: int) -> None:
    """A kept descriptor's payload, whole, cut, padded or replaced: the compiled hook gives
    what the Python one gives (the same tensor, or the same error)."""
    body = small.encode(_tensor(dtype, shape), compiled=False)
    assert body is not None
    payload = body[3:]
    small.inline_buffer(payload)  # checked and kept
    cut = [payload, payload[:-1], payload + noise[:1], noise][how]
    compiled, twin = _hooks()
    assert _same(_outcome(compiled, code, cut), _outcome(twin, code, cut))


@built
def test_the_compiled_hook_keeps_to_the_limits() -> None:
    """A descriptor kept under one limit is still refused by a receiver with a lower one."""
    body = small.encode(torch.zeros(2, 2), compiled=False)
    assert body is not None
    payload = body[3:]
    assert _same(small.inline_buffer(payload), torch.zeros(2, 2))  # checked and kept
    limits = small.Limits(max_ndim=1)
    twin = functools.partial(small.inline_buffer, limits=limits)
    with pytest.raises(ProtocolError):
        twin(payload)
    with pytest.raises(ProtocolError):
        NATIVE.inline(lambda code, data: twin(data), limits.max_ndim, 3, payload)


def _packet(*items: bytes) -> bytes:
    return small.packet_head(len(items)) + b"".join(items)


def _message(tag: int, seq: int, body: bytes) -> bytes:
    return small.head(small.DATA, tag, seq) + body


def _run(tag: int, seq: int, *bodies: bytes) -> bytes:
    return small.run_head(tag, seq, len(bodies)) + b"".join(bodies)


@built
def test_the_compiled_packet_reader_reads_what_python_reads() -> None:
    a, b = torch.arange(3.0), torch.tensor([[1, 2]], dtype=torch.int32)
    ta, tb = small.encode(a, compiled=False), small.encode(b, compiled=False)
    assert ta is not None and tb is not None
    for body in (ta, tb):
        small.inline_buffer(body[3:])  # checked and kept
    bodies = [ta, tb, msgpack.packb({"x": [1, 2.5, None], 3: b"raw", "": {"y": True}}),
              msgpack.packb([7, "worker", "step", False, None, -5, 2**64 - 1, -2**63]),
              msgpack.packb("é" * 300), msgpack.packb(list(range(20))), b"\xca\x3f\x80\0\0",
              small.encode([1, a, "x", b], compiled=False) or b""]
    packet = _packet(*[_message(3, i, body) for i, body in enumerate(bodies)],
                     _run(5, 7, tb, ta, tb), _message(2**64 - 1, 2**63, tb),
                     small.head(3, 3, 0) + msgpack.packb([16, 0]))  # credit: any kind is read
    made = NATIVE.unpack_packet(packet, 16)
    assert made is not None and _same_items(made, small.unpack_packet(packet, compiled=False))
    assert _same_items(small.unpack_packet(memoryview(bytearray(packet))), made)
    for other in (_packet(_message(3, 0, small.encode((1, 2)) or b"")),  # a tuple: Python's
                  _packet(_message(3, 0, ta), _message(3, 1, b"\xa1\xff")),  # not UTF-8
                  _packet(_message(3, 0, msgpack.packb({(1,): 2}))),  # not a str or int key
                  _packet(b"\x94\xcc\x01" + small.head(1, 3, 0)[2:] + ta),  # a kind not fixint
                  _packet(_message(3, 0, small.encode(torch.ones(9), compiled=False) or b"")),
                  _packet(_message(3, 0, msgpack.packb(msgpack.ExtType(5, b"x")))),
                  packet + b"\0", packet[:-1], _packet()[:-1]):
        assert NATIVE.unpack_packet(other, 16) is None
    assert NATIVE.unpack_packet(_packet(_message(3, 0, ta)), 0) is None  # beyond its dims


@built
def test_a_link_message_is_read_with_its_messages_made() -> None:
    """What the MPI link hands the receiver: a packet's frames, messages made ``Message``."""
    from asyncomm._core.messages import PACKET, PREAMBLE
    from asyncomm._messaging.mailbox import Message

    t = small.encode(torch.arange(2.0), compiled=False)
    assert t is not None
    small.inline_buffer(t[3:])
    packet = _packet(_message(3, 0, t), _run(4, 1, t, msgpack.packb({"a": 1})),
                     small.head(3, 3, 0) + msgpack.packb([16, 0]))
    message = bytearray(PREAMBLE.pack(0, len(packet), 0, PACKET) + packet + b"padding")
    made = NATIVE.unpack_message(message, len(message) - 7, 16, 5, Message)
    assert made is not None
    assert [type(m) for m in [made[0][3], *made[1][3]]] == [Message] * 3
    assert made[0][3].src == 5 and made[0][3].tag == 3 and made[1][3][1].tag == 4
    bare = [[k, tag, seq, d[2] if k == small.DATA else [m[2] for m in d] if k == small.RUN
             else d] for k, tag, seq, d in made]
    assert _same_items(bare, small.unpack_packet(packet, compiled=False))
    for other in (PREAMBLE.pack(0, len(packet), 0, 2) + packet,  # a batch: not a packet
                  PREAMBLE.pack(4, len(packet), 0, PACKET) + packet,  # a head
                  PREAMBLE.pack(0, len(packet) + 1, 0, PACKET) + packet):  # beyond it
        assert NATIVE.unpack_message(bytearray(other), len(other), 16, 5, Message) is None


@built
def test_the_compiled_span_is_the_pythons() -> None:
    """Where a quick operation's tensor lies, compiled and in Python alike; what either
    leaves to the usual path (not exactly a tensor, not laid out in host memory as its
    values, a dtype the table lacks), both leave."""
    table = {torch.float32: "f", torch.int64: 7, torch.complex64: None, torch.bool: "b"}
    base = torch.arange(12.0)
    z = torch.zeros(2, dtype=torch.complex64)
    for t in (base, base[3:7], base[:0], torch.zeros(2, 3).t(), base.reshape(3, 4)[1],
              torch.ones(3, dtype=torch.int64), torch.ones(2, dtype=torch.bool),
              torch.ones(2, dtype=torch.float64), z, z.conj(), torch._neg_view(base),
              torch.nn.Parameter(torch.ones(2)), base.numpy(), [1.0], None,
              torch.zeros(2, device="meta"), torch.ones(3).to_sparse()):
        compiled, python = NATIVE.span(t, table), small.span(t, table)
        assert compiled == python, (t, compiled, python)
    assert NATIVE.span(base[3:7], table) == (base.data_ptr() + 12, 16, "f")
    assert NATIVE.span(base, {}) is None and NATIVE.span(z, table) is None
    with pytest.raises(TypeError):
        NATIVE.span(base, [])


@built
def test_the_keys_kept_for_dicts_read_as_made() -> None:
    """Map keys are kept once made (1024 at most): past that, and for every key, the same."""
    for i in range(1100):
        body = msgpack.packb({f"k{i % 1030}": i, "step": [i], "é" * (i % 5): None})
        packet = _packet(_message(3, i, body))
        made = NATIVE.unpack_packet(packet, 16)
        assert made == small.unpack_packet(packet, compiled=False), i


def _same_items(a: list[object], b: list[object]) -> bool:
    return len(a) == len(b) and all(
        _same_items(x, y) if isinstance(x, list) and isinstance(y, list) else _same(x, y)
        for x, y in zip(a, b, strict=True))


@built
@settings(max_examples=300, deadline=None)
@given(st.integers(0, 400), st.integers(0, 255), st.integers(0, 3))
def test_the_compiled_packet_reader_reads_a_damaged_packet_as_python_or_not_at_all(
        at: int, value: int, how: int) -> None:
    t = small.encode(torch.arange(4.0), compiled=False)
    assert t is not None
    small.inline_buffer(t[3:])
    mixed = msgpack.packb([{"a": 1.5, 2: "é"}, -70000, b"xy", [None, True]])
    data = bytearray(_packet(_message(3, 0, t), _run(4, 1, t, mixed), _message(3, 1, mixed)))
    at %= len(data)
    if how == 0:
        data[at] = value
    elif how == 1:
        del data[at:]
    elif how == 2:
        data[at:at] = bytes([value])
    made = NATIVE.unpack_packet(bytes(data), 16)
    try:
        twin: object = small.unpack_packet(bytes(data), compiled=False)
    except ProtocolError:
        twin = ProtocolError
    if made is not None:  # whatever it reads, Python reads the same
        assert isinstance(twin, list) and _same_items(made, twin)


BOTH_WAYS = r"""
import os, sys
rank = int(next((os.environ[v] for v in ("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK",
                                         "PMIX_RANK") if v in os.environ), 0))
if rank % 2:
    os.environ["ASYNCOMM_NATIVE"] = "0"  # odd ranks run the Python twins
import asyncio, torch, asyncomm
from asyncomm._core import small

async def main(comm):
    assert (small.NATIVE is None) == (rank % 2 == 1 or os.environ["EXPECT"] == "0")
    ch = comm.channel(5)
    peer = 1 - comm.rank

    def made(r):  # of each kind, values that differ round by round
        return [torch.arange(6.0).reshape(2, 3) + r, torch.tensor(3 + r, dtype=torch.int64),
                torch.ones(2, dtype=torch.bfloat16) * r, torch.tensor([True, r % 2 == 0]),
                (torch.arange(4.0).reshape(2, 2) + r).t(), torch.zeros(0, 3, dtype=torch.float16),
                torch.tensor([1 + 2j * r]).conj(), torch.tensor([r, 2, 3], dtype=torch.uint16)]

    for r in range(3):  # the first of each kind goes the Python way, later ones need not
        for t in made(r):
            await ch.send(t, peer)
        for want in made(r):
            got = (await ch.recv(peer)).data
            assert got.dtype == want.dtype and got.shape == want.shape, (got, want)
            assert torch.equal(got, want.resolve_conj()), (got, want)
    print("both ways", comm.rank, small.NATIVE is not None, flush=True)

asyncomm.run(main)
"""


@pytest.mark.parametrize("backend", ["gloo", "mpi"])
def test_ranks_with_and_without_it_talk(backend: str, tmp_path: Path) -> None:
    expect = "0" if NATIVE is None else "1"
    proc = run_script(BOTH_WAYS, tmp_path, 2, backend, env={"EXPECT": expect})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "both ways 0" in proc.stdout and "both ways 1" in proc.stdout, proc.stdout
    assert f"both ways 0 {NATIVE is not None}" in proc.stdout
    assert "both ways 1 False" in proc.stdout


# -- the outbox: packets of small frames (``_core.outbox``), compiled and in Python ------

_QUEUE_OPS = st.lists(st.tuples(
    st.sampled_from(["data", "data", "data", "gap", "message", "small", "take", "frames"]),
    st.integers(0, 2), st.sampled_from([1, 2, 2**64 - 1]), st.integers(0, 70)),
    min_size=1, max_size=80)


def _queue_all(queue: object, packet_bytes: int, ops: list[tuple[str, int, int, int]]
               ) -> list[object]:
    """Run ``ops`` on ``queue``; return everything it answered and every packet it gave."""
    seqs: collections.Counter[tuple[int, int]] = collections.Counter()
    said: list[object] = []
    for op, dst, tag, n in ops:
        body = msgpack.packb(bytes(range(n)) if n % 3 else n)  # (a frame's body: msgpack)
        if op in ("data", "gap"):
            seq = seqs[dst, tag] + (5 if op == "gap" else 0)  # a gap: a lone message again
            seqs[dst, tag] = seq + 1
            queued = queue.data(dst, tag, seq, body)  # type: ignore[attr-defined]
            said.append(queued)
            if queued < 0:  # full: sent, and the message begins the next
                said.append(bytes(queue.take(dst)))  # type: ignore[attr-defined]
                said.append(queue.data(dst, tag, seq, body))  # type: ignore[attr-defined]
        elif op == "message":  # encoded by the outbox itself (what both encode)
            seq = seqs[dst, tag]
            seqs[dst, tag] = seq + 1
            obj = [torch.arange(n % 5), [n, "x", 2.5, None], {"i": n, "t": torch.ones(2)},
                   f"lone {n}"][n % 4]  # (a str: the compiled outbox hands it to the twin)
            queued = queue.message(dst, tag, seq, obj, 300, 16)  # type: ignore[attr-defined]
            said.append(queued)
            if queued == -1:
                said.append(bytes(queue.take(dst)))  # type: ignore[attr-defined]
                said.append(queue.message(dst, tag, seq, obj, 300, 16))  # type: ignore
        elif op == "small":
            queued = queue.small(dst, 2 + n % 4, tag, n, body)  # type: ignore[attr-defined]
            said.append(queued)
            if queued < 0:
                said.append(bytes(queue.take(dst)))  # type: ignore[attr-defined]
                said.append(queue.small(dst, 2 + n % 4, tag, n, body))  # type: ignore
        elif op == "take":
            packet = queue.take(dst)  # type: ignore[attr-defined]
            said.append(None if packet is None else bytes(packet))
        else:
            queue.packet_frames = 1 + n % 5  # type: ignore[attr-defined]
        said.append((queue.dsts(), queue.queued(dst), queue.counts(dst)))  # type: ignore
    for dst in queue.dsts():  # type: ignore[attr-defined]
        said.append(bytes(queue.take(dst)))  # type: ignore[attr-defined]
    return said


@built
@settings(max_examples=300, deadline=None)
@given(st.sampled_from([120, 300, 4096]), _QUEUE_OPS)
def test_the_compiled_outbox_queues_what_python_queues(
        packet_bytes: int, ops: list[tuple[str, int, int, int]]) -> None:
    compiled, twin = outbox.make(packet_bytes), outbox.make(packet_bytes, compiled=False)
    assert type(compiled) is not outbox.Outbox and type(twin) is outbox.Outbox
    said = _queue_all(compiled, packet_bytes, ops)
    assert said == _queue_all(twin, packet_bytes, ops)
    for packet in said:  # and every packet reads as the frames queued, in order
        if isinstance(packet, bytes):
            assert len(packet) <= packet_bytes
            head_bytes, inline, follow, form = PREAMBLE.unpack_from(packet)
            assert (head_bytes, inline, follow, form) == (0, len(packet) - PREAMBLE.size, 0,
                                                          PACKET)
            assert small.unpack_packet(packet[PREAMBLE.size:], compiled=False) is not None


@built
def test_the_compiled_outbox_refuses_bad_calls_with_errors() -> None:
    queue = outbox.make(4096)
    for bad, error in [(lambda: queue.data(1, 2, 3), TypeError),
                       (lambda: queue.data("1", 2, 3, b""), TypeError),
                       (lambda: queue.data(1, -2, 3, b""), OverflowError),
                       (lambda: queue.data(1, 2, 3, "text"), TypeError),
                       (lambda: queue.small(1, 300, 2, 3, b""), ValueError),
                       (lambda: queue.small(1, 3, 2, 2**64, b""), OverflowError),
                       (lambda: queue.take("1"), TypeError),
                       (lambda: outbox.make("big"), TypeError)]:
        with pytest.raises(error):
            bad()
    assert queue.message(1, 2, 3, torch.zeros(1000), 300, 16) == -2  # beyond the room
    assert queue.dsts() == [] and queue.take(1) is None  # nothing queued by any of them
    # what the compiled encoding leaves (a lone str), the Python twin's encodes: as the twin
    twin = outbox.make(4096, compiled=False)
    assert queue.message(1, 2, 3, "a lone str", 300, 16) == 1 == twin.message(
        1, 2, 3, "a lone str", 300, 16)
    assert bytes(queue.take(1)) == bytes(twin.take(1))


MPI_CALLS = r"""
from mpi4py import MPI
from asyncomm._backends import mpi_native

native = mpi_native.NATIVE
assert native is not None, "the MPI calls are not built"
comm = MPI.COMM_WORLD.Dup()
peer = 1 - comm.Get_rank()
try:  # a bad call: mpi4py's exception of its code, naming the rank it was for
    native.isend(comm.handle, bytearray(8), comm.Get_size() + 5, 3)
except native.Error as exc:
    assert exc.args[1] == comm.Get_size() + 5
    assert mpi_native.exception(exc).Get_error_class() == MPI.ERR_RANK, exc
else:
    raise AssertionError("a send to no rank went")
slot = bytearray(64)  # (the link's receive kept posted: the lane tests and restarts it)
posted = comm.Recv_init([slot, MPI.BYTE], MPI.ANY_SOURCE, 77)
posted.Start()
status = MPI.Status()
assert not posted.Test(status)  # nothing yet
assert type(native.lane_calls).__name__ == "PyCapsule"  # (the lane's calls: C only)
comm.Barrier()
assert native.isend(comm.handle, bytearray(b"x" * 40), peer, 77) is None  # small: at once
while not posted.Test(status):
    pass
assert (status.Get_source(), status.Get_count(MPI.BYTE)) == (peer, 40) and slot[:40] == b"x" * 40
native.start(posted.handle)  # started again (the lane's restart, through mpi4py's handle)
comm.Barrier()
assert native.isend(comm.handle, bytearray(100), peer, 77) is None  # beyond the slot
while True:
    try:
        assert not posted.Test(status)
    except MPI.Exception as exc:  # cut short (the receiver's error, not the sender's)
        assert exc.Get_error_class() == MPI.ERR_TRUNCATE, exc
        break
native.start(posted.handle)
comm.Barrier()
assert native.isend(comm.handle, bytearray(b"y" * 8), peer, 77) is None
while not posted.Test(status):
    pass
assert (status.Get_source(), status.Get_count(MPI.BYTE)) == (peer, 8)
big, into = bytearray(b"z" * (8 << 20)), bytearray(8 << 20)
pending = native.isend(comm.handle, big, peer, 78)  # not done at once: mpi4py's request
receive = comm.Irecv([into, MPI.BYTE], peer, 78)
if pending is not None:
    MPI.Request.fromhandle(pending).Wait()
receive.Wait()
assert into == big
native.start(posted.handle)
posted.Cancel()
posted.Wait()
posted.Free()
# found by matched probe (Open MPI's link): a small message received and read, or left to
# the caller; a larger one left matched, received through mpi4py
leave = lambda *args: None  # (an unpack that leaves every message to the caller)
assert native.probe(comm.handle, 79, 64, leave, 16, tuple) is None  # nothing yet
comm.Barrier()
native.isend(comm.handle, bytearray(b"s" * 20), peer, 79)
while (found := native.probe(comm.handle, 79, 64, leave, 16, tuple)) is None:
    pass
assert found[:3] == (peer, 20, None) and found[3] == b"s" * 20 and found[4] is None, found
read = lambda buffer, count, *rest: ["read", bytes(buffer[:count])]
native.isend(comm.handle, bytearray(b"r" * 12), peer, 79)
while (found := native.probe(comm.handle, 79, 64, read, 16, tuple)) is None:
    pass
assert found[2] == ["read", b"r" * 12], found
native.isend(comm.handle, bytearray(b"b" * 100), peer, 79)  # beyond at_once: left matched
while (found := native.probe(comm.handle, 79, 64, leave, 16, tuple)) is None:
    pass
assert found[:4] == (peer, 100, None, None) and found[4] is not None, found
into = bytearray(100)
MPI.Message.fromhandle(found[4]).Recv([into, MPI.BYTE])
assert into == b"b" * 100
comm.Barrier()
import time, torch  # a kept all-reduce: copied in, started, tested, copied out
stage = torch.zeros(2, dtype=torch.float64)
mine = torch.tensor([1.0, 2.0], dtype=torch.float64) * (comm.Get_rank() + 1)
kept = comm.Allreduce_init(MPI.IN_PLACE, [MPI.buffer.fromaddress(stage.data_ptr(), 16),
                                          MPI.DOUBLE], MPI.SUM)
comm.Barrier()
if comm.Get_rank() == 1:
    time.sleep(0.05)  # late: rank 0's tests find it in flight
tests = 4 if comm.Get_rank() == 0 else 10**8  # (rank 1, last, tests until it is done)
done = native.allreduce(kept.handle, stage.data_ptr(), mine.data_ptr(), 16, tests)
assert done == (comm.Get_rank() == 1), done
if not done:
    kept.Wait()
    mine.copy_(stage)
assert mine.tolist() == [3.0, 6.0], mine
kept.Free()
print("calls", comm.Get_rank(), native.library().split()[0], flush=True)
"""


@built
def test_the_compiled_mpi_calls_send_receive_and_fail_as_mpi4py(tmp_path: Path) -> None:
    pytest.importorskip("mpi4py")
    if not mpi_native_built():
        pytest.skip("the MPI calls are not built (no MPI header)")
    proc = run_script(MPI_CALLS, tmp_path, 2, "mpi")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "calls 0" in proc.stdout and "calls 1" in proc.stdout, proc.stdout


def mpi_native_built() -> bool:
    """Whether ``asyncomm build`` built the MPI calls here (imports mpi4py)."""
    from asyncomm._backends import mpi_native

    return mpi_native.NATIVE is not None
