"""The MPI link's compiled calls (``_native/mpi.cpp``), where ``asyncomm build`` built them
against the MPI library mpi4py loaded: ``NATIVE``, else ``None`` (the link calls mpi4py).

They are on where the compiled part is (``small.NATIVE``): ``ASYNCOMM_NATIVE=0`` turns
both off. A call's failure is ``NATIVE.Error(code, source)``; ``exception`` makes
mpi4py's exception of it, as the mpi4py call would have raised (``ERRORS``: either).
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

from mpi4py import MPI  # (loads the MPI library: see ``mpi_library``)

from asyncomm import _native
from asyncomm._core import settings, small


def mpi_library() -> Path | None:
    """Return the MPI library mpi4py loaded if its ``mpi.h`` lies in the ``include`` beside
    it, else None (no such header, not Linux)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/libmpi.so" in line}
    except OSError:
        return None
    for path in sorted(paths):
        library = Path(path)
        if (library.parent.parent / "include" / "mpi.h").is_file():
            return library
    return None


def module_name() -> str | None:
    """Return the compiled MPI module's name for the MPI library loaded, or ``None`` where
    it cannot be built (see ``mpi_library``)."""
    library = mpi_library()
    return None if library is None else _native.name(_native.MPI_SOURCE,
                                                      _native.library_key(library))


def build(root: Path, verbose: bool = False) -> Path | None:
    """Compile the MPI module under ``root`` for the MPI library loaded; return its path, or
    ``None`` where it cannot be built."""
    library = mpi_library()
    if library is None:
        return None
    return _native.build(root, verbose, _native.MPI_SOURCE, library)


def load() -> ModuleType | None:
    """Return the compiled MPI module if it is on and built, else ``None``."""
    if small.NATIVE is None:
        return None
    module = module_name()
    return None if module is None else _native.load(settings.cache_dir(), module)


def exception(error: BaseException) -> MPI.Exception:
    """Return mpi4py's exception of an MPI call's failure (one of ``ERRORS``): itself, or
    that of a compiled call's ``Error(code, source)``."""
    return error if isinstance(error, MPI.Exception) else MPI.Exception(error.args[0])


NATIVE: ModuleType | None = load()
# what an MPI call raises, through mpi4py or compiled (see ``exception``)
ERRORS: tuple[type[BaseException], ...] = (
    (MPI.Exception,) if NATIVE is None else (MPI.Exception, NATIVE.Error))
