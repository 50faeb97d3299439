"""``asyncomm build``: compile asyncomm's optional C++ part (see ``asyncomm._native``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from types import ModuleType

import torch

from asyncomm import _native
from asyncomm._core import settings, small


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare the options of ``asyncomm build`` on its subparser."""
    parser.add_argument("--verbose", action="store_true", help="show the compiler's output")
    parser.set_defaults(func=run_command)


def check(module: ModuleType) -> str | None:
    """Return what the compiled module gets wrong against its Python twins, or ``None``."""
    encode, inline = module.encode, module.inline
    module.setup(small.DTYPE_TABLE)
    for t in (torch.arange(6.0).reshape(2, 3), torch.tensor(7, dtype=torch.int64),
              torch.ones(3, dtype=torch.bfloat16), torch.zeros(0, 4)):
        body = encode(t, small.BYTES, 16)
        if body is None or body != small.encode(t, compiled=False):
            return f"a {t.dtype} tensor of shape {tuple(t.shape)} encodes differently"
        payload = body[3:]
        twin = small.inline_buffer(payload)
        if t.numel():
            module.keep(payload[:len(payload) - t.nbytes])
        made = inline(lambda code, data: small.inline_buffer(data), 16, 3, payload)
        if not (type(made) is torch.Tensor and type(twin) is torch.Tensor
                and made.dtype == t.dtype
                and made.shape == t.shape and torch.equal(made, twin)):
            return f"a {t.dtype} tensor of shape {tuple(t.shape)} decodes differently"
        packet = small.packet_head(1) + small.head(small.DATA, 3, 0) + body
        items = module.unpack_packet(packet, 16)
        if t.numel() and not (items and torch.equal(items[0][3], twin)):
            return f"a packet of a {t.dtype} tensor of shape {tuple(t.shape)} reads differently"
    request = [7, "worker", "step", True, None, -300, 2.5, torch.arange(3.0)]
    if encode(request, small.BYTES, 16) != small.encode(request, compiled=False):
        return "a list of scalars and a tensor encodes differently"
    module.forget()
    return None


def run_command(args: argparse.Namespace) -> int:
    """Run ``asyncomm build`` as parsed; return its exit code."""
    root = settings.cache_dir()
    try:
        path = _native.build(root, verbose=args.verbose)
    except (RuntimeError, OSError, ImportError) as err:
        print(f"asyncomm build: cannot compile ({err}); asyncomm runs without it, in Python",
              file=sys.stderr)
        return 1
    module = _native.load(root)
    problem = "it does not load" if module is None else check(module)
    if problem is not None:
        print(f"asyncomm build: built {path}, but {problem}", file=sys.stderr)
        return 1
    print(f"asyncomm build: {path}")
    return build_mpi(root, args.verbose)


def build_mpi(root: Path, verbose: bool) -> int:
    """Build the MPI link's compiled calls where mpi4py and MPI's header are there; return
    the exit code (a build that fails where it could be made is one)."""
    try:
        from asyncomm._backends import mpi_native
    except ImportError:  # no mpi4py: nothing to build
        return 0
    try:
        path = mpi_native.build(root, verbose)
    except (RuntimeError, OSError, ImportError) as err:
        print(f"asyncomm build: cannot compile the MPI calls ({err}); the MPI link calls "
              "mpi4py instead", file=sys.stderr)
        return 1
    if path is None:
        print("asyncomm build: no MPI header beside the MPI library mpi4py loaded: the MPI "
              "link calls mpi4py")
        return 0
    name = mpi_native.module_name()
    if name is None or _native.load(root, name) is None:
        print(f"asyncomm build: built {path}, but it does not load", file=sys.stderr)
        return 1
    print(f"asyncomm build: {path}")
    return 0
