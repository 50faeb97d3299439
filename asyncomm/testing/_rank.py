"""The rank side of a test ``World``: connect back, run each check asked for, answer.

``python -m asyncomm.testing`` runs this on every rank (under the launcher
the world chose); each check runs on a communicator of its own (see
``serve``), and its result or traceback goes back with the number of the
request it answers. ``SIGUSR1`` writes every task's and thread's stack to
the rank's output, for the report of a check that hangs.
"""

from __future__ import annotations

import asyncio
import faulthandler
import importlib.util
import os
import signal
import sys
import traceback
from collections.abc import Callable
from multiprocessing.connection import Client
from pathlib import Path
from types import ModuleType
from typing import Any

import asyncomm
from asyncomm._core import settings
from asyncomm.testing import fresh

_modules: dict[str, ModuleType] = {}


def _load(path: str, folders: list[str], qualname: str) -> Callable[..., Any]:
    module = _modules.get(path)
    if module is None:
        # its folder first, then the test process's own that hold it (where pytest put a
        # conftest's): what the check file imports is found as it was there
        sys.path[:0] = [str(Path(path).parent), *folders]
        spec = importlib.util.spec_from_file_location(f"asyncomm_check_{len(_modules)}", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        _modules[path] = module
    target: Any = module
    for part in qualname.split("."):
        target = getattr(target, part)
    return target  # type: ignore[no-any-return]


async def serve(comm: asyncomm.Comm) -> None:
    """Answer the test process's requests until it says stop."""
    chosen = settings.read()
    assert chosen.test_address is not None and chosen.test_key is not None
    host, port = chosen.test_address.rsplit(":", 1)
    conn = Client((host, int(port)), authkey=bytes.fromhex(chosen.test_key))
    conn.send((comm.rank, os.getpid()))
    loop = asyncio.get_running_loop()
    # SIGUSR1 (a check hangs): the tasks' stacks, from the loop, and every thread's stack,
    # from faulthandler's own handler, which also speaks when the loop is blocked.
    loop.add_signal_handler(signal.SIGUSR1, _print_tasks)
    faulthandler.register(signal.SIGUSR1, all_threads=True, chain=True)
    while True:
        asked = await loop.run_in_executor(None, conn.recv)
        command, request, path, folders, qualname, args = asked
        if command == "stop":
            break
        try:
            check = _load(path, folders, qualname)
            # a communicator of the check's own, over every rank: what it leaves (operations
            # in flight, channels, actors, groups) closes with it, so the next check starts
            # clean; a check that raised leaves without waiting
            async with fresh(comm) as mine:
                result = await check(mine, *args)
        except BaseException as exc:  # from the check's frame down
            tb = exc.__traceback__.tb_next if exc.__traceback__ is not None else None
            conn.send(("error", request, "".join(traceback.format_exception(type(exc), exc, tb))))
        else:
            conn.send(("ok", request, result))
    conn.close()


def _print_tasks() -> None:
    """Print every task's chain of awaits, outermost first (where each one waits)."""
    for task in asyncio.all_tasks():
        lines = [f"task {task.get_name()} (awaits, outermost first):"]
        awaited: Any = task.get_coro()
        while awaited is not None:
            frame = getattr(awaited, "cr_frame", None) or getattr(awaited, "gi_frame", None)
            if frame is None:
                break
            lines.append(f"  File \"{frame.f_code.co_filename}\", line {frame.f_lineno}, in "
                         f"{frame.f_code.co_name}")
            awaited = getattr(awaited, "cr_await", None) or getattr(awaited, "gi_yieldfrom", None)
        print("\n".join(lines), file=sys.stderr)
    sys.stderr.flush()
