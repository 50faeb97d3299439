"""Small frames: the layout of a small message, encoded and decoded in one step each.

A message of the DEFAULT codec whose bytes all fit in ``BYTES`` may travel instead of a frame
(``wire``) as a *small frame*: plain msgpack, every buffer inline as an extension (code 3) holding
its descriptor (as in a frame's head), then its bytes::

    small frame  fixarray 4: kind | tag | seq | the message (its *body*)
    inline       ext 3: descriptor (as above) | the buffer's bytes

The frame's first three items are fixed-width (``HEAD``: a positive fixint and two uint64), so a
sender lays the head of a message whose body is packed already in one step. Consecutive messages of
one channel to one rank travel as a *run*: one head, then their bodies as one array (``RUN_HEAD``)::

    run          fixarray 4: RUN | tag | first seq | array 32 of bodies

(message ``i`` of a run has sequence number ``first seq + i``), so each message after a run's first
costs its sender its body's bytes alone, and its receiver no head. Small frames and runs to one rank
are laid one after the other as the items of one msgpack array (a *packet*, see ``link``), and a
packet is decoded in one ``unpack`` call (``unpack_packet``): every extension and tuple checked as a
frame's would be (a message decodes to what its frame would), none allocated before it is. A packet
that does not decode as a whole is taken apart frame by frame (``split_packet``), so a malformed
frame fails its own channel only.

The outbox (``Outbox``) queues small frames per destination as packets until they are sent. A packet
is one link message (see ``link``'s note on the layout): room for the preamble and the packet's head
(laid when it goes: ``take``), then each frame's head and body (``HEAD``), read on arrival as one
msgpack array. A lone message becomes a run when the next of its channel follows (its channel and
sequence number read back from its head then: nothing is kept for it before).
"""

from __future__ import annotations

import ctypes
import functools
import struct
import threading
from collections.abc import Callable, Iterator
from typing import Any, Final, NamedTuple

import msgpack
import torch

from asyncomm._core.errors import ProtocolError
from asyncomm._core.messages import PACKET, PREAMBLE
from asyncomm._core.wire import (
    _BUFFER_KINDS,
    _CODES,
    _DESC,
    _DESCS,
    _DTYPES,
    _EXT_INLINE,
    _EXT_TUPLE,
    Buffer,
    BufferKind,
    Codec,
    Descriptor,
    Kind,
    Limits,
    _descriptor,
    _lower,
    _misfit,
    _Outgoing,
    _pack,
    _rebuild,
    _Refused,
    _tensor,
    read_structure,
    unpack,
)

# a small frame's head, msgpack: fixarray 4, kind (a positive fixint), uint64 tag, uint64 seq
HEAD: Final = struct.Struct(">BBBQBQ")
FRAME_BYTE, U64_BYTE = 0x94, 0xcf  # its fixed bytes: HEAD.pack(FRAME_BYTE, kind, U64_BYTE, ...)
TAG_AT, SEQ_AT = struct.calcsize(">BBB"), struct.calcsize(">BBBQB")  # where its uint64s lie
PACKET_HEAD: Final = struct.Struct(">BI")  # a packet's head: array 32, its frames
PACKET_HEAD_BYTES: Final = PACKET_HEAD.size
ARRAY_BYTE: Final = 0xdd  # msgpack's array 32
# A run's kind (a small frame's only: a wire frame has none such), and its head: a frame's,
# then an array 32 of its bodies, their count laid last (``RUN_COUNT_AT``) once it is known.
RUN: Final = 7
assert RUN not in set(Kind), "a run's kind is a small frame's only"
RUN_HEAD: Final = struct.Struct(">BBBQBQBI")
RUN_COUNT_AT: Final = HEAD.size + 1
DATA: Final = int(Kind.DATA)
BYTES: Final = 8 << 10  # the most bytes a small frame's body holds
_LIMITS: Final = Limits()


class _Packers(threading.local):
    """This thread's packers of small bodies (a hook is Python code, so a thread can be
    switched mid-pack: threads share no packer). ``strict`` packs exact scalars, lists and
    dicts, and refuses the rest; ``flat`` packs a flat list (``_FLAT_ITEMS``) whose tensors
    ``_lay_known`` lays inline."""

    def __init__(self) -> None:
        self.strict: Callable[[object], bytes] = msgpack.Packer(
            use_bin_type=True, strict_types=True).pack
        self.flat: Callable[[object], bytes] = msgpack.Packer(
            use_bin_type=True, strict_types=True, default=_lay_known).pack

    def packed(self, body: bytes) -> None:
        """Replace the packers after a large ``body`` (a packer keeps its buffer as it grew)."""
        if len(body) > 4 * BYTES:
            type(self).__init__(self)


def _lay_known(item: object) -> msgpack.ExtType:
    """Return ``item`` laid inline, a tensor laid out before (``_known``) within the default
    dims; raise ``_NotLaid`` at anything else (the hook of ``_Packers.flat``)."""
    if type(item) is torch.Tensor:
        known = _known(item, _LIMITS.max_ndim)
        if known is not None:
            return known.inline(item)
    raise _NotLaid


class _NotLaid(Exception):
    """Raised by ``_lay_known``: the message takes the full lowering."""


_packers = _Packers()


class _TooBig(Exception):
    """Raised while encoding a small frame whose buffers exceed its bound."""


class _Inline(_Outgoing):
    """Buffers laid inline, as extensions: for small frames, within ``room`` bytes."""

    __slots__ = ("max_ndim", "room")

    def __init__(self, room: int, max_ndim: int) -> None:
        super().__init__()
        self.room, self.max_ndim = room, max_ndim

    def add(self, code: int, shape: tuple[int, ...], kind: BufferKind, buffer: Buffer,
            nbytes: int) -> msgpack.ExtType:
        self.room -= nbytes
        if self.room < 0 or len(shape) > self.max_ndim:  # ``encode`` refuses the latter
            raise _TooBig
        # a tensor's bytes are copied where they lie (contiguous CPU memory): the cheapest
        data = (ctypes.string_at(buffer.data_ptr(), buffer.nbytes)
                if isinstance(buffer, torch.Tensor) else bytes(buffer))
        return _inline_ext(_laid(code, kind, shape, nbytes) + data)

    def tensor(self, t: torch.Tensor) -> msgpack.ExtType:
        """Lay a tensor inline, read where it lies (no flat view: the cheapest)."""
        known = _known(t, self.max_ndim)
        if known is None:
            code = _CODES.get(t.dtype) if t.layout is torch.strided else None
            if code is None:
                return _tensor(t, self)  # which refuses it
            if not (t.is_cpu and t.is_contiguous()) or t.is_conj() or t.is_neg():
                t = t.detach().cpu().resolve_conj().resolve_neg().contiguous()  # as laid inline
            if t.nbytes > self.room or t.dim() > self.max_ndim:
                raise _TooBig
            known = _keep_known(t, code)
        self.room -= known.nbytes
        if self.room < 0:
            raise _TooBig
        return known.inline(t)


def _inline_ext(payload: bytes) -> msgpack.ExtType:
    """Return ``ExtType(3, payload)``, made as the tuple it is (its checking ``__new__`` costs
    as much as the rest of a small tensor's encoding)."""
    return tuple.__new__(msgpack.ExtType, (_EXT_INLINE, payload))  # type: ignore[type-var]


@functools.lru_cache(maxsize=256)
def _laid(code: int, kind: int, shape: tuple[int, ...], nbytes: int) -> bytes:
    """Return a descriptor's bytes (as in a head)."""
    return _DESCS[len(shape)].pack(code, kind, len(shape), *shape, nbytes)


def span(tensor: object, table: dict[torch.dtype, Any]) -> tuple[int, int, Any] | None:
    """Return where a tensor a backend's quick operation moves lies: (address, bytes,
    ``table``'s value for its dtype), for exactly a ``torch.Tensor`` laid out in host
    memory whose dtype ``table`` holds and whose bytes a C ``int`` counts; else ``None``
    (the usual path takes it).

    Every operation calls it: each check is one torch call, and none is repeated (a
    tensor whose bytes a C ``int`` counts has no more elements than that; only a complex
    tensor can be a conjugate view)."""
    if (type(tensor) is torch.Tensor and tensor.layout is _STRIDED
            and tensor.is_cpu and tensor.is_contiguous() and not tensor.is_neg()):
        dtype = tensor.dtype
        value = table.get(dtype)
        if value is not None and not (dtype in _COMPLEX and tensor.is_conj()):
            nbytes = tensor.nbytes
            if nbytes <= _MAX_COUNT:
                return tensor.data_ptr(), nbytes, value
    return None


_COMPLEX: Final = frozenset({torch.complex32, torch.complex64, torch.complex128})
_MAX_COUNT = 2**31 - 1  # the most an MPI count (a C int) holds


def encode(obj: object, room: int = BYTES, max_ndim: int = 16) -> bytes | None:
    """Return the body of a small frame (DEFAULT codec) carrying ``obj``, or ``None``.

    ``None``: ``obj`` needs more than ``room`` bytes; it travels as a frame (``encode``).

    Raises:
        TypeError: the DEFAULT codec cannot carry something in ``obj`` (names it and where).
    """
    if type(obj) is torch.Tensor:  # a lone tensor, the commonest: laid out here
        known = _known(obj, max_ndim)
        if known is not None and known.nbytes <= room - 256:
            return known.lone + known.data(obj)
        if obj.layout is _STRIDED and obj.nbytes > room - 256:
            return None  # too large for a small frame: it travels as a frame
    if type(obj) is not list:  # a list is likelier to hold a tensor: lowered at once
        try:
            body: bytes = _packers.strict(obj)  # only exact scalars, lists and dicts pass
        except (TypeError, OverflowError):
            pass
        else:  # ... and ExtType, Timestamp, which msgpack packs as they are: lowered instead
            if len(body) > room:
                _packers.packed(body)
                return None
            if body.translate(_EXT_BYTES).find(1) < 0:
                return body
    if (type(obj) is list and max_ndim >= _LIMITS.max_ndim
            and _FLAT_ITEMS.issuperset(map(type, obj))):  # (a C-level pass)
        # Scalars and tensors side by side (an actor's request or reply): packed in one call;
        # a tensor not laid out before and an int beyond 64 bits take the full lowering.
        try:
            body = _packers.flat(obj)
        except _NotLaid:
            pass
        else:
            _packers.packed(body)
            return body if len(body) <= room else None
    try:
        out = _Inline(room, max_ndim)
        body = _pack(_lower(obj, out))
    except _TooBig:
        return None
    except _Refused as e:
        raise e.error() from None
    return body if len(body) <= room else None


_STRIDED: Final = torch.strided
_FLAT_ITEMS: Final = frozenset({type(None), bool, int, float, str, torch.Tensor})


class _Known(NamedTuple):
    """What is kept of a tensor laid out before; a tensor found here still has its memory
    checked (strided, contiguous, host, no neg or conj bit: ``_known``)."""

    descriptor: bytes  # as in a head
    lone: bytes  # the body's prefix of a message that is this tensor alone
    nbytes: int
    real: bool  # not complex: it cannot be a conj view
    ndim: int
    array: type[ctypes.Array[ctypes.c_char]]  # its bytes, to copy (cheaper than string_at)

    def data(self, t: torch.Tensor) -> bytes:
        """Return a copy of ``t``'s bytes (``t`` laid out as it lies)."""
        return self.array.from_address(t.data_ptr()).raw

    def inline(self, t: torch.Tensor) -> msgpack.ExtType:
        """Return ``t`` laid inline (an extension: its descriptor, then a copy of its bytes)."""
        return _inline_ext(self.descriptor + self.data(t))


# tensors laid out before, by kind (each of them fits a small frame)
_KNOWN: dict[tuple[torch.dtype, torch.Size], _Known] = {}


def _known(t: torch.Tensor, max_ndim: int) -> _Known | None:
    """Return what ``_KNOWN`` keeps of ``t``'s kind if ``t`` is laid out as it lies, else None."""
    known = _KNOWN.get((t.dtype, t.shape))
    if (known is not None and known.ndim <= max_ndim and t.layout is _STRIDED
            and t.is_contiguous() and t.is_cpu and not t.is_neg()
            and (known.real or not t.is_conj())):
        return known
    return None


def _keep_known(t: torch.Tensor, code: int) -> _Known:
    """Keep what ``_known`` returns for ``t``'s kind (``t`` laid out as it lies); return it."""
    if len(_KNOWN) >= 256:
        _KNOWN.clear()
    shape, nbytes = tuple(t.shape), t.nbytes
    descriptor = _laid(code, BufferKind.TENSOR, shape, nbytes)
    # ``lone``: the head of the inline extension a lone tensor is, then its descriptor
    size = len(descriptor) + nbytes
    ext = (struct.pack(">BBb", 0xc7, size, _EXT_INLINE) if size < 1 << 8
           else struct.pack(">BHb", 0xc8, size, _EXT_INLINE) if size < 1 << 16
           else struct.pack(">BIb", 0xc9, size, _EXT_INLINE))
    known = _KNOWN[(t.dtype, t.shape)] = _Known(
        descriptor, ext + descriptor, nbytes, not t.is_complex(), len(shape),
        ctypes.c_char * nbytes)
    return known


# The bytes that start a msgpack extension (fixext 1-16, ext 8/16/32): a body without any
# holds none (one with some may, or may only hold them as data).
# As a table for ``bytes.translate``: 1 for those bytes, 0 for the others.
_EXT_BYTES: Final = bytes(1 if 0xc7 <= b <= 0xc9 or 0xd4 <= b <= 0xd8 else 0 for b in range(256))


def decode(body: bytes | memoryview, limits: Limits = _LIMITS) -> object:
    """Rebuild the message of a small frame's body (tensors get memory of their own).

    Raises:
        ProtocolError: malformed, or a buffer that ``decode_head`` would refuse.
    """
    return read_structure(body, _hook(limits))


def unpack_packet(data: bytes | memoryview, limits: Limits = _LIMITS) -> list[Any]:
    """Return the items of a packet (each should be a frame: ``[kind, tag, seq, message]``).

    The caller checks each item's shape; the messages are checked here, as ``decode`` checks a body.

    Raises:
        ProtocolError: a malformed packet or frame (``split_packet`` tells which).
    """
    hook = _hook(limits)
    try:
        items = unpack(data, hook, passing=_HasTuple)
    except _HasTuple:  # a tuple in it (its marker, an extension): unpacked again, tuples rebuilt
        items = read_structure(data, hook)
    if type(items) is not list:
        raise ProtocolError("a packet that is not an array")
    return items


def split_packet(data: bytes | memoryview, limits: Limits = _LIMITS
                 ) -> Iterator[tuple[int, int, int, object] | ProtocolError]:
    """Take a packet apart frame by frame: yield each frame's head and message, in order.

    A frame whose message is malformed yields its head and the ``ProtocolError``
    as the message; a malformed packet or frame head yields a ``ProtocolError`` alone
    and ends (what follows cannot be found).
    """
    data = bytes(data)
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False, timestamp=1,
                                max_buffer_size=max(len(data), 1))
    unpacker.feed(data)
    try:
        count = unpacker.read_array_header()
        for _ in range(count):
            if unpacker.read_array_header() != 4:
                raise ValueError("a frame that is not of 4 items")
            kind, tag, seq = unpacker.unpack(), unpacker.unpack(), unpacker.unpack()
            if not (type(kind) is int and type(tag) is int and type(seq) is int):
                raise ValueError("a frame head that is not three ints")
            if kind != RUN:
                yield kind, tag, seq, _message(unpacker, data, limits)
                continue
            for i in range(unpacker.read_array_header()):  # a run: its messages one by one
                yield DATA, tag, seq + i, _message(unpacker, data, limits)
    except (ValueError, msgpack.OutOfData, msgpack.ExtraData, msgpack.FormatError,
            msgpack.StackError, TypeError, UnicodeDecodeError) as exc:
        yield ProtocolError(f"malformed packet: {exc}")
        return
    if unpacker.tell() != len(data):
        yield ProtocolError("a packet with bytes after its frames")


def _message(unpacker: msgpack.Unpacker, data: bytes, limits: Limits) -> object:
    """Decode the body ``unpacker`` is at: its message, or the ``ProtocolError`` it makes."""
    start = unpacker.tell()
    unpacker.skip()
    try:
        return decode(data[start:unpacker.tell()], limits)
    except ProtocolError as exc:
        return exc


def _hook(limits: Limits) -> Callable[[int, bytes], object]:
    """Return the extension hook of small frames under ``limits`` (kept by the one limit it
    checks, the dims)."""
    max_ndim = limits.max_ndim
    hook = _HOOKS.get(max_ndim)
    if hook is None:
        def hook(code: int, payload: bytes) -> object:
            if code == _EXT_INLINE:
                return inline_buffer(payload, max_ndim)
            if code == _EXT_TUPLE:
                raise _HasTuple  # (``read_structure`` takes tuple markers before the hook)
            raise ProtocolError(f"frame structure has an unknown extension {code}")
        _HOOKS[max_ndim] = hook
    return hook


class _HasTuple(Exception):
    """Raised by the hook at a tuple's marker: the structure is unpacked again, with tuples."""


_HOOKS: dict[int, Callable[[int, bytes], object]] = {}


def inline_buffer(payload: bytes, max_ndim: int = _LIMITS.max_ndim) -> object:
    """Rebuild an inline buffer, checked as ``decode_head`` checks a descriptor (a plain
    tensor's kind, once checked, is kept: the next of it is rebuilt at once)."""
    size = _DESC_BYTES[payload[2]] if len(payload) > 2 else 0
    kind = _TENSORS.get(payload[:size])  # (the commonest: a tensor of a kind checked before)
    if kind is not None and len(payload) == size + kind[1] and payload[2] <= max_ndim:
        dtype, _, shape = kind
        tensor = torch.frombuffer(bytearray(payload[size:]), dtype=dtype)
        return tensor if shape is None else tensor.reshape(shape)
    if len(payload) < _DESC.size or payload[2] > max_ndim:
        raise ProtocolError("inline buffer: truncated, or too many dims")
    if len(payload) < size:
        raise ProtocolError("inline buffer truncated")
    raw, data = payload[:size], payload[size:]
    d = _INLINE_DESCRIPTORS.get(raw) or _inline_descriptor(raw)
    if len(data) != d.nbytes:
        raise ProtocolError(f"inline buffer of {len(data)} bytes declares {d.nbytes}")
    if d.kind is BufferKind.BYTES:
        return bytes(data)
    if d.kind is not BufferKind.TENSOR or not d.nbytes or d.dtype is torch.bool:
        return _rebuild(d, torch.frombuffer(bytearray(data), dtype=torch.uint8) if d.nbytes
                        else torch.empty(0, dtype=torch.uint8))
    _TENSORS[raw] = (d.dtype, d.nbytes, None if len(d.shape) == 1 else d.shape)
    return inline_buffer(payload, max_ndim)  # (kept now: rebuilt as the next of its kind)


_INLINE_DESCRIPTORS: dict[bytes, Descriptor] = {}  # checked already (shapes repeat)
# ... of those, the tensors a plain view rebuilds (non-empty, not bool): dtype, bytes of data,
# and shape (None: flat as it comes)
_TENSORS: dict[bytes, tuple[torch.dtype, int, tuple[int, ...] | None]] = {}
_DESC_BYTES: Final = [s.size for s in _DESCS]  # a descriptor's bytes, by its ndim


def _inline_descriptor(raw: bytes) -> Descriptor:
    """Return the descriptor of an inline buffer, checked; keep it (up to 1024 kept)."""
    fields = _DESCS[raw[2]].unpack(raw)  # code, kind, ndim, *shape, nbytes
    code, bkind, shape, nbytes = fields[0], fields[1], fields[3:-1], fields[-1]
    dtype, kind = _DTYPES.get(code), _BUFFER_KINDS.get(bkind)
    if dtype is None or kind is None or kind is BufferKind.STRUCTURE:
        raise ProtocolError(f"inline buffer: unknown dtype code {code} or buffer kind {bkind}")
    if problem := _misfit(dtype, shape, nbytes, kind, Codec.DEFAULT, True, False):
        raise ProtocolError(f"inline buffer ({kind.name}, {dtype}, {shape}): {problem}")
    if len(_INLINE_DESCRIPTORS) >= 1024:
        _INLINE_DESCRIPTORS.clear()
        _TENSORS.clear()
    d = _INLINE_DESCRIPTORS[raw] = _descriptor(code, bkind, shape, nbytes)
    return d


# -- the outbox ----------------------------------------------------------------------

_small_head, _SMALL_HEAD_BYTES = HEAD.pack, HEAD.size
_lay_count = struct.Struct(">I").pack_into
# a lone message's head becomes a run's: its kind set, then these bytes (array 32, count)
_RUN_MORE = bytes([ARRAY_BYTE]) + bytes(4)
_RUN_MORE_BYTES = RUN_HEAD.size - _SMALL_HEAD_BYTES
# a lone message's channel and sequence number, read back from its head (``HEAD``)
_U64_AT = struct.Struct(">Q").unpack_from
_PACKET_AT = PREAMBLE.size + PACKET_HEAD_BYTES  # a packet's first frame
_PREAMBLE_INTO, _PREAMBLE_BYTES = PREAMBLE.pack_into, PREAMBLE.size
_lay_packet_head = PACKET_HEAD.pack_into  # (buffer, at, ARRAY_BYTE, frames)
_PREAMBLE_PACK = PREAMBLE.pack
_alone_head = struct.Struct(PACKET_HEAD.format + HEAD.format[1:]).pack  # packet head, frame head
_ALONE_BYTES = PACKET_HEAD_BYTES + _SMALL_HEAD_BYTES
_join = bytearray().join  # (one bytearray of the parts, made in one step)


class Packet(bytearray):
    """A packet as its frames are queued (see the module's note).

    Made as ``Packet(_PACKET_AT)`` (bytearray's own constructor: zeroed), then its fields
    set (``_start``): a constructor in Python costs as much as the rest of queuing a frame.
    """

    __slots__ = ("frames", "items", "lone", "next", "run", "run_at", "run_from")
    frames: int  # messages in it (a run's each counted)
    items: int  # its array's items: frames and runs
    next: int  # the sequence number that continues its last item, an open run (-1: none)
    run: int  # the open run's channel
    run_at: int  # where the open run's head begins
    run_from: int  # ``frames`` when the open run began
    lone: int  # where its last item's head begins, a lone message (-1: not one)


class Outbox:
    """Packets of at most ``packet_bytes`` (and ``packet_frames`` frames), per destination."""

    def __init__(self, packet_bytes: int) -> None:
        self.packet_bytes = packet_bytes
        self.packet_frames = 1 << 61
        self._packets: dict[int, Packet] = {}

    def put(self, dst: int, kind: int, tag: int, seq: int, body: bytes) -> int:
        """Queue a small frame of ``kind`` for ``dst``: 0 queued in the packet that waits, 1
        queued as the first of a new packet, -1 not queued: the packet is full (the caller
        sends it, ``take``, and calls again). A message (``DATA``) after the last one queued
        for ``dst`` on the same channel (the commonest, in a burst) adds its body to that
        run; after a lone message, it makes that a run first. Any other frame goes alone."""
        packet = self._packets.get(dst)
        if kind == DATA and packet is not None and packet.frames < self.packet_frames:
            if (packet.next == seq and packet.run == tag
                    and len(packet) + len(body) <= self.packet_bytes):
                packet += body
                packet.frames += 1
                packet.next = seq + 1
                return 0
            at = packet.lone
            if (at >= 0 and len(packet) + _RUN_MORE_BYTES + len(body) <= self.packet_bytes
                    and _U64_AT(packet, at + SEQ_AT)[0] + 1 == seq
                    and _U64_AT(packet, at + TAG_AT)[0] == tag):
                # the second of a run: the lone message's head becomes the run's
                packet[at + 1] = RUN
                packet[at + _SMALL_HEAD_BYTES:at + _SMALL_HEAD_BYTES] = _RUN_MORE
                packet += body
                packet.run, packet.run_at, packet.run_from = tag, at, packet.frames - 1
                packet.frames += 1
                packet.next, packet.lone = seq + 1, -1
                return 0
        return self._lone(packet, dst, kind, tag, seq, body)

    def _lone(self, packet: Packet | None, dst: int, kind: int, tag: int, seq: int,
              body: bytes) -> int:
        """``put``'s frame that does not extend a run, in ``dst``'s ``packet`` (``None``:
        none waits); a message's may begin one."""
        started = 0
        if packet is None:
            packet = self._start(dst)
            started = 1
        elif (len(packet) + _SMALL_HEAD_BYTES + len(body) > self.packet_bytes
                or packet.frames >= self.packet_frames):
            return -1
        elif packet.next >= 0:  # a run is open: it ends here
            _lay_count(packet, packet.run_at + RUN_COUNT_AT, packet.frames - packet.run_from)
            packet.next = -1
        packet.lone = len(packet) if kind == DATA else -1
        packet += _small_head(FRAME_BYTE, kind, U64_BYTE, tag, U64_BYTE, seq)
        packet += body
        packet.frames += 1
        packet.items += 1
        return started

    def _start(self, dst: int) -> Packet:
        packet = self._packets[dst] = Packet(_PACKET_AT)
        packet.frames = packet.items = 0
        packet.next = packet.lone = packet.run = -1  # (``run`` is read only with ``next``)
        return packet

    def take(self, dst: int) -> bytearray | None:
        """Return ``dst``'s packet laid out whole (no longer queued), or ``None``."""
        packet = self._packets.pop(dst, None)
        if packet is None:
            return None
        if packet.next >= 0:  # a run is open: its count
            _lay_count(packet, packet.run_at + RUN_COUNT_AT, packet.frames - packet.run_from)
        _PREAMBLE_INTO(packet, 0, 0, len(packet) - _PREAMBLE_BYTES, 0, PACKET)
        _lay_packet_head(packet, _PREAMBLE_BYTES, ARRAY_BYTE, packet.items)
        return packet

    @staticmethod
    def alone(kind: int, tag: int, seq: int, body: bytes) -> bytearray:
        """Return the packet of one small frame, laid out whole: what ``take`` would return
        had the frame been queued alone (a frame that leaves at once, see ``link``)."""
        return _join((_PREAMBLE_PACK(0, _ALONE_BYTES + len(body), 0, PACKET),
                      _alone_head(ARRAY_BYTE, 1, FRAME_BYTE, kind, U64_BYTE, tag, U64_BYTE, seq),
                      body))

    def queued(self, dst: int) -> bool:
        """Return whether a packet for ``dst`` waits."""
        return dst in self._packets

    def dsts(self) -> list[int]:
        """Return the destinations whose packets wait, in the order they were begun."""
        return list(self._packets)
