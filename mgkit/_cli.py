"""The ``mgkit`` command: ``mgkit tour`` (runs the tour notebook, prints its report, writes HTML and
PNG files), ``mgkit devices``, and ``mgkit worker`` / ``mgkit run`` (``mgkit.launching``)."""

from __future__ import annotations

import argparse
import os
import sys

_DEFAULT_SIMULATED = 8


def _prepare(simulate: int | None) -> None:
    """Gives JAX simulated CPU devices before anything starts it (always harmless on a GPU machine)."""
    from ._devices import simulate as simulate_devices

    n = simulate or int(os.environ.get("MGKIT_SIMULATE") or _DEFAULT_SIMULATED)
    simulate_devices(n)


def tour(args: argparse.Namespace) -> int:
    """Runs the tour notebook in a fresh kernel, prints its report and writes its files."""
    from . import _tour

    out = _tour.output_dir(args.out)
    notebook = _tour.notebook_path()
    print(f"mgkit tour: running {notebook} in a fresh kernel", flush=True)
    result = _tour.run(out, progress=not args.no_progress)
    print()
    print(f"wrote into {result.out} ({result.seconds:.0f} s):")
    for path in (result.html, result.notebook, *result.pictures):
        print(f"  {path.name}")
    return 0


def devices_cmd(args: argparse.Namespace) -> int:
    from ._devices import devices

    _prepare(args.simulate)
    print(devices())
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``mgkit`` command line: ``tour`` and ``devices``."""
    parser = argparse.ArgumentParser(prog="mgkit", description="Many accelerators from a notebook, on JAX.")
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command")

    p_tour = sub.add_parser(
        "tour",
        help="run the tour notebook: print the device map, ledger and throughput; write HTML and PNGs",
        description="Runs notebooks/00_tour.ipynb in a fresh kernel (8 simulated CPU devices when there "
        "is no GPU), prints the device map, the ledger summary and the throughput per context, and "
        "writes the executed notebook (HTML and .ipynb) and PNG pictures of the dashboard into --out.",
    )
    p_tour.add_argument(
        "--out", default="mgkit-tour", metavar="DIR", help="folder for the tour's files (./mgkit-tour)"
    )
    p_tour.add_argument("--no-progress", action="store_true", help="no progress bar")
    p_tour.set_defaults(func=tour)

    p_dev = sub.add_parser("devices", help="list the devices JAX can see")
    p_dev.add_argument("--simulate", type=_positive_int, help="simulated CPU devices")
    p_dev.set_defaults(func=devices_cmd)

    from .launching import add_commands

    add_commands(sub, _positive_int)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.version:
        from ._version import __version__

        print(__version__)
        return 0
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return args.func(args)
    except (ValueError, TypeError, RuntimeError) as e:
        print(f"mgkit {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"mgkit {args.command}: interrupted", file=sys.stderr)
        return 130


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not at least 1")
    return value


if __name__ == "__main__":
    sys.exit(main())
