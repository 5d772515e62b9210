"""`perseus-ext frontier`: compute a pipeline's iteration time–energy frontier from a profile."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from perseus_ext.errors import ProfileError

SHIPPED_PROFILES = Path(__file__).resolve().parents[2] / "examples" / "profiles"


def resolve_profile(name: str) -> Path:
    """A profile path, or the name of a shipped one (e.g. `gpt3-175b-a100_sxm`)."""
    path = Path(name)
    if path.is_file():
        return path
    shipped = SHIPPED_PROFILES / (name if name.endswith(".csv") else f"{name}.csv")
    if shipped.is_file():
        return shipped
    names = sorted(p.stem for p in SHIPPED_PROFILES.glob("*.csv"))
    raise ProfileError(f"--profile {name!r}: no such file, nor a shipped profile ({', '.join(names)})")


def default_blocking_power(profile: Path) -> float:
    """The published blocking power for the GPU named in a shipped profile's file name."""
    from perseus_ext.planning.energy import BLOCKING_POWER_W

    for gpu, watts in BLOCKING_POWER_W.items():
        if gpu in profile.stem.lower():
            return watts
    raise ProfileError(
        f"--blocking-power is needed: {profile.name} does not name a GPU with a published "
        f"blocking power ({', '.join(BLOCKING_POWER_W)})"
    )


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "frontier",
        help="compute the iteration time-energy frontier of a pipeline from a profile",
        description="Compute every Pareto-optimal (iteration time, energy) plan of a pipeline, "
        "from all-max-clock speed to the minimum-energy plan, and write it as JSON.",
    )
    parser.add_argument(
        "--profile", required=True,
        help="profile CSV (stage,instruction,frequency,time,energy) or a shipped profile name",
    )
    parser.add_argument("--stages", type=int, help="pipeline stages (default: the profile's)")
    parser.add_argument("--microbatches", type=int, required=True, help="microbatches per iteration")
    parser.add_argument(
        "--blocking-power", type=float,
        help="GPU power (W) while blocked on communication (default: published value for the "
        "GPU in the profile's name: 83.64 A100, 70.38 A40)",
    )
    parser.add_argument("--schedule", choices=["1f1b", "interleaved"], default="1f1b")
    parser.add_argument("--virtual-stages", type=int, default=1, help="model chunks per stage (interleaved)")
    parser.add_argument("--resolution", type=float, default=1e-3, help="max time step between plans (s)")
    parser.add_argument(
        "--switch-latency", type=float, default=0.0,
        help="effective clock-change latency (s): plans pay for it and avoid changes not worth it",
    )
    parser.add_argument("--out", type=Path, help="write the frontier JSON here")
    parser.add_argument("--plot", type=Path, help="write a frontier plot (PNG/SVG) here")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from perseus_ext.planning.profile import load_profile
    from perseus_ext.planning.schedule import build_schedule
    from perseus_ext.planning.solver import SolverOptions, solve_frontier

    path = resolve_profile(args.profile)
    profile = load_profile(path)
    power = args.blocking_power if args.blocking_power is not None else default_blocking_power(path)
    stages = args.stages or profile.num_stages
    schedule = build_schedule(args.schedule, stages, args.microbatches, args.virtual_stages)
    started = time.perf_counter()
    frontier = solve_frontier(
        schedule, profile, power, SolverOptions(resolution=args.resolution, progress=True),
        switch_latency_s=args.switch_latency,
    )
    elapsed = time.perf_counter() - started
    if args.out:
        frontier.save(args.out)
    if args.plot:
        from perseus_ext.plotting import plot_frontier

        plot_frontier(frontier, args.plot)

    fast, cheapest, base = frontier.fastest, frontier.min_energy, frontier.baseline
    print(f"profile        {path.name} ({profile.num_stages} stages), blocking power {power:g} W")
    print(f"schedule       {schedule.kind.value}, {stages} stages x {args.microbatches} microbatches"
          + (f" x {args.virtual_stages} virtual stages" if args.virtual_stages > 1 else ""))
    print(f"solved in      {elapsed:.2f} s: {len(frontier.plans)} plans")
    print(f"all max clock  T = {base.time:.4f} s, energy {base.energy:,.1f} J")
    print(f"T_min          T = {fast.time:.4f} s, energy {fast.energy:,.1f} J "
          f"(intrinsic saving {frontier.intrinsic_saving():.2%} at no slowdown)")
    print(f"T* (min energy) T = {cheapest.time:.4f} s, energy {cheapest.energy:,.1f} J "
          f"({1 - cheapest.energy / base.energy:.2%} less, {cheapest.time / base.time - 1:+.2%} time)")
    if args.out:
        print(f"wrote          {args.out}")
    if args.plot:
        print(f"plotted        {args.plot}")
    sys.stdout.flush()
    return 0
