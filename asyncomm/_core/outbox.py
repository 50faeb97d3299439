"""The outbox: small frames queued per destination as *packets*, until they are sent.

A packet is one link message (see ``link``'s note on the layout): room for
the preamble and the packet's head (laid when it goes: ``take``), then each
frame's head and body (``small.HEAD``), read on arrival as one msgpack array.
Messages of one channel in sequence share one head: a *run*
(``small.RUN_HEAD``, its count laid once it ends). A lone message becomes a
run when the next of its channel follows (its channel and sequence number
read back from its head then: nothing is kept for it before).
"""

from __future__ import annotations

import struct

from asyncomm._core import small
from asyncomm._core.messages import PACKET, PREAMBLE

_small_head, _SMALL_HEAD_BYTES = small.HEAD.pack, small.HEAD.size
_RUN_HEAD_BYTES = small.RUN_HEAD.size
_lay_count, _COUNT_AT = struct.Struct(">I").pack_into, small.RUN_COUNT_AT
_FRAME, _U64, _ARRAY, _RUN = small.FRAME_BYTE, small.U64_BYTE, small.ARRAY_BYTE, small.RUN
_DATA = small.DATA
# a lone message's head becomes a run's: its kind set, then these bytes (array 32, count)
_RUN_MORE = bytes([_ARRAY]) + bytes(4)
_RUN_MORE_BYTES = _RUN_HEAD_BYTES - _SMALL_HEAD_BYTES
# a lone message's channel and sequence number, read back from its head (``small.HEAD``)
_U64_AT, _TAG_OFFSET, _SEQ_OFFSET = struct.Struct(">Q").unpack_from, small.TAG_AT, small.SEQ_AT
_PACKET_AT = PREAMBLE.size + small.PACKET_HEAD_BYTES  # a packet's first frame
_PREAMBLE_INTO, _PREAMBLE_BYTES = PREAMBLE.pack_into, PREAMBLE.size
_lay_packet_head = small.PACKET_HEAD.pack_into  # (buffer, at, ARRAY_BYTE, frames)


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

    def data(self, dst: int, tag: int, seq: int, body: bytes) -> int:
        """Queue message ``seq`` of channel ``tag`` for ``dst``: 0 queued in the packet that
        waits, 1 queued as the first of a new packet, -1 not queued: the packet is full (the
        caller sends it, ``take``, and calls again). The message after the last one queued
        for ``dst`` on the same channel (the commonest, in a burst) adds its body to that
        run; after a lone message, it makes that a run first. Any other goes as a lone
        message."""
        packet = self._packets.get(dst)
        started = 0
        if packet is None:
            packet = self._start(dst)
            started = 1
        elif (packet.next == seq and packet.run == tag
                and len(packet) + len(body) <= self.packet_bytes
                and packet.frames < self.packet_frames):
            packet += body
            packet.frames += 1
            packet.next = seq + 1
            return 0
        else:
            at = packet.lone
            if (at >= 0 and len(packet) + _RUN_MORE_BYTES + len(body) <= self.packet_bytes
                    and packet.frames < self.packet_frames
                    and _U64_AT(packet, at + _SEQ_OFFSET)[0] + 1 == seq
                    and _U64_AT(packet, at + _TAG_OFFSET)[0] == tag):
                # the second of a run: the lone message's head becomes the run's
                packet[at + 1] = _RUN
                packet[at + _SMALL_HEAD_BYTES:at + _SMALL_HEAD_BYTES] = _RUN_MORE
                packet += body
                packet.run, packet.run_at, packet.run_from = tag, at, packet.frames - 1
                packet.frames += 1
                packet.next, packet.lone = seq + 1, -1
                return 0
            if (len(packet) + _SMALL_HEAD_BYTES + len(body) > self.packet_bytes
                    or packet.frames >= self.packet_frames):
                return -1
            if packet.next >= 0:  # a run is open: it ends here
                _lay_count(packet, packet.run_at + _COUNT_AT, packet.frames - packet.run_from)
                packet.next = -1
        packet.lone = len(packet)
        packet += _small_head(_FRAME, _DATA, _U64, tag, _U64, seq)
        packet += body
        packet.frames += 1
        packet.items += 1
        return started

    def small(self, dst: int, kind: int, tag: int, seq: int, body: bytes) -> int:
        """Queue a small frame of ``kind`` (as ``data``; a message, ``DATA``, is ``data``)."""
        if kind == _DATA:
            return self.data(dst, tag, seq, body)
        packet = self._packets.get(dst)
        started = 0
        if packet is None:
            packet = self._start(dst)
            started = 1
        elif (len(packet) + len(body) + _SMALL_HEAD_BYTES > self.packet_bytes
                or packet.frames >= self.packet_frames):
            return -1
        else:
            if packet.next >= 0:  # a run is open: it ends here
                _lay_count(packet, packet.run_at + _COUNT_AT, packet.frames - packet.run_from)
            packet.next = packet.lone = -1
        packet += _small_head(_FRAME, kind, _U64, tag, _U64, seq)
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
            _lay_count(packet, packet.run_at + _COUNT_AT, packet.frames - packet.run_from)
        _PREAMBLE_INTO(packet, 0, 0, len(packet) - _PREAMBLE_BYTES, 0, PACKET)
        _lay_packet_head(packet, _PREAMBLE_BYTES, _ARRAY, packet.items)
        return packet

    def queued(self, dst: int) -> bool:
        """Return whether a packet for ``dst`` waits."""
        return dst in self._packets

    def dsts(self) -> list[int]:
        """Return the destinations whose packets wait, in the order they were begun."""
        return list(self._packets)

    def counts(self, dst: int) -> tuple[int, int] | None:
        """Return the items (frames and runs) and frames of ``dst``'s packet, or ``None``."""
        packet = self._packets.get(dst)
        return None if packet is None else (packet.items, packet.frames)
