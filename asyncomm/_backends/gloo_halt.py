"""When gloo's own thread fails: the process lives on, and says why.

gloo checks what arrives on its own I/O thread, and the exception it raises there --
``gloo::EnforceNotMet`` when a collective's data or a message is of another size than this rank
expects -- has no catcher: C++ calls ``std::terminate``, which kills the process (SIGABRT), whatever
Python was doing. A program can cause that from Python (ranks that all-reduce tensors of different
sizes), so a process with a gloo communicator takes over ``std::terminate`` (``watch``): an
exception of gloo's own parks the thread that raised it for good, and the listeners are told, once,
on their loops, which fail what is pending (``MismatchError``). Any other exception goes on to the
handler that was there before, which ends the process as before (nccl's watchdog ends it so on
purpose).

The parked thread is gloo's I/O thread: gloo can move nothing more in this process, and cannot be
shut down (destroying a group joins that thread). So once it halted, closing a group leaves gloo
alone, and the process ends with ``os._exit(1)`` once its exit work is done (``exit_if_halted``).

The handler is a ctypes callback, which takes the GIL: at exit the previous handler comes back
(``restore``) before the interpreter finalizes, when a thread that takes the GIL is ended instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Protocol

from asyncomm._core.errors import MismatchError

_HANDLER = ctypes.CFUNCTYPE(None)


class Halting(Protocol):
    def halted(self, what: str) -> None:
        """gloo's thread raised an exception of the C++ type ``what``."""


# What halted gloo (None: nothing); who to tell, on which loop (held weakly: a group, while
# it lives); the handlers (ours, the one before, the setter) while ours is installed.
halted_by: str | None = None
_listeners: weakref.WeakKeyDictionary[Halting, asyncio.AbstractEventLoop] = (
    weakref.WeakKeyDictionary())
_installed: tuple[object, int | None, Callable[[object], object]] | None = None
_handlers: list[object] = []  # every handler made: C++ may call one until the process ends
_lock = threading.Lock()


def _exception_name(lib: ctypes.CDLL) -> str:
    """Return the C++ type of the exception being handled, demangled ('' if none)."""
    current = lib.__cxa_current_exception_type
    current.restype = ctypes.c_void_p
    type_info = current()
    if not type_info:
        return ""
    mangled = ctypes.c_char_p.from_address(type_info + ctypes.sizeof(ctypes.c_void_p)).value
    demangle = lib.__cxa_demangle
    demangle.restype = ctypes.c_void_p
    demangle.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_void_p,
                         ctypes.POINTER(ctypes.c_int)]
    status = ctypes.c_int()
    text = demangle((mangled or b"").lstrip(b"*"), None, None, ctypes.byref(status))
    return ctypes.string_at(text).decode() if text else (mangled or b"").decode()


def watch(loop: asyncio.AbstractEventLoop, listener: Halting) -> None:
    """Call ``listener.halted(what)`` on ``loop`` if gloo's thread halts (at once if it
    has), while ``listener`` lives."""
    global _installed
    with _lock:
        _listeners[listener] = loop
        if halted_by is not None:
            loop.call_soon_threadsafe(listener.halted, halted_by)
        if _installed is not None:
            return
        try:
            lib = ctypes.CDLL("libstdc++.so.6")
        except OSError:  # another C++ runtime (macOS' libc++): gloo aborts there as before
            return
        setter = lib._ZSt13set_terminatePFvvE  # std::set_terminate
        setter.restype = ctypes.c_void_p
        setter.argtypes = [ctypes.c_void_p]
        handler = _HANDLER(lambda: _terminate(lib))
        _handlers.append(handler)
        before = setter(ctypes.cast(handler, ctypes.c_void_p))
        _installed = (handler, before, setter)


def _terminate(lib: ctypes.CDLL) -> None:
    """``std::terminate``'s handler: on the thread that raised; never returns."""
    global halted_by
    name = _exception_name(lib)
    if not name.startswith("gloo::") or _installed is None:
        if _installed is not None and _installed[1]:
            _HANDLER(_installed[1])()  # (it ends the process)
        os.abort()
    with _lock:
        halted_by = halted_by or name
        for listener, loop in list(_listeners.items()):
            with contextlib.suppress(RuntimeError):  # (its loop closed)
                loop.call_soon_threadsafe(listener.halted, name)
    threading.Event().wait()


def error(what: str) -> MismatchError:
    """Return the error that operations fail with once gloo halted on ``what``."""
    return MismatchError(f"gloo halted: its I/O thread raised {what} (a collective's data or "
                         "a message of another size than this rank expects): gloo can move "
                         "nothing more in this process, which will exit with status 1")


def restore() -> None:
    """Put the handler that was there before back (at exit: see the module's note)."""
    global _installed
    with _lock:
        if _installed is not None:
            _, before, setter = _installed
            setter(before)
            _installed = None


def exit_if_halted() -> None:
    """End a process whose gloo halted, its exit work done (it cannot finalize)."""
    if halted_by is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
