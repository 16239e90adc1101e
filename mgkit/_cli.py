"""The ``mgkit`` command: ``mgkit tour`` and ``mgkit devices``."""

from __future__ import annotations

import argparse
import os
import sys
import time

_DEFAULT_SIMULATED = 8


def _prepare(simulate: int | None) -> None:
    """Gives JAX simulated CPU devices before anything starts it (always harmless on a GPU machine)."""
    import mgkit as mg

    n = simulate or int(os.environ.get("MGKIT_SIMULATE") or _DEFAULT_SIMULATED)
    mg.simulate(n)


def tour(args: argparse.Namespace) -> int:
    """Prints the device map, makes placements and transfers, and prints the ledger summary."""
    import numpy as np

    import mgkit as mg

    _prepare(args.simulate)
    import jax
    import jax.numpy as jnp

    table = mg.devices()
    accel = [r.name for r in table if r.platform != "cpu"]
    print(f"mgkit {mg.__version__} on jax {jax.__version__}, backend {jax.default_backend()}")
    print("no accelerator found: running on simulated CPU devices\n" if not accel else "")
    print(table, "\n")

    spec = args.contexts or _tour_map(accel, table.names)
    cmap = mg.use_contexts(spec)
    names = list(cmap.names)
    first, second = names[0], names[1 % len(names)]
    print()

    size = args.mib * 1024 * 1024 // 4
    host = np.random.default_rng(0).standard_normal(size, dtype=np.float32)
    t0 = time.perf_counter()
    placed = {n: mg.put(host, n) for n in names}  # one copy on every context
    with mg.on(second):
        made_here = jnp.ones((1024, 1024))
    moved = mg.transfer(made_here, first)
    a, b = mg.colocate(placed[first], placed[second], to=first)
    total = float((a + b).sum())
    back = mg.transfer(moved, "cpu")
    mg.synchronize()
    elapsed = time.perf_counter() - t0
    print(f"placed {args.mib} MiB on {len(names)} context(s), moved arrays between {first} and {second},")
    print(f"summed on {first} ({total:.3f}) and brought {back.nbytes / 2**20:.0f} MiB back to the host")
    print(f"in {elapsed:.3f} s.\n")

    # Seed 004: split a batch over every context, run a function on each part, concatenate.
    batch = host[: 4 * len(names) + 3].reshape(-1, 1)  # a size that does not divide: exact anyway
    w = jnp.linspace(-1.0, 1.0, 8).reshape(1, 8)
    f = mg.parallel(lambda w, x: jnp.tanh(x @ w), in_axes=(None, 0))
    t0 = time.perf_counter()
    out = f(w, batch)
    exact = np.allclose(np.asarray(out), np.tanh(batch @ np.asarray(w)), atol=1e-6)
    rows = [e.info["rows"] for e in mg.ledger().records("run")]
    print(
        f"split a batch of {len(batch)} rows over {len(rows)} context(s) as {rows}, ran tanh(x @ w) on each,"
    )
    seconds = time.perf_counter() - t0
    print(f"concatenated on {mg.where(out)}: equal to one device's result: {exact} ({seconds:.3f} s)\n")
    print(mg.ledger().summary())
    print()
    print(mg.ledger().matrix())
    return 0


def _tour_map(accel: list[str], names: list[str]) -> str:
    """dev0..devN over the accelerators plus the host CPU as 'host0', else over the CPU devices."""
    if accel:
        return ";".join([f"dev{i}->{n}" for i, n in enumerate(accel)] + ["host0->cpu0"])
    return ";".join(f"dev{i}->{n}" for i, n in enumerate(n for n in names if n.startswith("cpu")))


def devices_cmd(args: argparse.Namespace) -> int:
    import mgkit as mg

    _prepare(args.simulate)
    print(mg.devices())
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mgkit", description="Many accelerators from a notebook, on JAX.")
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command")

    p_tour = sub.add_parser("tour", help="show the device map, move data between contexts, print the ledger")
    p_tour.add_argument("--contexts", help="context map to use, e.g. 'dev0->cuda0;dev1->cpu0'")
    p_tour.add_argument(
        "--simulate", type=_positive_int, help="simulated CPU devices (default: $MGKIT_SIMULATE or 8)"
    )
    p_tour.add_argument("--mib", type=_positive_int, default=32, help="MiB placed on each context (32)")
    p_tour.set_defaults(func=tour)

    p_dev = sub.add_parser("devices", help="list the devices JAX can see")
    p_dev.add_argument("--simulate", type=_positive_int, help="simulated CPU devices")
    p_dev.set_defaults(func=devices_cmd)

    args = parser.parse_args(argv)
    if args.version:
        import mgkit

        print(mgkit.__version__)
        return 0
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return args.func(args)
    except (ValueError, TypeError, RuntimeError) as e:
        print(f"mgkit {args.command}: error: {e}", file=sys.stderr)
        return 1


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
