"""Every collective, every dtype, every reduce op, on real gloo and MPI worlds."""

from __future__ import annotations

import asyncio
import functools
import time

import numpy as np
import pytest
import torch

import asyncomm
from asyncomm import Comm
from asyncomm.testing import World

DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
          torch.float16, torch.bfloat16, torch.float32, torch.float64]
MOVED_ONLY = [torch.uint16, torch.uint32, torch.uint64]  # moved, not reduced
OPS = ["sum", "avg", "product", "min", "max", "band", "bor", "bxor"]


def value(rank: int, dtype: torch.dtype, n: int = 5) -> torch.Tensor:
    """Rank ``rank``'s input: small values whose sums and products stay exact."""
    if dtype == torch.bool:
        return torch.tensor([rank % 2 == 0, True, False, rank == 1, rank > 0][:n])
    base = torch.tensor([rank + 1, 2 * rank + 1, 3, (rank * 5) % 7, 1 + rank % 2][:n])
    return base.to(dtype)


def applicable(dtype: torch.dtype, op: str) -> bool:
    if op in ("band", "bor", "bxor"):
        return not dtype.is_floating_point
    if op == "avg":
        return dtype.is_floating_point
    return True


def reference(op: str, inputs: list[torch.Tensor]) -> torch.Tensor:
    """Reduce ``inputs`` with ``op`` on one process, as asyncomm defines it."""
    dtype = inputs[0].dtype
    if dtype == torch.bool:
        stack = torch.stack(inputs)
        if op in ("sum", "max", "bor"):
            return stack.any(0)
        if op in ("product", "min", "band"):
            return stack.all(0)
        return stack.sum(0) % 2 == 1
    wide = torch.stack([t.to(torch.float64 if dtype.is_floating_point else torch.int64)
                        for t in inputs])
    if op == "sum":
        out = wide.sum(0)
    elif op == "avg":
        out = wide.mean(0)
    elif op == "product":
        out = wide.prod(0)
    elif op == "min":
        out = wide.amin(0)
    elif op == "max":
        out = wide.amax(0)
    else:
        fn = {"band": torch.bitwise_and, "bor": torch.bitwise_or, "bxor": torch.bitwise_xor}[op]
        out = functools.reduce(fn, list(wide))
    return out.to(dtype)


def same(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    if actual.dtype.is_floating_point:
        return torch.allclose(actual.double(), expected.double(), rtol=1e-2)
    return torch.equal(actual, expected)


async def check_all_reduce_matrix(comm: Comm, dtype_name: str) -> int:
    dtype = getattr(torch, dtype_name)
    inputs = [value(r, dtype) for r in range(comm.size)]
    checked = 0
    for op in OPS:
        t = value(comm.rank, dtype)
        if not applicable(dtype, op):
            with pytest.raises(TypeError, match=op):
                comm.all_reduce(t, op)
            continue
        result = await comm.all_reduce(t, op)
        assert result is t
        assert same(t, reference(op, inputs)), (op, dtype, t, reference(op, inputs))
        # reduce to a root: only the root's tensor is defined afterwards
        root = checked % comm.size
        t = value(comm.rank, dtype)
        await comm.reduce(t, root, op)
        if comm.rank == root:
            assert same(t, reference(op, inputs)), ("reduce", op, dtype)
        # reduce_scatter: chunk r of every rank reduces onto rank r
        chunks = [value(comm.rank * comm.size + r, dtype) for r in range(comm.size)]
        out = torch.empty_like(chunks[0])
        await comm.reduce_scatter(out, chunks, op)
        mine = [value(r * comm.size + comm.rank, dtype) for r in range(comm.size)]
        assert same(out, reference(op, mine)), ("reduce_scatter", op, dtype)
        checked += 1
    return checked


# What each dtype reduces with, written out (not derived from ``applicable``).
REDUCED_WITH = {"bool": OPS[:1] + OPS[2:], "float": ["sum", "avg", "product", "min", "max"],
                "int": ["sum", "product", "min", "max", "band", "bor", "bxor"]}


@pytest.mark.parametrize("dtype", [str(d).removeprefix("torch.") for d in DTYPES])
def test_reductions_every_dtype_and_op(world: World, dtype: str) -> None:
    kind = "bool" if dtype == "bool" else "float" if "float" in dtype else "int"
    counts = world.run(check_all_reduce_matrix, dtype)
    assert counts == [len(REDUCED_WITH[kind])] * world.size, counts


async def check_data_movement(comm: Comm, dtype_name: str) -> None:
    dtype = getattr(torch, dtype_name)
    n, size, rank = 4, comm.size, comm.rank
    mine = value(rank, dtype, n)
    everyone = [value(r, dtype, n) for r in range(size)]

    t = mine.clone() if rank == 1 else torch.zeros(n, dtype=dtype)
    assert await comm.broadcast(t, src=1) is t
    assert torch.equal(t, everyone[1])

    gathered = await comm.all_gather(mine)
    assert all(torch.equal(g, e) for g, e in zip(gathered, everyone, strict=True))
    out = [torch.zeros(n, dtype=dtype) for _ in range(size)]
    assert await comm.all_gather(mine, out=out) is out
    assert all(torch.equal(g, e) for g, e in zip(out, everyone, strict=True))

    at_root = await comm.gather(mine, dst=size - 1)
    if rank == size - 1:
        assert at_root is not None
        assert all(torch.equal(g, e) for g, e in zip(at_root, everyone, strict=True))
    else:
        assert at_root is None

    got = torch.zeros(n, dtype=dtype)
    chunks = everyone if rank == 0 else None
    await comm.scatter(got, chunks, src=0)
    assert torch.equal(got, everyone[rank])

    inputs = [value(rank * size + j, dtype, n) for j in range(size)]
    outputs = [torch.zeros(n, dtype=dtype) for _ in range(size)]
    await comm.all_to_all(outputs, inputs)
    for j in range(size):
        assert torch.equal(outputs[j], value(j * size + rank, dtype, n)), ("all_to_all", j)

    right, left = (rank + 1) % size, (rank - 1) % size  # and point to point, in a ring
    got = torch.zeros(n, dtype=dtype)
    await asyncio.gather(comm.send(mine, right, tag=3), comm.recv(got, left, tag=3))
    assert torch.equal(got, everyone[left]), "send/recv"
    await comm.barrier()


@pytest.mark.parametrize("dtype", [str(d).removeprefix("torch.") for d in DTYPES + MOVED_ONLY])
def test_data_movement_every_dtype(world: World, dtype: str) -> None:
    world.run(check_data_movement, dtype)


async def check_numpy_arrays(comm: Comm) -> None:
    a = np.full(3, comm.rank + 1.0)
    assert await comm.all_reduce(a, "max") is a
    assert a.tolist() == [float(comm.size)] * 3
    b = np.arange(4, dtype=np.int32) if comm.rank == 0 else np.zeros(4, dtype=np.int32)
    await comm.broadcast(b, 0)
    assert b.tolist() == [0, 1, 2, 3]
    ro = np.frombuffer(np.full(2, comm.rank, dtype=np.int64).tobytes(), dtype=np.int64)
    gathered = await comm.all_gather(ro)  # a read-only array may be sent
    assert [int(g[0]) for g in gathered] == list(range(comm.size))
    with pytest.raises(ValueError, match="read-only"):
        comm.all_reduce(ro)


def test_numpy_arrays(world: World) -> None:
    world.run(check_numpy_arrays)


async def check_empty_and_large(comm: Comm) -> None:
    empty = torch.empty(0)
    await comm.all_reduce(empty)
    big = torch.arange(4 << 20, dtype=torch.float32) + comm.rank  # 16 MiB
    await comm.all_reduce(big)
    expected = comm.size * torch.arange(4 << 20, dtype=torch.float32) + sum(range(comm.size))
    assert torch.equal(big, expected)  # every element


def test_empty_and_large_tensors(world: World) -> None:
    world.run(check_empty_and_large)


async def check_many_in_flight(comm: Comm) -> None:
    tensors = [torch.full((1000,), float(i + comm.rank)) for i in range(64)]
    handles = [comm.all_reduce(t) for t in tensors]  # all issued before any await
    await asyncio.gather(*handles)
    for i, t in enumerate(tensors):
        assert t[0].item() == comm.size * i + sum(range(comm.size))
    assert all(h.done() for h in handles)
    assert handles[3].result() is tensors[3]
    assert await handles[3] is tensors[3]  # awaiting again gives the result again


def test_many_handles_in_flight(world: World) -> None:
    world.run(check_many_in_flight)


async def check_same_memory_seen_anew(comm: Comm) -> None:
    """Views of one memory that begin at the same address, with other lengths and dtypes,
    one after the other: each moves exactly its own elements (buffer specs are kept by
    address, length and dtype: a spec kept by address alone would move the first's)."""
    memory = torch.zeros(16, dtype=torch.float64)
    mark = -1.0 - comm.rank  # beyond the view: a reduction over it would change it
    for length in (16, 8, 3, 8):
        memory.fill_(mark)
        memory[:length] = comm.rank + 1.0
        await comm.all_reduce(memory[:length])
        assert memory[:length].tolist() == [comm.size * (comm.size + 1) / 2] * length
        assert memory[length:].tolist() == [mark] * (16 - length)  # untouched
    as_ints = memory.view(torch.int64)  # the same bytes, another dtype
    as_ints.fill_(comm.rank)
    await comm.all_reduce(as_ints[:8], "max")
    assert as_ints[:8].tolist() == [comm.size - 1] * 8
    assert as_ints[8:].tolist() == [comm.rank] * 8  # untouched
    for length in (12, 4):  # and with a point-to-point pair
        memory.fill_(mark)
        if comm.rank == 0:
            memory[:length] = 7.0
            await comm.send(memory[:length], 1, tag=3)
        elif comm.rank == 1:
            await comm.recv(memory[:length], 0, tag=3)
            assert memory[:length].tolist() == [7.0] * length
            assert memory[length:].tolist() == [mark] * (16 - length)


def test_same_memory_seen_anew(world: World) -> None:
    world.run(check_same_memory_seen_anew)


async def check_objects(comm: Comm) -> None:
    payload = {"rank": comm.rank, "blob": b"x" * (comm.rank * 1000), "t": (1, [2.5])}
    everyone = await comm.all_gather_object(payload)
    assert [o["rank"] for o in everyone] == list(range(comm.size))
    assert len(everyone[-1]["blob"]) == (comm.size - 1) * 1000
    got = await comm.broadcast_object(payload if comm.rank == 2 else None, src=2)
    assert got["rank"] == 2
    # interleaved with tensor collectives, issued back to back
    t = torch.ones(2)
    h1, h2, h3 = comm.all_reduce(t), comm.broadcast_object(comm.rank, 0), comm.barrier()
    assert await h2 == 0
    await asyncio.gather(h1, h3)
    assert t.tolist() == [comm.size] * 2


def test_objects(world: World) -> None:
    world.run(check_objects)


async def check_groups(comm: Comm) -> None:
    evens = await comm.group([r for r in range(comm.size) if r % 2 == 0])
    odds = await comm.group([r for r in range(comm.size) if r % 2 == 1])
    mine = evens if comm.rank % 2 == 0 else odds
    other = odds if comm.rank % 2 == 0 else evens
    assert other is None and mine is not None
    assert mine.rank == comm.rank // 2 and mine.size == (comm.size + 1 - comm.rank % 2) // 2
    t = torch.tensor([float(comm.rank)])
    await mine.all_reduce(t)
    assert t.item() == sum(r for r in range(comm.size) if r % 2 == comm.rank % 2)
    assert await mine.all_gather_object(comm.rank) == [
        r for r in range(comm.size) if r % 2 == comm.rank % 2]
    if mine.size > 1:
        buf = torch.zeros(1)
        if mine.rank == 0:
            await mine.send(torch.tensor([7.0]), 1, tag=3)
        elif mine.rank == 1:
            assert await mine.recv(buf, tag=3) == 0
            assert buf.item() == 7.0
    await comm.barrier()
    await mine.close()
    with pytest.raises(asyncomm.CommClosedError):
        mine.barrier()
    t = torch.ones(1)
    await comm.all_reduce(t)  # the parent is unaffected
    assert t.item() == comm.size


def test_groups(world4: World) -> None:
    world4.run(check_groups)


async def check_a_kept_all_reduce_that_timed_out(comm: Comm) -> list[float]:
    """An all-reduce of a kept kind times out on rank 0 (rank 1 comes late); the next
    ones of its kind, which need its request again, go once it is done, in order."""
    async with asyncomm.testing.fresh(comm) as sub:
        t, got = torch.zeros(2), []
        for _ in range(3):
            await sub.all_reduce(t)
        late = torch.full((2,), 1.0 + sub.rank)
        if sub.rank == 0:
            with pytest.raises(asyncomm.CommTimeoutError):
                await sub.all_reduce(late, timeout=0.2)
            await sub.send(torch.zeros(1), 1, tag=78)  # rank 1 joins once it timed out
        else:
            await sub.recv(torch.zeros(1), 0, tag=78)
            await sub.all_reduce(late)
        for i in range(6):
            t.fill_(i + sub.rank)
            await sub.all_reduce(t)
            got.append(t[0].item())
        await sub.barrier()
        # The late one lands in its tensor when the backend is done with it: on gloo, whose
        # worker threads may finish it after later ones, maybe later still (bounded here).
        deadline = time.monotonic() + 30.0
        while late[0].item() != 3.0 and time.monotonic() < deadline:
            await asyncio.sleep(0.001)
        return [late[0].item(), *got]


def test_a_kept_all_reduce_that_timed_out(world2: World) -> None:
    expected = [3.0] + [2.0 * i + 1 for i in range(6)]
    assert world2.run(check_a_kept_all_reduce_that_timed_out) == [expected, expected]
