"""The ``asyncomm`` command line: ``run`` launches, ``bench`` measures, ``trace`` merges a
traced run, ``pipeline show`` draws a pipeline schedule."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

# Each command's module declares its options; only the module of the command being run is
# imported, so ``asyncomm run`` starts its ranks without first loading torch itself.
_COMMANDS = {
    "run": ("asyncomm._tools.launch", "run a script on N local ranks (gloo or MPI)"),
    "bench": ("asyncomm._tools.bench", "compare asyncomm with the raw backend"),
    "pipeline": ("asyncomm._tools.pipeline_command", "check and draw pipeline-parallel schedules"),
    "trace": ("asyncomm._tools.trace_command", "merge a traced run: trace JSON, overlap, PNG"),
}


def _parser(argv: Sequence[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="asyncomm", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    chosen = next((arg for arg in argv if not arg.startswith("-")), None)
    for name, (module, summary) in _COMMANDS.items():
        sub = commands.add_parser(name, help=summary)
        if name == chosen:
            importlib.import_module(module).add_arguments(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``asyncomm`` command; return its exit code."""
    from_command_line = argv is None
    argv = sys.argv[1:] if argv is None else argv
    args = _parser(argv).parse_args(argv)
    code: int = args.func(args)
    if args.command == "run" and from_command_line:
        # The command line's launcher: its ranks are gone, and what it loaded for them
        # (torch, for the rendezvous store) needs no finalizing, which costs a loaded
        # machine most of a second per job.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
