"""The wire format: one frame layout and two codecs, the same bytes on every backend.

A frame is a *head* followed by raw *buffers*. The head is a fixed prefix, one descriptor per buffer
and the *structure* (the message with every buffer replaced by a reference to it). Buffers travel
from their own memory: tensors, arrays and large ``bytes`` are never copied into the head. This
module does no I/O; a transport sends ``encode``'s head and buffers, and the other side calls
``decode_head`` -> (receive each buffer into a flat uint8 CPU tensor) -> ``decode``.

Note: layout (integers little-endian; buffers hold little-endian elements)::

    prefix      4s magic "ACMF" | u8 version | u8 kind | u8 codec | u8 flags (0)
                u64 tag | u64 seq | u32 descriptors | u32 structure bytes | u32 head bytes
    descriptor  u8 dtype code | u8 buffer kind | u8 ndim | u64 x ndim shape | u64 nbytes
    structure   msgpack (DEFAULT) or pickle protocol 5 (PICKLE) bytes

Note: a structure larger than ``INLINE_BYTES`` travels as the last buffer (kind STRUCTURE)
instead of in the head, so heads stay small whatever the message; ``bytes`` values larger
than ``INLINE_BYTES`` go out of band too.

Note: small messages travel in a layout of their own: see ``small``.
"""

from __future__ import annotations

import enum
import functools
import io
import math
import operator
import pickle
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

import msgpack
import numpy as np
import torch

from asyncomm._core.errors import ProtocolError

MAGIC: Final = b"ACMF"
VERSION: Final = 1
INLINE_BYTES: Final = 1 << 16
_PREFIX: Final = struct.Struct("<4sBBBBQQIII")
SEQ_AT: Final = struct.calcsize("<4sBBBBQ")  # a head's seq: after magic, version, kind, ..., tag
_SEQ: Final = struct.Struct("<Q")
_DESC: Final = struct.Struct("<BBB")
PREFIX_BYTES: Final = _PREFIX.size
_U64: Final = 1 << 64
_EXT_TUPLE, _EXT_BUFFER, _EXT_INLINE = 1, 2, 3  # msgpack extension codes of the DEFAULT codec
_TUPLE_EXT: Final = msgpack.ExtType(_EXT_TUPLE, b"")  # first item of an array that is a tuple
_TUPLE_BYTES: Final = msgpack.packb(_TUPLE_EXT)
_INT_MIN: Final = -(1 << 63)
# Precompiled layouts and references, so hot paths never build them per message.
_DESCS: Final = [struct.Struct(f"<BBB{ndim + 1}Q") for ndim in range(256)]  # [ndim]
_REFS: Final = [msgpack.ExtType(_EXT_BUFFER, struct.pack("<I", i)) for i in range(64)]
_LONE_REF: Final[bytes] = msgpack.packb(_REFS[0])  # the structure of a message that is one buffer


class Kind(enum.IntEnum):
    """What a frame is for; the layers above give it meaning."""

    DATA = 1
    EOS = 2
    CREDIT = 3
    REQUEST = 4
    REPLY = 5
    ERROR = 6


class Codec(enum.IntEnum):
    """How the structure is serialised: msgpack (never unpickles) or pickle protocol 5."""

    DEFAULT = 0
    PICKLE = 1


class BufferKind(enum.IntEnum):
    """What a buffer becomes on decode."""

    TENSOR = 0
    NDARRAY = 1
    BYTES = 2
    STRUCTURE = 3  # the frame's own structure, too large for the head


# The allow-list; a dtype's position is its wire code, so only ever append.
_DTYPES: Final[dict[int, torch.dtype]] = dict(enumerate([
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64,
    torch.complex128, torch.uint16, torch.uint32, torch.uint64], start=1))
_CODES: Final = {dtype: code for code, dtype in _DTYPES.items()}
# Lookups instead of Enum(value) calls, which are slow; Enum(value) still raises for the rest.
_KINDS: Final[dict[int, Kind]] = {k: k for k in Kind}
_CODECS: Final[dict[int, Codec]] = {c: c for c in Codec}
_BUFFER_KINDS: Final[dict[int, BufferKind]] = {k: k for k in BufferKind}
_SCALARS: Final = frozenset({type(None), bool, int, float, str, bytes})  # msgpack packs these as is
_FROM_NUMPY: Final = {np.dtype(str(dtype).removeprefix("torch.")): dtype
                      for dtype in _DTYPES.values() if dtype is not torch.bfloat16}
_NUMPY_CODES: Final = {np_dtype: _CODES[dtype] for np_dtype, dtype in _FROM_NUMPY.items()}
_U8: Final = _CODES[torch.uint8]


@dataclass(frozen=True, slots=True)
class Limits:
    """What a receiver accepts; ``decode_head`` checks every head against it."""

    max_message_bytes: int = 1 << 30  # buffer bytes + structure bytes
    max_buffers: int = 1 << 12
    max_head_bytes: int = 1 << 20
    max_ndim: int = 16


@dataclass(frozen=True, slots=True)
class Descriptor:
    """One buffer: its element type and shape, its size in bytes, what it becomes."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int
    kind: BufferKind


@dataclass(frozen=True, slots=True)
class Head:
    """A validated frame head, as returned by ``decode_head``."""

    kind: Kind
    codec: Codec
    tag: int
    seq: int
    descriptors: tuple[Descriptor, ...]
    structure: bytes
    size: int = 0  # the head's length in bytes
    payload_bytes: int = 0  # the bytes of all buffers that follow the head
    lone: bool = False  # the message is its one buffer (a tensor, array or bytes), as is


Buffer = memoryview | torch.Tensor


class _Refused(Exception):
    """Raised inside ``_lower``; ``path`` gathers the location innermost first."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.path: list[str] = []

    def error(self) -> TypeError:
        """Return the ``TypeError`` that tells the caller what was refused, and where."""
        where = "data" + "".join(reversed(self.path))
        return TypeError(f"the default codec cannot carry {self.what} at {where}; "
                         f'use comm.channel(tag, codec="pickle")')


_Laid = tuple[int, int, tuple[int, ...], int]  # a descriptor as laid out: code, kind, shape, nbytes


class _Outgoing:
    """The descriptors and buffers of a frame being encoded."""

    __slots__ = ("buffers", "descriptors")

    def __init__(self) -> None:
        self.descriptors: list[_Laid] = []  # tuples, not Descriptors: encode only lays them out
        self.buffers: list[Buffer] = []

    def add(self, code: int, shape: tuple[int, ...], kind: BufferKind, buffer: Buffer,
            nbytes: int) -> msgpack.ExtType:
        i = len(self.buffers)
        self.descriptors.append((code, kind, shape, nbytes))
        self.buffers.append(buffer)
        return _REFS[i] if i < len(_REFS) else msgpack.ExtType(_EXT_BUFFER, struct.pack("<I", i))

    def tensor(self, t: torch.Tensor) -> msgpack.ExtType:
        return _tensor(t, self)


def _tensor(t: torch.Tensor, out: _Outgoing) -> msgpack.ExtType:
    code = _CODES.get(t.dtype) if t.layout is torch.strided else None
    if code is None:
        what = t.dtype if t.layout is torch.strided else t.layout
        raise _Refused(f"a {what} tensor")
    shape = tuple(t.shape)
    # Most tensors are sent as they are; each call skipped here costs as much as a check.
    if not (t.is_cpu and t.is_contiguous()) or t.requires_grad or t.is_conj() or t.is_neg():
        # Frames carry host memory; conj/neg views are materialised (contiguous() keeps the bits).
        t = t.detach().cpu().resolve_conj().resolve_neg().contiguous()
    if t.dim() != 1:
        t = t.flatten()  # a view, t being contiguous; cheaper than reshape(-1)
    flat = t if t.dtype is torch.uint8 else t.view(torch.uint8)
    return out.add(code, shape, BufferKind.TENSOR, flat, flat.numel())


def _array(a: np.ndarray[Any, Any], out: _Outgoing) -> msgpack.ExtType:
    if not a.dtype.isnative:
        a = a.astype(a.dtype.newbyteorder("="))
    code = _NUMPY_CODES.get(a.dtype)
    if code is None:
        raise _Refused(f"a numpy array of dtype {a.dtype}")
    flat = (a if a.flags.c_contiguous else a.copy(order="C")).reshape(-1).view(np.uint8)
    return out.add(code, a.shape, BufferKind.NDARRAY, flat.data, flat.size)


def _key(k: object) -> object:
    if k is None or isinstance(k, (bool, float, str, bytes)):
        return k
    if isinstance(k, int) and _INT_MIN <= k < _U64:
        return k
    raise _Refused(f"a dict key of type {type(k).__qualname__}")


def _plain(obj: object) -> bool:
    """Whether ``obj`` is only exact scalars, lists and dicts: then it *is* its own lowering
    (not tuples, subclasses, buffers or ``ExtType``). Ints are not range-checked here:
    msgpack refuses the same ones ``_lower`` does."""
    kind = type(obj)
    if kind is list:
        items: Any = obj
    elif kind is dict:
        if not _SCALARS.issuperset(map(type, obj)):  # type: ignore[call-overload]
            return False
        items = obj.values()  # type: ignore[attr-defined]
    else:
        return kind in _SCALARS
    # Checking all types in one C-level pass first spares a call per scalar.
    return _SCALARS.issuperset(map(type, items)) or all(map(_plain, items))


_AS_IS: Final = frozenset({type(None), bool, float, str})  # exact types that lower to themselves


def _lower(obj: object, out: _Outgoing) -> object:
    """Return ``obj`` in msgpack's own types; tensors, arrays, large bytes become references."""
    kind = type(obj)
    if kind in _AS_IS:
        return obj
    if kind is list or kind is tuple:  # exact types first: the commonest, and cheapest to tell
        return _lower_items(obj, out, kind is tuple)  # type: ignore[arg-type]
    if kind is torch.Tensor:
        return out.tensor(obj)  # type: ignore[arg-type]
    if kind is dict and _SCALARS.issuperset(map(type, obj)):  # type: ignore[call-overload]
        return _lower_dict(obj, out)  # type: ignore[arg-type]
    if obj is None or isinstance(obj, (bool, float, str)):
        return obj
    if isinstance(obj, int):
        if _INT_MIN <= obj < _U64:
            return obj
        raise _Refused("an int beyond 64 bits")
    if isinstance(obj, (bytes, bytearray, memoryview)):
        view = memoryview(obj)
        if view.nbytes <= INLINE_BYTES or not view.c_contiguous:
            return view.tobytes()
        return out.add(_U8, (view.nbytes,), BufferKind.BYTES, view.cast("B"), view.nbytes)
    if isinstance(obj, torch.Tensor):
        return out.tensor(obj)
    if type(obj) is np.ndarray:
        return _array(obj, out)
    if isinstance(obj, (np.bool_, np.integer, np.floating)) and obj.dtype in _NUMPY_CODES:
        return _lower(obj.item(), out)  # numpy scalars arrive as the Python scalar they hold
    if isinstance(obj, (list, tuple)):
        return _lower_items(obj, out, isinstance(obj, tuple))
    if isinstance(obj, dict):
        return _lower_dict(obj, out)
    raise _Refused(type(obj).__qualname__)


def _lower_dict(obj: dict[Any, Any], out: _Outgoing) -> dict[Any, Any]:
    lowered = {}
    for k, v in obj.items():
        key = _key(k)
        try:
            lowered[key] = v if type(v) in _AS_IS else _lower(v, out)
        except _Refused as e:
            e.path.append(f"[{k!r}]")
            raise
    return lowered


def _lower_items(obj: list[Any] | tuple[Any, ...], out: _Outgoing, is_tuple: bool) -> list[Any]:
    items: list[Any] = []
    if is_tuple:
        items.append(_TUPLE_EXT)
    for i, item in enumerate(obj):
        kind = type(item)
        if kind in _AS_IS or (kind is int and _INT_MIN <= item < _U64):
            items.append(item)
            continue
        try:
            items.append(out.tensor(item) if kind is torch.Tensor else _lower(item, out))
        except _Refused as e:
            e.path.append(f"[{i}]")
            raise
    return items


def _structure(obj: object, out: _Outgoing) -> bytes:
    """Return the DEFAULT codec's structure of ``obj``, adding its buffers to ``out``."""
    if _plain(obj):  # no buffers (the commonest small message): pack it as it is
        try:
            structure = _pack(obj)
        except OverflowError:  # an int beyond 64 bits: _lower says where
            pass
        else:
            if len(structure) <= INLINE_BYTES:  # then so is every bytes value in it: none goes out
                return structure
    try:
        lowered = _lower(obj, out)
    except _Refused as e:
        raise e.error() from None
    # A lone tensor (or array, or large bytes) always has the same structure.
    return _LONE_REF if lowered is _REFS[0] else _pack(lowered)


class _Packers(threading.local):
    """One reused ``Packer`` per thread: making one costs as much as packing a small message."""

    def __init__(self) -> None:
        self.packer = msgpack.Packer(use_bin_type=True)


_packers = _Packers()


def _pack(lowered: object) -> bytes:
    """Return ``msgpack.packb(lowered, use_bin_type=True)``, packed by this thread's packer."""
    structure: bytes = _packers.packer.pack(lowered)
    if len(structure) > INLINE_BYTES:
        _packers.packer = msgpack.Packer(use_bin_type=True)  # do not keep its grown buffer
    return structure


class _Pickler(pickle.Pickler):
    """Pickle protocol 5 that sends plain CPU tensors out of band, like numpy arrays."""

    def reducer_override(self, obj: Any) -> Any:
        if (type(obj) is torch.Tensor and obj.layout is torch.strided and obj.device.type == "cpu"
                and not obj.requires_grad and obj.dtype in _CODES):
            flat = obj.resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8)
            buffer = pickle.PickleBuffer(flat.numpy().data)
            return _tensor_from_buffer, (buffer, obj.dtype, tuple(obj.shape))
        return NotImplemented


def _tensor_from_buffer(buffer: Any, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """Rebuild a tensor pickled by ``_Pickler`` (on the received buffer, without a copy)."""
    return torch.from_numpy(np.frombuffer(buffer, np.uint8)).view(dtype).reshape(shape)


def encode(kind: Kind, tag: int, seq: int, obj: object, codec: Codec = Codec.DEFAULT,
           limits: Limits = Limits()) -> tuple[bytes, list[Buffer]]:
    """Turn ``obj`` into a frame: head bytes and the buffers to send after it.

    Contiguous CPU tensors, arrays and large bytes are not copied: their buffer
    is a flat uint8 view of their memory (a tensor, or a memoryview).

    Raises:
        TypeError: the DEFAULT codec cannot carry something in ``obj`` (names it and where).
        ValueError: bad tag/seq, or the frame exceeds ``limits`` (what the receiver would refuse).
    """
    try:  # dict lookups: Kind(kind) and Codec(codec) cost more than the rest of a small frame
        kind, codec = _KINDS[kind], _CODECS[codec]
    except (KeyError, TypeError):
        kind, codec = Kind(kind), Codec(codec)
    tag, seq = operator.index(tag), operator.index(seq)
    if not (0 <= tag < _U64 and 0 <= seq < _U64):
        raise ValueError(f"tag and seq must be in [0, 2**64), got tag={tag} seq={seq}")
    out = _Outgoing()
    if (type(obj) is torch.Tensor and codec is Codec.DEFAULT and obj.dtype in _CODES
            and obj.layout is torch.strided):
        _tensor(obj, out)  # a lone tensor, the commonest message with a buffer: its head is
        code, _, shape, nbytes = out.descriptors[0]  # the same for every tensor of its shape
        if nbytes <= limits.max_message_bytes and len(shape) <= limits.max_ndim:
            return _lone_head(kind, tag, seq, code, shape, nbytes), out.buffers
        out = _Outgoing()
    if codec is Codec.PICKLE:
        def keep(buffer: pickle.PickleBuffer) -> None:
            view = buffer.raw()
            out.add(_U8, (view.nbytes,), BufferKind.BYTES, view, view.nbytes)
        sink = io.BytesIO()
        _Pickler(sink, protocol=5, buffer_callback=keep).dump(obj)
        structure = sink.getvalue()
    else:
        structure = _structure(obj, out)
    if len(structure) > INLINE_BYTES:
        n = len(structure)
        out.add(_U8, (n,), BufferKind.STRUCTURE, memoryview(structure), n)
        structure = b""
    head = _head(kind, codec, tag, seq, out.descriptors, structure)
    total, ndim = len(structure), 0
    for _, _, shape, nbytes in out.descriptors:
        total, ndim = total + nbytes, max(ndim, len(shape))
    if (total > limits.max_message_bytes or len(out.buffers) > limits.max_buffers
            or ndim > limits.max_ndim or len(head) > limits.max_head_bytes):
        raise ValueError(f"message too large to send: {total} bytes, {len(out.buffers)} buffers, "
                         f"{ndim} dims, head {len(head)} bytes; limits are {limits}")
    return head, out.buffers


@functools.lru_cache(maxsize=256)
def _lone_head(kind: int, tag: int, seq: int, code: int, shape: tuple[int, ...],
               nbytes: int) -> bytes:
    return _head(kind, Codec.DEFAULT, tag, seq, [(code, BufferKind.TENSOR, shape, nbytes)],
                 _LONE_REF)


def _head(kind: int, codec: int, tag: int, seq: int, descriptors: list[_Laid],
          structure: bytes) -> bytes:
    """Lay out a head: the inverse of ``decode_head``."""
    body = b"".join([_DESCS[len(shape)].pack(code, bkind, len(shape), *shape, nbytes)
                     for code, bkind, shape, nbytes in descriptors])
    size = PREFIX_BYTES + len(body) + len(structure)
    prefix = _PREFIX.pack(MAGIC, VERSION, kind, codec, 0, tag, seq, len(descriptors),
                          len(structure), size)
    return b"".join((prefix, body, structure))


def decode_head(data: bytes | memoryview, limits: Limits = Limits()) -> Head:
    """Parse and validate one head; nothing is allocated for the buffers yet.

    Raises:
        ProtocolError: malformed, truncated, of another version, or beyond ``limits``.
    """
    # bytes (what transports hand over) is read as it is; anything else through a byte view.
    view = data if type(data) is bytes else memoryview(data).cast("B")
    if len(view) < PREFIX_BYTES:
        raise ProtocolError(f"frame head truncated: {len(view)} of at least {PREFIX_BYTES} bytes")
    magic, version, kind, codec, flags, tag, seq, count, nstruct, size = _PREFIX.unpack_from(view)
    if magic != MAGIC:
        raise ProtocolError("not an asyncomm frame (bad magic)")
    if version != VERSION:
        raise ProtocolError(f"frame version {version} is unknown (this side speaks {VERSION})")
    if kind not in _KINDS or codec not in _CODECS or flags:
        raise ProtocolError(f"frame head has unknown kind {kind}, codec {codec} or flags {flags}")
    if not PREFIX_BYTES <= size <= limits.max_head_bytes:
        raise ProtocolError(f"frame head of {size} bytes (limit {limits.max_head_bytes})")
    if len(view) != size:
        raise ProtocolError(f"frame head declares {size} bytes, {len(view)} present")
    if count > limits.max_buffers:
        raise ProtocolError(f"frame declares {count} buffers (limit {limits.max_buffers})")
    codec, max_ndim = _CODECS[codec], limits.max_ndim
    descriptors, at, total = [], PREFIX_BYTES, nstruct
    for i in range(count):
        if at + _DESC.size > size:
            raise ProtocolError(f"frame head truncated in descriptor {i}")
        ndim = view[at + 2]
        end = at + _DESC.size + 8 * (ndim + 1)
        if ndim > max_ndim:
            raise ProtocolError(f"descriptor {i}: {ndim} dims (limit {max_ndim})")
        if end > size:
            raise ProtocolError(f"frame head truncated in descriptor {i}")
        fields = _DESCS[ndim].unpack_from(view, at)  # code, kind, ndim, *shape, nbytes
        code, bkind, shape, nbytes = fields[0], fields[1], fields[3:-1], fields[-1]
        dtype, bufkind = _DTYPES.get(code), _BUFFER_KINDS.get(bkind)
        at, total = end, total + nbytes
        if dtype is None or bufkind is None:
            raise ProtocolError(f"descriptor {i}: unknown dtype code {code} or buffer kind {bkind}")
        if problem := _misfit(dtype, shape, nbytes, bufkind, codec, i == count - 1, nstruct > 0):
            raise ProtocolError(f"descriptor {i} ({bufkind.name}, {dtype}, {shape}): {problem}")
        descriptors.append(_descriptor(code, bkind, shape, nbytes))
    if total > limits.max_message_bytes:
        raise ProtocolError(f"frame of {total} bytes (limit {limits.max_message_bytes})")
    if at + nstruct != size:
        raise ProtocolError(f"frame head lengths disagree: {at} + {nstruct} != {size}")
    structure = bytes(view[at:])
    lone = (count == 1 and structure == _LONE_REF and codec is Codec.DEFAULT
            and descriptors[0].kind is not BufferKind.STRUCTURE)
    return Head(_KINDS[kind], codec, tag, seq, tuple(descriptors), structure, size,
                total - nstruct, lone)


@functools.lru_cache(maxsize=1024)
def _descriptor(code: int, kind: int, shape: tuple[int, ...], nbytes: int) -> Descriptor:
    """Return a validated descriptor; they are immutable, so frames of one shape share theirs."""
    return Descriptor(_DTYPES[code], shape, nbytes, _BUFFER_KINDS[kind])


def _misfit(dtype: torch.dtype, shape: tuple[int, ...], nbytes: int, kind: BufferKind,
            codec: Codec, last: bool, inline: bool) -> str:
    """Return why a descriptor cannot be in this frame, or "" when it can."""
    count = math.prod(shape)
    if count * dtype.itemsize != nbytes:
        return f"shape and dtype make {count * dtype.itemsize} bytes, not {nbytes}"
    # torch's strides must fit int64, even if empty (only then can they exceed count).
    if (count or math.prod(max(n, 1) for n in shape)) >> 63:
        return "shape too large"
    if kind is BufferKind.TENSOR:  # the commonest kind, which only the codec can refuse
        return _PICKLE_ONLY if codec is Codec.PICKLE else ""
    if kind in (BufferKind.BYTES, BufferKind.STRUCTURE) and (dtype, len(shape)) != (
            torch.uint8, 1):
        return "must be flat uint8"
    if kind is BufferKind.NDARRAY and dtype is torch.bfloat16:
        return "numpy has no bfloat16"
    if kind is BufferKind.STRUCTURE and (inline or not last):
        return "a structure buffer must be the last one, with no structure in the head"
    if codec is Codec.PICKLE and kind is BufferKind.NDARRAY:
        return _PICKLE_ONLY
    return ""


_PICKLE_ONLY: Final = "pickle frames carry only BYTES buffers"


def decode(head: Head, buffers: list[torch.Tensor], expect: Codec) -> object:
    """Rebuild the message from a head and its received buffers (a flat uint8 CPU tensor each):
    tensors and arrays are views of them, not copies.

    Raises:
        ProtocolError: the frame's codec is not ``expect`` (nothing is decoded then),
            or its structure is malformed.
        ValueError: ``buffers`` do not match the head's descriptors.
    """
    if head.codec != expect:
        raise ProtocolError(f"frame of codec {head.codec.name} on a channel of codec "
                            f"{Codec(expect).name}; refused without decoding")
    descriptors = head.descriptors
    if len(buffers) != len(descriptors):
        raise ValueError("buffers do not match the descriptors: one flat uint8 CPU tensor each")
    for b, d in zip(buffers, descriptors, strict=True):  # cheaper than b.shape and b.device
        if b.dtype is not torch.uint8 or b.dim() != 1 or b.numel() != d.nbytes or not b.is_cpu:
            raise ValueError("buffers do not match the descriptors: one flat uint8 CPU tensor each")
    if head.lone:  # the commonest of large messages: one tensor
        return _rebuild(descriptors[0], buffers[0])
    data, structure = list(buffers), memoryview(head.structure)
    if descriptors and descriptors[-1].kind is BufferKind.STRUCTURE:
        structure = data.pop().numpy().data
    if head.codec is Codec.PICKLE:
        try:
            return pickle.loads(structure, buffers=[b.numpy() for b in data])
        except Exception as e:
            raise ProtocolError(f"could not unpickle a frame: {type(e).__name__}") from e
    if not data:  # nothing to rebuild: skip the per-frame hooks unless there is a tuple marker
        try:
            return unpack(structure, _no_ext, passing=_HasExt)
        except _HasExt:
            pass
    return _unpack(structure, descriptors, data)


class _HasExt(Exception):
    """A structure without buffers has an extension (tuple marker, or invalid): unpack in full."""


def _no_ext(code: int, payload: bytes) -> object:
    raise _HasExt


def _unpack(structure: memoryview, descriptors: tuple[Descriptor, ...],
            data: list[torch.Tensor]) -> object:
    used = [False] * len(data)

    def buffer(code: int, payload: bytes) -> object:
        if code == _EXT_BUFFER and len(payload) == 4:
            (i,) = struct.unpack("<I", payload)
            if i < len(data) and not used[i]:
                used[i] = True
                return _rebuild(descriptors[i], data[i])
        raise ProtocolError(f"frame structure has an unknown extension {code} or buffer reference")

    obj = read_structure(structure, buffer)
    if not all(used):
        raise ProtocolError("frame structure leaves a buffer unused")
    return obj


def unpack(data: bytes | memoryview, ext_hook: Callable[[int, bytes], object],
           list_hook: Callable[[list[object]], object] | None = None,
           passing: type[Exception] = ProtocolError) -> object:
    """Unpack msgpack as the DEFAULT codec does; ``ProtocolError`` if it is not valid.

    msgpack decodes its own extension -1 (timestamps) before any hook: to a plain float
    here. Errors of type ``passing`` (and ``ProtocolError``) pass unchanged."""
    try:
        return msgpack.unpackb(data, ext_hook=ext_hook, list_hook=list_hook, raw=False,
                               strict_map_key=False, timestamp=1)
    except (ProtocolError, passing):
        raise
    except Exception as e:
        raise ProtocolError(f"frame structure is not valid msgpack ({type(e).__name__})") from e


def read_structure(data: bytes | memoryview, extension: Callable[[int, bytes], object]) -> object:
    """Unpack a DEFAULT structure: tuples rebuilt, other extensions by ``extension``.

    Raises:
        ProtocolError: not valid msgpack, a misplaced tuple marker, or what ``extension``
            raises.
    """
    if type(data) is not bytes:
        data = bytes(data)  # (a memoryview's ``in`` compares items, not bytes)
    if _TUPLE_BYTES not in data:  # no tuple: no hook per list, and ``extension`` as it is
        return unpack(data, extension)
    seen, used = [0], [0]  # tuple markers seen, and consumed (as the first item of a list)

    def ext_hook(code: int, payload: bytes) -> object:
        if code == _EXT_TUPLE and not payload:
            seen[0] += 1
            return _TUPLE_EXT
        return extension(code, payload)

    def list_hook(items: list[object]) -> object:
        if items and items[0] is _TUPLE_EXT:
            used[0] += 1
            return tuple(items[1:])
        return items

    obj = unpack(data, ext_hook, list_hook)
    if seen[0] != used[0]:
        raise ProtocolError("frame structure misplaces a tuple marker")
    return obj


def _rebuild(d: Descriptor, buffer: torch.Tensor) -> object:
    if d.kind is BufferKind.BYTES:
        return buffer.numpy().tobytes()
    if d.dtype is torch.bool:
        buffer.clamp_(max=1)  # a bool byte other than 0/1 is undefined behaviour in torch
    tensor = buffer if d.dtype is torch.uint8 else buffer.view(d.dtype)
    if len(d.shape) != 1:  # a 1-D view already has its shape, the head being validated
        tensor = tensor.reshape(d.shape)
    return tensor.numpy() if d.kind is BufferKind.NDARRAY else tensor


def legible_tag(head: bytes | memoryview) -> int | None:
    """Return the channel tag of a head that failed to decode, if its prefix holds one."""
    if len(head) < 16:
        return None
    return int(struct.unpack_from("<Q", head, 8)[0])


def with_seq(head: bytes, seq: int) -> bytes:
    """Return ``head`` with its sequence number set to ``seq``."""
    return head[:SEQ_AT] + _SEQ.pack(seq) + head[SEQ_AT + _SEQ.size:]


def seq_of(head: bytes | memoryview) -> int:
    """Return the sequence number of an encoded head."""
    return int(_SEQ.unpack_from(head, SEQ_AT)[0])


def without_seq(head: bytes) -> bytes:
    """Return ``head`` less its sequence number: what heads alike but for it share."""
    return head[:SEQ_AT] + head[SEQ_AT + _SEQ.size:]
