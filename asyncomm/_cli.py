"""The ``asyncomm`` command line: ``run`` launches a world, ``bench`` measures it,
``pipeline show`` draws a pipeline schedule."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="asyncomm", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    from asyncomm import _launch

    _launch.add_arguments(
        commands.add_parser("run", help="run a script on N local ranks (gloo or MPI)")
    )

    from asyncomm import _bench

    _bench.add_arguments(
        commands.add_parser("bench", help="compare asyncomm with the raw backend")
    )

    from asyncomm.pipeline import _show

    _show.add_arguments(
        commands.add_parser("pipeline", help="check and draw pipeline-parallel schedules")
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``asyncomm`` command; return its exit code."""
    args = _parser().parse_args(argv)
    code: int = args.func(args)
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
