"""Receive buffers of large frames: lent again only once nothing refers to them.
(Internals on purpose: ``_core/buffers.py``'s ``Buffers``, driven directly.)"""

from __future__ import annotations

import torch

from asyncomm._core.buffers import Buffers

MIB = 1 << 20


def test_small_buffers_are_fresh_memory() -> None:
    buffers = Buffers(limit=4 * MIB, least=64 << 10)
    t = buffers.take(1000)
    assert t.dtype is torch.uint8 and t.numel() == 1000
    assert buffers._kept == 0


def test_a_buffer_is_lent_again_only_once_every_view_of_it_is_gone() -> None:
    buffers = Buffers(limit=4 * MIB)
    first = buffers.take(MIB)
    address = first.data_ptr()
    view = first[10:20].view(torch.int16)
    array = first.numpy()
    del first
    second = buffers.take(MIB)  # the first is still seen through a view and an array
    assert second.data_ptr() != address
    del view
    fourth = buffers.take(MIB)
    assert fourth.data_ptr() not in (address, second.data_ptr())  # the array holds it
    del array
    third = buffers.take(MIB)
    assert third.data_ptr() == address
    assert buffers._kept == 3 * MIB
    del fourth


def test_at_most_limit_bytes_are_kept() -> None:
    buffers = Buffers(limit=2 * MIB)
    held = [buffers.take(MIB) for _ in range(3)]  # the third is fresh memory, not kept
    assert buffers._kept == 2 * MIB
    assert all(t.numel() == MIB for t in held)
    del held
    other = buffers.take(MIB + 4096)  # free buffers of another size make room
    assert other.numel() == MIB + 4096
    assert buffers._kept == MIB + 4096
    buffers.clear()
    assert buffers._kept == 0
    other[0] = 1  # still valid: it holds its memory


def test_the_buffer_freed_last_is_lent_again() -> None:
    """A stream consumed message by message reuses one buffer, still in the cache, even
    with others free from a burst before (lending those in turn cost a third of an MPI
    stream's rate)."""
    buffers = Buffers(limit=8 * MIB)
    burst = [buffers.take(MIB) for _ in range(4)]
    del burst  # four free buffers, not seen free yet
    addresses = set()
    for _ in range(8):
        t = buffers.take(MIB)
        t[0] = 1  # the message is read, and dropped
        addresses.add(t.data_ptr())
        del t
    assert len(addresses) == 1
    assert buffers._kept == 4 * MIB


def test_a_kept_message_does_not_hold_back_the_others() -> None:
    buffers = Buffers(limit=8 * MIB)
    kept = buffers.take(MIB)  # the oldest lent, never dropped
    first = buffers.take(MIB)
    address = first.data_ptr()
    del first  # free, behind one still used: found by looking through them all
    again = buffers.take(MIB)
    assert again.data_ptr() == address
    assert kept.data_ptr() != address
