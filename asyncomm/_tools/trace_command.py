"""``asyncomm trace DIR``: merge a traced run's rank files, print the overlap, draw the PNG."""

from __future__ import annotations

import argparse
import sys

from asyncomm._observe.timeline import summarise


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare the options of ``asyncomm trace`` on its subparser."""
    parser.add_argument("directory", metavar="DIR", help="where the ranks wrote rank*.json")
    parser.add_argument("--json", metavar="PATH",
                        help="merged Chrome/Perfetto trace (default DIR/trace.json)")
    parser.add_argument("--png", metavar="PATH", help="timeline (default DIR/timeline.png)")
    parser.add_argument("--steps", metavar="A:B", action="append", default=[],
                        help="steps A to B (as the program marked them with "
                        "asyncomm.trace.step()): their figures, and only them drawn; again "
                        "for more ranges, drawn side by side")
    parser.set_defaults(func=run_command)


def run_command(args: argparse.Namespace) -> int:
    """Run ``asyncomm trace`` as parsed; return its exit code."""
    try:
        chosen = []
        for steps in args.steps:
            first, _, last = steps.partition(":")
            chosen.append((int(first), int(last or first)))
        summarise(args.directory, args.json, args.png, chosen)
    except (FileNotFoundError, ValueError) as err:
        print(f"asyncomm trace: {err}", file=sys.stderr)
        return 2
    return 0
