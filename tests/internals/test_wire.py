"""The wire format and codecs: round trips, refusals, and hostile heads (single process).

Internals on purpose: ``_core/wire.py`` and ``_core/small.py`` encode and decode frames
directly, and a ``Delivery`` (``_messaging/mailbox.py``) is fed frames by hand, its
mailboxes read, to see what it refuses and what it keeps."""

from __future__ import annotations

import pickle
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from asyncomm._core import small, wire
from asyncomm._core.errors import ProtocolError
from asyncomm._core.messages import PREAMBLE
from asyncomm._core.wire import (
    PREFIX_BYTES,
    BufferKind,
    Codec,
    Descriptor,
    Head,
    Kind,
    Limits,
    decode,
    decode_head,
    encode,
)
from asyncomm._messaging.mailbox import Delivery, Frame, Message

FUZZ = settings(max_examples=150, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])
DTYPES = list(wire._DTYPES.values())
SHAPES = [(), (0,), (5,), (2, 0, 3), (2, 3, 4)]


def allocate(head: Head) -> list[torch.Tensor]:
    """One flat uint8 CPU tensor per descriptor, to receive the buffers into."""
    return [torch.empty(d.nbytes, dtype=torch.uint8) for d in head.descriptors]


def transfer(obj: object, codec: Codec = Codec.DEFAULT) -> tuple[Any, list[torch.Tensor]]:
    """Encode, 'send' (copy the buffers), validate and decode, as a transport would."""
    head_bytes, sent = encode(Kind.DATA, 9, 4, obj, codec)
    head = decode_head(head_bytes)
    received = allocate(head)
    assert sum(r.numel() for r in received) == head.payload_bytes
    for into, buffer in zip(received, sent, strict=True):
        if isinstance(buffer, torch.Tensor):
            into.copy_(buffer)
        else:
            into.numpy()[:] = np.frombuffer(buffer, np.uint8)
    return decode(head, received, codec), received


def same(a: Any, b: Any) -> bool:
    """Equal values of exactly the same types, recursively (tensors and arrays by content)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.device == b.device and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(map(same, a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a == b


def sample(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if dtype is torch.bool:
        return torch.randint(0, 2, shape).bool()
    if dtype.is_complex or dtype.is_floating_point:
        return (torch.randn(shape, dtype=torch.complex128 if dtype.is_complex else torch.float64)
                * 100).to(dtype)
    return torch.randint(0, 100, shape).to(dtype)


# -- round trips -------------------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_and_shape(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    t = sample(dtype, shape)
    out, _ = transfer(t)
    assert same(out, t) and out.shape == t.shape
    if dtype is not torch.bfloat16:
        a = t.numpy()
        out, _ = transfer(a)
        assert same(out, a) and out.shape == a.shape


def test_non_contiguous_inputs() -> None:
    base = torch.arange(24.0).reshape(4, 6)
    z = torch.randn(3, 2, dtype=torch.complex64)
    tensors = [base.T, base[:, ::2], base[1:3, 1:], torch.tensor(1.0).expand(3, 4),
               z.conj(), z.conj().T, torch.randn(3, requires_grad=True)]
    for t in tensors:
        out, _ = transfer(t)
        assert isinstance(out, torch.Tensor) and torch.equal(out, t.detach()), t
        assert out.is_contiguous() and not out.is_conj()
    arrays = [np.arange(24.0).reshape(4, 6).T, np.arange(10)[::3], np.arange(6, dtype=">i4")]
    for a in arrays:
        out, _ = transfer(a)
        assert isinstance(out, np.ndarray) and np.array_equal(out, a) and out.dtype.isnative


def test_nested_structure_keeps_types() -> None:
    msg: dict[object, object] = {
        "t": torch.arange(6).reshape(2, 3), "a": np.ones((2, 2), np.float32), "b": b"\x00raw",
        "s": "héllo", 1: [1.5, True, None, -(2**63), 2**64 - 1],
        "tup": (1, (2, [3, (torch.zeros(0),)]), ()), "empty": [[], {}, ()],
        None: {2.5: "float key", False: b"", b"k": 0},
    }
    out, _ = transfer(msg)
    assert same(out, msg)
    for codec in Codec:
        value = transfer(((1, 2), [3, (4,)]), codec)[0]
        assert value == ((1, 2), [3, (4,)]) and type(value[1][1]) is tuple


def test_lenient_scalars_and_containers() -> None:
    class Color(int):
        pass

    out, _ = transfer({"n": np.int64(3), "f": np.float32(0.5), "b": np.bool_(True),
                       "i": Color(2), "m": memoryview(b"ab")})
    assert same(out, {"n": 3, "f": 0.5, "b": True, "i": 2, "m": b"ab"})


def test_contiguous_inputs_are_not_copied() -> None:
    t, a = torch.arange(12.0).reshape(3, 4), np.arange(7, dtype=np.int16)
    big = bytes(wire.INLINE_BYTES + 1)
    _, buffers = encode(Kind.DATA, 0, 0, [t, a, big])
    assert isinstance(buffers[0], torch.Tensor) and buffers[0].data_ptr() == t.data_ptr()
    assert np.shares_memory(np.frombuffer(buffers[1], np.uint8), a)
    assert np.shares_memory(np.frombuffer(buffers[2], np.uint8), np.frombuffer(big, np.uint8))
    out, received = transfer([t, a, big])
    assert out[0].data_ptr() == received[0].data_ptr()
    assert np.shares_memory(out[1], received[1].numpy()) and out[2] == big


def test_large_structure_travels_as_a_buffer() -> None:
    msg = [*range(50_000), "x" * 100_000]
    head_bytes, _ = encode(Kind.DATA, 0, 0, msg)
    head = decode_head(head_bytes)
    assert len(head_bytes) < 200 and head.descriptors[-1].kind is BufferKind.STRUCTURE
    assert transfer(msg)[0] == msg


@dataclass
class Point:
    x: int
    label: str


def test_pickle_codec_sends_tensors_and_arrays_out_of_band() -> None:
    t, a = torch.arange(1000.0), np.arange(1000, dtype=np.int64)
    msg = {"p": Point(1, "a"), "t": t, "a": a, "bf": torch.ones(3, dtype=torch.bfloat16),
           "grad": torch.ones(2, requires_grad=True), "s": {1, 2}}
    head_bytes, buffers = encode(Kind.DATA, 0, 0, msg, Codec.PICKLE)
    assert len(buffers) == 3 and len(head_bytes) < 2000
    assert np.frombuffer(buffers[0], np.uint8).ctypes.data == t.data_ptr()
    assert np.shares_memory(np.frombuffer(buffers[1], np.uint8), a)
    out, received = transfer(msg, Codec.PICKLE)
    assert out["p"] == Point(1, "a") and out["s"] == {1, 2} and out["grad"].requires_grad
    assert same(out["t"], t) and same(out["a"], a) and same(out["bf"], msg["bf"])
    assert out["t"].data_ptr() == received[0].data_ptr()


def test_golden_head_bytes() -> None:
    """The format is a contract between ranks: these bytes must never change within version 1."""
    head, _ = encode(Kind.REQUEST, 7, 3, {"a": (1, None), "t": torch.arange(3, dtype=torch.int16)})
    assert head.hex() == (
        "41434d46010400000700000000000000030000000000000001000000110000004800000004000103"
        "00000000000000060000000000000082a16193c7000101c0a174d60200000000")


def test_tags_and_limits_at_encode() -> None:
    head = decode_head(encode(Kind.EOS, 2**63 - 1, 2**64 - 1, None)[0])
    assert (head.kind, head.tag, head.seq, head.descriptors) == (Kind.EOS, 2**63 - 1, 2**64 - 1, ())
    with pytest.raises(ValueError, match="tag"):
        encode(Kind.DATA, -1, 0, None)
    with pytest.raises(ValueError, match="too large"):
        encode(Kind.DATA, 0, 0, torch.zeros(100), limits=Limits(max_message_bytes=399))
    with pytest.raises(ValueError, match="too large"):
        encode(Kind.DATA, 0, 0, [torch.zeros(1)] * 3, limits=Limits(max_buffers=2))


# -- refusals ------------------------------------------------------------------------------


class Foo:
    pass


@pytest.mark.parametrize(("obj", "what", "where"), [
    ({"x": [1, 2, Foo()]}, "Foo", "data['x'][2]"),
    ([(0, {1: {2, 3}})], "set", "data[0][1][1]"),
    ({"a": 2**64}, "an int beyond 64 bits", "data['a']"),
    ([-(2**63) - 1], "an int beyond 64 bits", "data[0]"),
    ({"d": {(1, 2): 0}}, "a dict key of type tuple", "data['d']"),
    (1j, "complex", "data"),
    ([torch.zeros(2, dtype=torch.float8_e4m3fn)], "a torch.float8_e4m3fn tensor", "data[0]"),
    ({"sp": torch.eye(2).to_sparse()}, "a torch.sparse_coo tensor", "data['sp']"),
    ((np.array([object()]),), "a numpy array of dtype object", "data[0]"),
    ([np.ma.masked_array([1])], "MaskedArray", "data[0]"),
])
def test_default_codec_refuses_with_path(obj: object, what: str, where: str) -> None:
    with pytest.raises(TypeError) as info:
        encode(Kind.DATA, 0, 0, obj)
    assert str(info.value) == (f"the default codec cannot carry {what} at {where}; "
                               'use comm.channel(tag, codec="pickle")')
    encode(Kind.DATA, 0, 0, obj, Codec.PICKLE)  # pickle takes it


# -- hostile input ---------------------------------------------------------------------------


@pytest.fixture
def no_allocation_or_unpickling(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Fail the test if torch allocates or anything unpickles while it runs."""
    def forbidden(*args: object, **kwargs: object) -> Any:
        raise AssertionError("must not be reached")
    monkeypatch.setattr(torch, "empty", forbidden)
    monkeypatch.setattr(pickle, "loads", forbidden)
    monkeypatch.setattr(pickle, "Unpickler", forbidden)
    yield


VALID_HEADS = [
    encode(Kind.DATA, 3, 1, {"a": (1, [2.5, "x"]), "t": torch.zeros(2, 3), "n": np.ones(4)})[0],
    encode(Kind.REPLY, 2**40, 7, None)[0],
    encode(Kind.DATA, 0, 0, [Point(1, "p"), np.ones(3)], Codec.PICKLE)[0],
]


def forge(*descriptors: tuple[int, int, tuple[int, ...], int], structure: bytes = b"\xc0",
          codec: int = Codec.DEFAULT, count: int | None = None) -> bytes:
    """A head with raw descriptors (dtype code, buffer kind, shape, nbytes) and no checks."""
    parts = [struct.pack(f"<BBB{len(s) + 1}Q", code, kind, len(s), *s, n)
             for code, kind, s, n in descriptors]
    size = PREFIX_BYTES + sum(map(len, parts)) + len(structure)
    prefix = wire._PREFIX.pack(b"ACMF", 1, Kind.DATA, codec, 0, 0, 0,
                                len(parts) if count is None else count, len(structure), size)
    return b"".join([prefix, *parts, structure])


F64, U8, BF16 = (wire._CODES[d] for d in (torch.float64, torch.uint8, torch.bfloat16))
T, N, B, S = BufferKind.TENSOR, BufferKind.NDARRAY, BufferKind.BYTES, BufferKind.STRUCTURE


HOSTILE_HEADS = [
    (forge((F64, T, (2**27,), 2**30)), "limit"),  # 1 GiB + structure
    (forge((U8, T, (2**60,), 2**60)), "limit"),
    (forge((U8, T, (2**32, 2**32), 0)), "bytes, not 0"),  # 2**64 elements wrap to 0 in C
    (forge((F64, T, (3,), 25)), "bytes, not 25"),
    (forge((F64, T, (0, 2**62, 4), 0)), "shape too large"),
    (forge((F64, T, (1,) * 17, 8)), "17 dims"),
    (forge((99, T, (1,), 1)), "unknown dtype code 99"),
    (forge((U8, 9, (1,), 1)), "buffer kind 9"),
    (forge((BF16, N, (1,), 2)), "numpy has no bfloat16"),
    (forge((F64, B, (1,), 8)), "flat uint8"),
    (forge((U8, S, (1,), 1), (U8, T, (1,), 1), structure=b""), "last"),
    (forge((U8, S, (1,), 1)), "no structure in the head"),
    (forge((F64, T, (1,), 8), codec=Codec.PICKLE), "only BYTES"),
    (forge(count=2**32 - 1), "4294967295 buffers"),
    (forge(count=1), "truncated"),
    (forge() + b"\x00", "declares"),
    (b"ACMF\x02" + bytes(31), "version 2 is unknown"),
    (b"XCMF\x01" + bytes(31), "bad magic"),
    (b"ACMF", "truncated"),
    (forge()[:32] + struct.pack("<I", 2**32 - 1) + forge()[36:], "head of 4294967295 bytes"),
]


@pytest.mark.usefixtures("no_allocation_or_unpickling")
@pytest.mark.parametrize(("data", "message"), HOSTILE_HEADS, ids=[m for _, m in HOSTILE_HEADS])
def test_hostile_heads_are_refused_before_allocation(data: bytes, message: str) -> None:
    with pytest.raises(ProtocolError, match=message):
        decode_head(data)


def test_tighter_limits() -> None:
    head = VALID_HEADS[0]
    for limits in [Limits(max_head_bytes=len(head) - 1), Limits(max_buffers=1),
                   Limits(max_ndim=1), Limits(max_message_bytes=63)]:
        with pytest.raises(ProtocolError):
            decode_head(head, limits)


@pytest.mark.usefixtures("no_allocation_or_unpickling")
def test_every_truncation_is_refused() -> None:
    for head in VALID_HEADS:
        for n in range(len(head)):
            with pytest.raises(ProtocolError):
                decode_head(head[:n])


@pytest.mark.usefixtures("no_allocation_or_unpickling")
@FUZZ
@given(data=st.binary(max_size=300), prefixed=st.booleans())
def test_random_bytes_are_refused(data: bytes, prefixed: bool) -> None:
    with pytest.raises(ProtocolError):
        decode_head(b"ACMF\x01" + data if prefixed else data)


def plain(obj: object) -> bool:
    """Only the types the DEFAULT codec decodes to."""
    if isinstance(obj, (list, tuple)):
        return all(map(plain, obj))
    if isinstance(obj, dict):
        return all(plain(k) and plain(v) for k, v in obj.items())
    return obj is None or isinstance(obj, (bool, int, float, str, bytes, torch.Tensor, np.ndarray))


def decode_if_valid(data: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    """decode_head and decode raise ProtocolError or give plain values; never unpickle."""
    try:
        head = decode_head(data)
    except ProtocolError:
        return
    buffers = allocate(head)
    for buffer in buffers:
        buffer.fill_(1)
    with monkeypatch.context() as patch:
        patch.setattr(pickle, "loads", None)
        try:
            assert plain(decode(head, buffers, Codec.DEFAULT))
        except ProtocolError:
            pass


@FUZZ
@given(which=st.sampled_from(VALID_HEADS), at=st.integers(0, 10_000), byte=st.integers(0, 255))
def test_single_byte_mutations(which: bytes, at: int, byte: int,
                               monkeypatch: pytest.MonkeyPatch) -> None:
    data = bytearray(which)
    data[at % len(data)] = byte
    decode_if_valid(bytes(data), monkeypatch)


scalars = (st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats()
           | st.text(max_size=5) | st.binary(max_size=5))
extensions = (st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=6))
              | st.sampled_from([msgpack.ExtType(1, b""), msgpack.ExtType(2, bytes(4)),
                                 msgpack.ExtType(2, b"\x01\0\0\0")])
              | st.builds(msgpack.Timestamp, st.integers(0, 2**34 - 1), st.integers(0, 10**9 - 1)))
structures = st.recursive(scalars | extensions, lambda inner: st.lists(inner, max_size=4)
                          | st.dictionaries(scalars, inner, max_size=3), max_leaves=12)


@FUZZ
@given(structure=structures | st.binary(max_size=40), buffers=st.integers(0, 2))
def test_hostile_structures(structure: object, buffers: int,
                            monkeypatch: pytest.MonkeyPatch) -> None:
    raw = structure if isinstance(structure, bytes) else msgpack.packb(structure)
    decode_if_valid(forge(*[(U8, T, (2,), 2)] * buffers, structure=raw), monkeypatch)


flag: list[str] = []


def set_flag() -> None:
    flag.append("unpickled")


class Trap:
    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return set_flag, ()


def test_pickle_frame_on_a_default_channel_is_never_unpickled() -> None:
    flag.clear()
    head_bytes, buffers = encode(Kind.DATA, 0, 0, [Trap(), np.ones(3)], Codec.PICKLE)
    head = decode_head(head_bytes)
    received = [torch.from_numpy(np.frombuffer(b, np.uint8).copy()) for b in buffers]
    with pytest.raises(ProtocolError, match="PICKLE"):
        decode(head, received, Codec.DEFAULT)
    forged = decode_head(forge(structure=pickle.dumps(Trap())))  # pickle bytes labelled DEFAULT
    with pytest.raises(ProtocolError):
        decode(forged, [], Codec.DEFAULT)
    assert flag == []
    decode(head, received, Codec.PICKLE)  # the trap is live: it fires when pickle is asked for
    assert flag == ["unpickled"]
    with pytest.raises(ProtocolError, match="DEFAULT"):
        decode(decode_head(encode(Kind.DATA, 0, 0, 1)[0]), [], Codec.PICKLE)


def test_decode_checks_buffers() -> None:
    head = decode_head(encode(Kind.DATA, 0, 0, torch.zeros(2))[0])
    for wrong in [[], [torch.empty(7, dtype=torch.uint8)], [torch.empty(2)]]:
        with pytest.raises(ValueError, match="one flat uint8 CPU tensor each"):
            decode(head, wrong, Codec.DEFAULT)
    assert head.descriptors == (Descriptor(torch.float32, (2,), 8, BufferKind.TENSOR),)


# -- fast paths: the same bytes and values as the general path ---------------------------------


plain_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**65), 2**65) | st.floats(allow_nan=False)
    | st.text(max_size=5)
    | st.binary(max_size=5),
    lambda inner: st.lists(inner, max_size=4) | st.tuples(inner, inner)
    | st.dictionaries(st.integers(-5, 5) | st.text(max_size=3), inner, max_size=3),
    max_leaves=12)


@FUZZ
@given(obj=plain_values)
def test_messages_without_buffers_pack_as_when_lowered(obj: object) -> None:
    try:
        lowered = wire._lower(obj, wire._Outgoing())
    except wire._Refused:
        with pytest.raises(TypeError, match="int beyond 64 bits"):
            encode(Kind.DATA, 0, 0, obj)
        return
    head_bytes, buffers = encode(Kind.DATA, 0, 0, obj)
    assert buffers == []
    assert decode_head(head_bytes).structure == msgpack.packb(lowered, use_bin_type=True)
    out, _ = transfer(obj)
    assert same(out, obj)


def test_fast_paths_keep_the_general_rules() -> None:
    big = bytes(wire.INLINE_BYTES + 1)
    head = decode_head(encode(Kind.DATA, 0, 0, {"b": big, "n": 1})[0])
    assert [d.kind for d in head.descriptors] == [BufferKind.BYTES]  # out of band, as before
    assert transfer({"b": big, "n": 1})[0] == {"b": big, "n": 1}
    forged_ref = msgpack.ExtType(2, bytes(4))  # a tuple like any other, never a buffer reference
    assert transfer({"x": forged_ref})[0] == {"x": (2, bytes(4))}
    with pytest.raises(TypeError, match="cannot carry Timestamp at data"):
        encode(Kind.DATA, 0, 0, msgpack.Timestamp(1, 0))
    with pytest.raises(TypeError, match=r"cannot carry a torch\.float8_e4m3fn tensor at data;"):
        encode(Kind.DATA, 0, 0, torch.zeros(2, dtype=torch.float8_e4m3fn))
    p = torch.nn.Parameter(torch.arange(4.0).reshape(2, 2))
    out, _ = transfer(p)
    assert type(out) is torch.Tensor and torch.equal(out, p.detach())
    for lone in [torch.arange(5, dtype=torch.uint8), torch.tensor(2.5), np.arange(3), big]:
        assert same(transfer(lone)[0], lone)


# -- small frames --------------------------------------------------------------------------


def small_transfer(obj: object) -> Any:
    body = small.encode(obj)
    assert body is not None, "fits a small frame"
    return small.decode(bytes(body))


@FUZZ
@given(obj=plain_values)
def test_small_frames_decode_as_frames_do(obj: object) -> None:
    try:
        expected, _ = transfer(obj)
    except TypeError as refused:
        with pytest.raises(TypeError, match=str(refused).split(" at ")[0]):
            small.encode(obj)
        return
    assert same(small_transfer(obj), expected)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_small_frames_every_dtype_and_shape(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    t = sample(dtype, shape)
    for obj in (t, [t, (t,)], {"t": t}):
        assert same(small_transfer(obj), transfer(obj)[0])
    if dtype is not torch.bfloat16:
        assert same(small_transfer(t.numpy()), t.numpy())


def test_small_frames_keep_the_general_rules() -> None:
    msg: dict[object, object] = {
        "t": torch.arange(6).reshape(2, 3), "a": np.ones((2, 2), np.float32), "b": b"\x00raw",
        "tup": (1, (2, [3, (torch.zeros(0),)]), ()), "n": np.int64(3), "m": memoryview(b"ab"),
        "x": msgpack.ExtType(2, bytes(4)), None: {2.5: "float key", False: b"", b"k": 0}}
    assert same(small_transfer(msg), transfer(msg)[0])
    z = torch.randn(3, 2, dtype=torch.complex64)
    for t in [torch.arange(24.0).reshape(4, 6).T, z.conj(), torch.randn(3, requires_grad=True),
              torch.nn.Parameter(torch.ones(2))]:
        out = small_transfer(t)
        assert type(out) is torch.Tensor and torch.equal(out, t.detach()) and not out.is_conj()
    with pytest.raises(TypeError, match="cannot carry Timestamp at data"):
        small.encode(msgpack.Timestamp(1, 0))
    with pytest.raises(TypeError, match=r"a torch\.sparse_coo tensor at data;"):
        small.encode(torch.eye(2).to_sparse())  # a lone tensor of another layout
    with pytest.raises(TypeError, match=r"cannot carry an int beyond 64 bits at data\[0\]"):
        small.encode([2**64])
    assert small.encode(torch.zeros(small.BYTES)) is None  # a frame, not small
    assert small.encode(bytes(small.BYTES + 1)) is None
    assert small.encode(torch.zeros((1,) * 17)) is None  # beyond the dims: encode says so


def test_flat_lists_decode_as_frames_do() -> None:
    # A flat list's tensors are laid inline as they lie once their kind was laid out
    # before: a view of that kind laid out otherwise, fewer dims allowed, an int beyond
    # 64 bits and a list beyond the room still take the general rules.
    laid, view = torch.arange(6.0).reshape(3, 2), torch.arange(6.0).reshape(2, 3).T
    z = torch.randn(2, dtype=torch.complex64)
    for flat in ([7, "e", True, None, laid, 2.5], [laid, view], [view], [z, z.conj()], []):
        for _ in range(2):  # the second time, every kind in it is known
            assert same(small_transfer(flat), transfer(flat)[0])
    assert small.encode([laid], max_ndim=1) is None  # too many dims for these limits
    with pytest.raises(TypeError, match=r"an int beyond 64 bits at data\[1\]"):
        small.encode([laid, 2**64])
    assert small.encode([torch.zeros(small.BYTES // 16)] * 8) is None  # beyond the room


LONE = bytes(small.encode(torch.zeros(2)) or b"")  # ext 3: its head (3 bytes), descriptor, data
DESC = LONE[3:-8]


def inline(payload: bytes) -> bytes:
    """A body that is one inline buffer (ext 3) holding ``payload``."""
    return bytes(msgpack.packb(msgpack.ExtType(3, payload)))


@pytest.mark.usefixtures("no_allocation_or_unpickling")
@pytest.mark.parametrize(("body", "message"), [
    (inline(DESC[:2]), "truncated"),
    (LONE[:-1], "not valid msgpack"),  # the extension says more bytes than there are
    (inline(DESC + bytes(7)), "declares"),
    (inline(bytes([99]) + DESC[1:] + bytes(8)), "unknown dtype code"),
    (inline(DESC[:2] + bytes([17]) + DESC[3:] + bytes(8)), "too many dims"),
    (inline(struct.pack("<BBBQQ", 9, 0, 1, 1 << 40, 4 << 40)), "declares"),  # 4 TiB claimed
    (inline(struct.pack("<BBBQQ", 9, 0, 1, 3, 8) + bytes(8)), "shape and dtype make"),
    (msgpack.packb([msgpack.ExtType(1, b""), msgpack.ExtType(1, b"")]), "tuple marker"),
    (msgpack.packb([1, msgpack.ExtType(1, b"")]), "tuple marker"),
    (msgpack.packb(msgpack.ExtType(9, b"")), "unknown extension"),
    (b"\x92\x01", "not valid msgpack"),
])
def test_hostile_small_frames_are_refused_before_allocation(body: bytes, message: str) -> None:
    with pytest.raises(ProtocolError, match=message):
        small.decode(body)
    packet = packet_head(1) + frame_head(1, 7, 0) + body
    with pytest.raises(ProtocolError, match=message):  # in a packet, the same
        small.unpack_packet(packet)


def test_a_tensor_kind_rebuilt_before_is_still_checked() -> None:
    # A kind rebuilt once is kept, and the next of it is rebuilt at once: a body of that kind
    # whose bytes differ from what it declares, or beyond the dims allowed, is still refused.
    for _ in range(2):
        assert torch.equal(small.decode(LONE), torch.zeros(2))  # type: ignore[arg-type]
    for data in (bytes(4), bytes(7), bytes(9), bytes(12)):  # (4 and 12 make whole floats)
        body = inline(DESC + data)
        with pytest.raises(ProtocolError, match="declares"):
            small.decode(body)
    with pytest.raises(ProtocolError, match="too many dims"):
        small.decode(LONE, wire.Limits(max_ndim=0))


@pytest.mark.usefixtures("no_allocation_or_unpickling")
@FUZZ
@given(data=st.binary(max_size=200), marked=st.sampled_from([b"", LONE[:3], b"\x91"]))
def test_random_small_bodies_are_refused_or_plain(data: bytes, marked: bytes) -> None:
    try:
        out = small.decode(marked + data)
    except ProtocolError:
        return
    assert plain(out)


def frame_head(kind: int, tag: int, seq: int) -> bytes:
    """A small frame's head (``small.HEAD``)."""
    return small.HEAD.pack(small.FRAME_BYTE, kind, small.U64_BYTE, tag, small.U64_BYTE, seq)


def run_head(tag: int, seq: int, count: int) -> bytes:
    """The head of a run of ``count`` messages of channel ``tag`` from ``seq`` on."""
    return small.RUN_HEAD.pack(small.FRAME_BYTE, small.RUN, small.U64_BYTE, tag,
                               small.U64_BYTE, seq, small.ARRAY_BYTE, count)


def packet_head(frames: int) -> bytes:
    """The head of a packet of ``frames`` small frames."""
    return small.PACKET_HEAD.pack(small.ARRAY_BYTE, frames)


def frames_of(*frames: tuple[int, int, int, bytes]) -> bytes:
    """A packet's bytes: its head, then each frame's head and body."""
    return packet_head(len(frames)) + b"".join(
        frame_head(kind, tag, seq) + body for kind, tag, seq, body in frames)


def test_a_packet_decodes_in_one_call_and_a_bad_frame_alone() -> None:
    t = torch.arange(3.0)
    bodies = [small.encode(x) for x in ({"a": [1, 2]}, t, (1, (t,)), "s")]
    packet = frames_of(*((1, 5 + i, i, b) for i, b in enumerate(bodies) if b is not None))
    items = small.unpack_packet(packet)
    assert [i[:3] for i in items] == [[1, 5, 0], [1, 6, 1], [1, 7, 2], [1, 8, 3]]
    assert same([i[3] for i in items], [{"a": [1, 2]}, t, (1, (t,)), "s"])
    assert list(small.split_packet(packet))[1][:3] == (1, 6, 1)  # type: ignore[index]
    bad = frames_of((1, 5, 0, bodies[0] or b""), (1, 6, 1, inline(DESC[:2])), (1, 7, 2, b"\xc0"))
    with pytest.raises(ProtocolError):
        small.unpack_packet(bad)
    first, second, third = small.split_packet(bad)  # one by one: the bad one alone refused
    assert first == (1, 5, 0, {"a": [1, 2]}) and third == (1, 7, 2, None)
    assert not isinstance(second, ProtocolError)
    assert second[:3] == (1, 6, 1) and isinstance(second[3], ProtocolError)
    *good, broken = small.split_packet(bad[:-3])  # cut in a frame's head: the rest is lost
    assert len(good) == 2 and isinstance(broken, ProtocolError)
    assert isinstance(list(small.split_packet(bad + b"\x00"))[-1], ProtocolError)  # trailing
    assert isinstance(list(small.split_packet(b"\x93\x01\x02\x03"))[-1], ProtocolError)


def test_a_run_carries_consecutive_messages_of_one_channel() -> None:
    t = torch.arange(3.0)
    bodies = [small.encode(x) or b"" for x in ({"a": [1, 2]}, t, "s")]
    run = run_head(9, 40, len(bodies)) + b"".join(bodies)
    packet = packet_head(2) + frame_head(1, 5, 0) + bodies[2] + run
    items = small.unpack_packet(packet)
    assert items[0] == [1, 5, 0, "s"] and items[1][:3] == [small.RUN, 9, 40]
    assert same(items[1][3], [{"a": [1, 2]}, t, "s"])
    # one by one, a run is its messages, numbered from its first (a bad one refused alone)
    assert [f[:3] for f in small.split_packet(packet)] == [  # type: ignore[index]
        (1, 5, 0), (1, 9, 40), (1, 9, 41), (1, 9, 42)]
    bad = packet_head(1) + run_head(9, 7, 3) + bodies[0] + b"\xc7\x01\x03\x63" + \
        bodies[2]
    with pytest.raises(ProtocolError):
        small.unpack_packet(bad)
    first, second, third = small.split_packet(bad)
    assert first == (1, 9, 7, {"a": [1, 2]}) and third == (1, 9, 9, "s")
    assert second[:3] == (1, 9, 8) and isinstance(second[3], ProtocolError)  # type: ignore
    *good, broken = small.split_packet(bad[:-2])  # a run cut short: the rest is lost
    assert len(good) == 2 and isinstance(broken, ProtocolError)


@FUZZ
@given(objs=st.lists(plain_values, min_size=1, max_size=5), seqs=st.integers(0, 2**64 - 6))
def test_a_packet_decodes_to_what_each_frame_would(objs: list[object], seqs: int) -> None:
    """Frames laid one after the other in a packet decode, in one call, as each alone."""
    expected, bodies = [], []
    for obj in objs:
        try:
            expected.append(transfer(obj)[0])
        except TypeError:
            continue  # refused alike (``test_small_frames_decode_as_frames_do``)
        bodies.append(small.encode(obj))
    frames = [(1, 7 + i, seqs + i, b) for i, b in enumerate(bodies) if b is not None]
    expected = [e for e, b in zip(expected, bodies, strict=True) if b is not None]
    if not frames:
        return
    items = small.unpack_packet(frames_of(*frames))
    assert [item[:3] for item in items] == [list(f[:3]) for f in frames]
    assert same([item[3] for item in items], expected)
    split = list(small.split_packet(frames_of(*frames)))  # one by one: the same
    assert same([frame[3] for frame in split], expected)  # type: ignore[index]
    run = packet_head(1) + run_head(7, seqs, len(frames)) + b"".join(
        f[3] for f in frames)  # as one run: the same messages, numbered from its first
    (item,) = small.unpack_packet(run)
    assert item[:3] == [small.RUN, 7, seqs] and same(item[3], expected)
    split = list(small.split_packet(run))
    assert [f[:3] for f in split] == [(1, 7, seqs + i) for i in range(len(frames))]  # type: ignore
    assert same([frame[3] for frame in split], expected)  # type: ignore[index]


@FUZZ
@given(kind=st.sampled_from([int(Kind.DATA), int(Kind.CREDIT)]), tag=st.integers(0, 2**64 - 1),
       seq=st.integers(0, 2**64 - 1), obj=st.one_of(st.none(), st.text(), st.binary(),
                                                     st.lists(st.integers(-2**63, 2**64 - 1))))
def test_a_frame_sent_alone_is_laid_out_as_the_outbox_lays_it(kind: int, tag: int, seq: int,
                                                              obj: object) -> None:
    """The packet of a frame that leaves at once (``Outbox.alone``) is the one the outbox
    would send had it been queued alone, and decodes to that frame."""
    body = msgpack.packb(obj)
    outbox = small.Outbox(1 << 20)
    outbox.put(3, kind, tag, seq, body)
    alone = small.Outbox.alone(kind, tag, seq, body)
    assert outbox.take(3) == alone
    assert small.unpack_packet(memoryview(alone)[PREAMBLE.size:]) == [[kind, tag, seq, obj]]


@FUZZ
@given(sends=st.lists(st.tuples(st.sampled_from([int(Kind.DATA)] * 3 + [int(Kind.CREDIT)]),
                                st.integers(0, 2), st.binary(max_size=40)), max_size=30),
       frames=st.integers(1, 8), room=st.integers(60, 400))
def test_the_outbox_lays_out_each_frame_in_order(sends: list[tuple[int, int, bytes]],
                                                 frames: int, room: int) -> None:
    """Frames queued for one rank come out of its packets in the order they were queued,
    each with its own channel and number (consecutive messages of a channel as runs)."""
    outbox = small.Outbox(room)
    outbox.packet_frames = frames
    packets, queued, seqs = [], [], [0, 0, 0]
    for kind, tag, data in sends:
        body = msgpack.packb(data)
        seq = seqs[tag] if kind == Kind.DATA else 0
        if outbox.put(1, kind, tag, seq, body) < 0:  # full: sent, then queued in the next
            packets.append(outbox.take(1))
            assert outbox.put(1, kind, tag, seq, body) == 1
        queued.append((kind, tag, seq, data))
        seqs[tag] += kind == Kind.DATA
    packets.append(outbox.take(1))
    laid = [frame for packet in packets if packet is not None
            for frame in small.split_packet(memoryview(packet)[PREAMBLE.size:])]
    assert laid == queued


class _Delivered(Delivery):
    """A delivery with the router's two hooks as no-ops (credit, control frames), and no
    link: nothing is taken from it, so it returns no credit."""

    def __init__(self) -> None:
        super().__init__(0, wire.Limits(), None, 64, 64 << 20)  # type: ignore[arg-type]

    def _credit(self, src: int, tag: int, messages: int, nbytes: int) -> None:
        pass

    def _control(self, frame: Frame) -> None:
        pass


_kinds = st.sampled_from([int(Kind.DATA), small.RUN, small.RUN, int(Kind.CREDIT), 99])
_frame = st.tuples(_kinds, st.sampled_from([0, 0, 1, "1"]), st.sampled_from([0, 0, 0, 1, 2, -1]),
                   st.one_of(st.lists(plain_values, max_size=3), st.none(), st.integers(),
                             st.text(max_size=3), plain_values)).map(list)
_items = st.lists(st.one_of(_frame, _frame, _frame, plain_values), max_size=6)  # few not frames


@FUZZ
@given(packets=st.lists(_items, min_size=1, max_size=3))
@example(packets=[[[small.RUN, 0, 0, None]]])  # runs whose messages are not an array
@example(packets=[[[small.RUN, 0, 0, "ab"]]])
@example(packets=[[[small.RUN, 1, 0, {"a": 1}], [1, 1, 0, "after"]]])
def test_forged_packets_are_taken_without_raising(packets: list[list[object]]) -> None:
    """Any packet that decodes -- frames, runs, out of sequence, malformed -- is taken
    without raising (the link's poll would die of it): what is kept is a message of its
    channel or a refusal."""
    delivery, one_by_one = _Delivered(), _Delivered()
    for items in packets:
        try:
            data = msgpack.packb(items)
        except OverflowError:  # an int msgpack cannot carry: no such packet comes
            continue
        view = memoryview(bytearray(16) + data)
        delivery.packet(1, view, 16, len(view))
        one_by_one._packet_slowly(1, view[16:])  # the oracle: frame by frame
    for tag, box in delivery._mailboxes.items():
        for entry in box.frames:
            assert type(entry) is Message or entry.error is not None, entry
            if type(entry) is Message:
                assert entry.src == 1 and entry.tag == tag

    def kept(d: Delivery) -> dict[int, list[object]]:  # the messages, and which were refused
        return {tag: [e.data if type(e) is Message else "refused" for e in box.frames
                      if type(e) is Message or "broken" not in str(e.error)]
                for tag, box in d._mailboxes.items()}

    fast, slow = kept(delivery), kept(one_by_one)
    assert {t: m for t, m in fast.items() if m} == {t: m for t, m in slow.items() if m}
    assert set(delivery._broken) == set(one_by_one._broken)
