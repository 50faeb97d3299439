"""``asyncomm.compute``'s pool on a bare event loop (internals, on purpose): computes run in
call order off the loop thread, errors and keywords reach the caller, spans reach an
observer attached by hand (``instrument``), the thread count is read from the environment
(``settings``) and the loop counts what is in flight (``polling.computing``); each test
shuts the pool down itself (``_overlap.compute.shutdown``), as ``asyncomm.run`` does."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

import asyncomm
from asyncomm._core import instrument, settings
from asyncomm._core.polling import computing
from asyncomm._overlap import compute as _compute


async def test_computes_run_one_at_a_time_in_call_order() -> None:
    order: list[int] = []
    running = {"now": 0, "most": 0}
    lock = threading.Lock()

    def work(i: int) -> int:
        with lock:
            running["now"] += 1
            running["most"] = max(running["most"], running["now"])
        time.sleep(0.01)
        order.append(i)
        with lock:
            running["now"] -= 1
        return i * i

    try:
        results = await asyncio.gather(*(asyncomm.compute(work, i) for i in range(8)))
    finally:
        await _compute.shutdown(asyncio.get_running_loop())
    assert results == [i * i for i in range(8)]
    assert order == list(range(8))
    assert running["most"] == 1


async def test_compute_runs_off_the_loop_thread_and_leaves_none_behind() -> None:
    loop_thread = threading.get_ident()
    names: list[str] = []

    def where() -> int:
        names.append(threading.current_thread().name)
        return threading.get_ident()

    assert await asyncomm.compute(where) != loop_thread
    await _compute.shutdown(asyncio.get_running_loop())
    assert not [t for t in threading.enumerate() if t.name in names]


async def test_errors_and_keywords_reach_the_caller() -> None:
    def fail(x: int, *, why: str) -> None:
        raise KeyError(f"{x} {why}")

    try:
        with pytest.raises(KeyError, match="3 because"):
            await asyncomm.compute(fail, 3, why="because")
        out = await asyncomm.compute(torch.add, torch.ones(2), torch.ones(2), alpha=2)
        assert torch.equal(out, torch.full((2,), 3.0))
    finally:
        await _compute.shutdown(asyncio.get_running_loop())


class Spans:
    """A recording that keeps only compute spans (see ``_core.instrument``)."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, float, float]] = []

    def attach(self, rank: int, size: int, backend: str) -> int:
        return 0

    def detached(self) -> None:
        pass

    def issued(self, handle: object, comm: int, keep: object) -> None:
        pass

    def message(self, *args: object) -> None:
        pass

    def span(self, name: str, start: float, end: float) -> None:
        self.spans.append((name, start, end))


async def test_spans_are_reported_with_their_names() -> None:
    recording = Spans()
    instrument.install(recording)
    try:
        await asyncomm.compute(sum, [1, 2], name="forward")
        await asyncomm.compute(sorted, [2, 1])
    finally:
        instrument.uninstall(recording)
        await _compute.shutdown(asyncio.get_running_loop())
    assert [name for name, _, _ in recording.spans] == ["forward", "sorted"]
    assert all(end >= start for _, start, end in recording.spans)


def test_thread_count_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASYNCOMM_COMPUTE_THREADS", "0")
    with pytest.raises(ValueError, match="at least 1"):
        settings.read()
    monkeypatch.setenv("ASYNCOMM_COMPUTE_THREADS", "3")
    assert settings.read().compute_threads == 3


async def test_the_loop_counts_its_computes_in_flight() -> None:
    # MPI pollers read the count (they do not spin for receives while a compute runs)
    loop = asyncio.get_running_loop()
    count = computing(loop)
    began, release = threading.Event(), threading.Event()

    def held() -> int:
        began.set()
        release.wait(60)  # (bounded: a failing test must not keep the thread)
        return 1

    def fails() -> None:
        raise ValueError("boom")

    try:
        tasks = [asyncio.ensure_future(asyncomm.compute(held)),
                 asyncio.ensure_future(asyncomm.compute(fails))]
        await asyncio.sleep(0)
        assert await asyncio.to_thread(began.wait, 60)
        assert count[0] == 2  # one running, one queued behind it
        release.set()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert results[0] == 1 and isinstance(results[1], ValueError)
        assert count[0] == 0  # a compute that raised is counted out too
    finally:
        release.set()
        await _compute.shutdown(loop)
