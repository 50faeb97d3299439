"""How fast 64 x 1 MiB can move between two ranks of one host through shared memory, for
measuring only: two copies through a ring (the gloo lane's way) against one copy into
buffers the receiver lends, beside raw gloo ``isend``/``irecv``.

Not part of asyncomm (torch only). Run by hand, two ranks on this host::

    MASTER_ADDR=127.0.0.1 MASTER_PORT=29613 WORLD_SIZE=2 RANK=1 python lane_copies.py &
    MASTER_ADDR=127.0.0.1 MASTER_PORT=29613 WORLD_SIZE=2 RANK=0 python lane_copies.py

Rank 0 writes 64 frames of 1 MiB a round, rank 1 takes them, then answers; the three
ways alternate round by round and rank 0 prints their medians (MiB/s). No event loop,
no threads, no framing: each way's floor with the least Python.

- ``raw``: gloo ``isend`` x 64 / ``irecv`` x 64 into 64 buffers, then a 1-element answer.
- ``ring``: a 4 MiB ring of shared memory; the writer ``memmove``s each frame in and
  sends the count written on a socket, the reader waits for counts and ``memmove``s out
  into a buffer of a pool of four (reused: in the cache), telling the count read every
  quarter ring.
- ``lent``: the receiver's 64 MiB of shared memory, 64 slots; the writer ``memmove``s
  frame i straight into slot i and sends the count; the reader only waits for counts
  (the frame is then a tensor over the slot: no copy on its side).
"""

import ctypes
import mmap
import os
import socket
import statistics
import struct
import time

import torch
import torch.distributed as dist

N, MIB, RING, ROUNDS = 64, 1 << 20, 4 << 20, 24
COUNT = struct.Struct("<Q")


def shared(name: str, size: int, create: bool) -> tuple[mmap.mmap, int]:
    """Map ``/dev/shm/name``; return the mapping (keep it: the address dies with it) and
    its address."""
    path = f"/dev/shm/{name}"
    fd = os.open(path, os.O_RDWR | (os.O_CREAT if create else 0), 0o600)
    if create:
        os.posix_fallocate(fd, 0, size)
    mapped = mmap.mmap(fd, size)
    os.close(fd)
    return mapped, ctypes.addressof(ctypes.c_char.from_buffer(mapped))


def recv_count(sock: socket.socket, buf: bytearray) -> int:
    n = sock.recv_into(buf)
    whole = n - n % COUNT.size
    assert whole, "counts come whole here (8 bytes each, one writer)"
    return COUNT.unpack_from(buf, whole - COUNT.size)[0]


def main() -> None:
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    store = dist.distributed_c10d._get_default_store()
    if rank == 1:
        server = socket.create_server(("127.0.0.1", 0))
        store.set("port", str(server.getsockname()[1]))
        sock, _ = server.accept()
    else:
        sock = socket.create_connection(("127.0.0.1", int(store.get("port"))))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    tag = os.environ["MASTER_PORT"]
    if rank == 0:
        _ring, ring_at = shared(f"proto-ring-{tag}", RING, True)
        dist.barrier()
        _arena, arena_at = shared(f"proto-lent-{tag}", N * MIB, False)
    else:
        _arena, arena_at = shared(f"proto-lent-{tag}", N * MIB, True)
        dist.barrier()
        _ring, ring_at = shared(f"proto-ring-{tag}", RING, False)
    dist.barrier()
    if rank == 0:
        os.unlink(f"/dev/shm/proto-ring-{tag}")
        os.unlink(f"/dev/shm/proto-lent-{tag}")
    frame = torch.ones(MIB // 4)
    inbox = [torch.empty(MIB // 4) for _ in range(N)]
    pool = [torch.empty(MIB // 4) for _ in range(4)]
    answer, said = torch.zeros(1), bytearray(4096)
    written = read = told = other = 0

    def raw() -> None:
        if rank == 0:
            for work in [dist.isend(frame, 1) for _ in range(N)]:
                work.wait()
            dist.recv(answer, 1)
        else:
            for work in [dist.irecv(b, 0) for b in inbox]:
                work.wait()
            dist.send(answer, 0)

    def through_ring() -> None:
        nonlocal written, read, told, other
        if rank == 0:
            for _ in range(N):
                sent = 0
                while sent < MIB:
                    free = RING - (written - other)
                    if free < MIB // 2:
                        other = recv_count(sock, said)
                        continue
                    at = written % RING
                    n = min(free, MIB - sent, RING - at)
                    ctypes.memmove(ring_at + at, frame.data_ptr() + sent, n)
                    written += n
                    sent += n
                    sock.sendall(COUNT.pack(written))
            dist.recv(answer, 1)
        else:
            for i in range(N):
                out, got = pool[i % 4].data_ptr(), 0
                while got < MIB:
                    if other == read:
                        other = recv_count(sock, said)
                        continue
                    at = read % RING
                    n = min(other - read, MIB - got, RING - at)
                    ctypes.memmove(out + got, ring_at + at, n)
                    read += n
                    got += n
                    if read - told >= RING // 4:
                        told = read
                        sock.sendall(COUNT.pack(read))
            dist.send(answer, 0)

    def lent() -> None:
        if rank == 0:
            for i in range(N):
                ctypes.memmove(arena_at + i * MIB, frame.data_ptr(), MIB)
                sock.sendall(COUNT.pack(i + 1))
            dist.recv(answer, 1)
        else:
            done = 0
            while done < N:
                done = recv_count(sock, said)
            dist.send(answer, 0)

    ways = {"raw": raw, "ring": through_ring, "lent": lent}
    times: dict[str, list[float]] = {name: [] for name in ways}
    for round_ in range(ROUNDS + 2):
        for name, way in ways.items():
            dist.barrier()
            start = time.perf_counter()
            way()
            if round_ >= 2:
                times[name].append(time.perf_counter() - start)
    if rank == 0:
        raw_rate = N / statistics.median(times["raw"])
        print(", ".join(f"{name} {N / statistics.median(t):.0f} MiB/s "
                        f"({N / statistics.median(t) / raw_rate:.2f} of raw)"
                        for name, t in times.items()))
    sock.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
