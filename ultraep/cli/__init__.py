"""The ``ultraep`` command line (``python -m ultraep.cli`` too).

Every subcommand lives in its own module exposing ``register(subparsers)`` (``plan``, ``trace``, ``demo`` here,
``sql``/``report``/``export`` in the telemetry package, ``dashboard`` in the dashboard's, ``simulate``); they
are listed in ``COMMANDS``. User mistakes (bad arguments, files, values, sizes beyond :mod:`ultraep.limits`) print one line on
stderr and exit with code 2, without a traceback; Ctrl-C prints one line and exits with 130.
"""

from __future__ import annotations

import argparse
import sys
from importlib import import_module

from ultraep.errors import DistributedError, UltraEPError, format_pydantic_error

# module path of each subcommand family, in help order
COMMANDS = [
    "ultraep.cli.plan",
    "ultraep.telemetry.cli",
    "ultraep.dashboard.cli",
    "ultraep.cli.simulate",
    "ultraep.cli.trace",
    "ultraep.cli.demo",
]

# commands that time planners warm them up themselves, after their size checks, so that a refusal never waits
# for a cold compile (issue 22): the demo's ranks in ``ultraep.wrap``, ``plan`` and ``simulate()`` in their own code
PLANNING_COMMANDS: tuple[str, ...] = ()


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:
        """argparse's own usage errors (a bad choice, a missing argument): one line and exit 2, like every other
        user mistake; the usage is one ``--help`` away, and the line says so."""
        print(f"ultraep: error: {message} (see: {self.prog} --help)", file=sys.stderr)
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="ultraep", description="MoE expert-parallel load balancing with telemetry.")
    from ultraep import __version__

    parser.add_argument("--version", action="version", version=f"ultraep {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for mod in COMMANDS:
        import_module(mod).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command in PLANNING_COMMANDS:
            # Compile the planners (or load numba's cache) before anything is timed: a first plan would
            # otherwise carry ~20 s of compilation on a fresh machine and be reported as planning time.
            from ultraep.planning import warm_up

            warm_up()
        rc = args.func(args)
    except KeyboardInterrupt:  # Ctrl-C: outputs are written under a temporary name and renamed on success
        print("ultraep: interrupted", file=sys.stderr)
        return 130
    except DistributedError as exc:  # a peer or collective failed: not the user's input
        print(f"ultraep: error: {exc}", file=sys.stderr)
        return 1
    except UltraEPError as exc:
        print(f"ultraep: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a path the user named cannot be read or written (missing, a file, read-only, full)
        where = exc.filename if exc.filename is not None else ""
        print(f"ultraep: error: {where}{': ' if where else ''}{exc.strerror or exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # pydantic ValidationError: user input, reported by field path
        if type(exc).__name__ == "ValidationError":
            print(f"ultraep: error: {format_pydantic_error(exc)}", file=sys.stderr)
            return 2
        raise
    return int(rc or 0)
