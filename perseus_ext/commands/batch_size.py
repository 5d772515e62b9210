"""`perseus-ext batch-size STORE`: inspect the batch-size optimizer's state.

STORE is what `perseus.policy.batch_size.store` names: a path, ``sqlite:///path`` or
``postgresql://user@host:port/db``. Shows, per recurring job, every candidate batch size's runs
and costs, which sizes were pruned, the current best and the early-stopping limit the next run
gets. Read-only (unless --migrate): safe to run while jobs are writing the same store.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import TYPE_CHECKING

from perseus_ext.commands.arguments import bounded_float

if TYPE_CHECKING:
    from perseus_ext.policies.batch_size import ArmState, JobState


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "batch-size",
        help="inspect the batch-size optimizer's state (recurring jobs)",
        description="Show what the batch-size optimizer learned about each recurring job.",
    )
    parser.add_argument(
        "store", help="the store: a path, sqlite:///path or postgresql://user@host:port/db"
    )
    parser.add_argument("--job", help="show only this job_id")
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON")
    parser.add_argument(
        "--migrate", action="store_true", help="upgrade a store written by an older perseus-ext"
    )
    parser.add_argument("--timeout", type=bounded_float(0.1, 3600.0), default=5.0, metavar="SECONDS",
                        help="a PostgreSQL store's connect timeout (default %(default)g s)")
    parser.set_defaults(func=run)


def _arm_status(arm: "ArmState", best: int | None) -> str:
    if arm.pruned:
        return "pruned"
    if not arm.costs:
        return "running" if arm.running else "untried"
    return "best" if arm.batch_size == best else "candidate"


def run(args: argparse.Namespace) -> int:
    from perseus_ext.policies.batch_size import read_states

    states = read_states(args.store, args.job, migrate=args.migrate, network_timeout_s=args.timeout,
                         timeout_key="--timeout")
    try:
        if args.json:
            print(json.dumps([_as_dict(s) for s in states], indent=2))
        else:
            _print_states(args.store, states)
        sys.stdout.flush()
    except BrokenPipeError:
        # The reader left (`| head`): not an error. Point stdout at /dev/null so the
        # interpreter's own flush at exit does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


def _print_states(store: str, states: "list[JobState]") -> None:
    if not states:
        print(f"{store}: no jobs yet")
    for state in states:
        best = state.best_batch_size
        limit = state.cost_limit
        print(
            f"job {state.job_id}: {state.num_runs} runs, eta={state.eta:g}, "
            f"max_power={state.max_power_w:g} W, "
            f"beta={state.beta:g}, default batch size {state.default_batch_size}"
        )
        print(
            f"  best batch size: {best if best is not None else '-'}; next run's cost limit: "
            f"{f'{limit:.4g}' if limit is not None else 'none yet'}"
        )
        print(
            f"  {'batch':>7} {'runs':>5} {'reached':>7} {'stopped':>7} {'missed':>7} "
            f"{'running':>7} {'expired':>7} {'mean cost':>11} {'std':>10}  status"
        )
        import statistics  # here, not at the top: every command's start-up imports this module

        for batch_size in sorted(state.arms):
            arm = state.arms[batch_size]
            mean = arm.mean_cost
            std = statistics.stdev(arm.costs) if len(arm.costs) > 1 else None
            print(
                f"  {batch_size:>7} {len(arm.costs) + arm.running:>5} {arm.reached:>7} "
                f"{arm.stopped:>7} {arm.not_reached:>7} {arm.running:>7} {arm.expired:>7} "
                f"{f'{mean:.4g}' if mean is not None else '-':>11} "
                f"{f'{std:.3g}' if std is not None else '-':>10}  {_arm_status(arm, best)}"
            )


def _as_dict(state: "JobState") -> dict:
    best = state.best_batch_size
    return {
        "job_id": state.job_id,
        "eta": state.eta,
        "max_power_w": state.max_power_w,
        "beta": state.beta,
        "default_batch_size": state.default_batch_size,
        "num_runs": state.num_runs,
        "best_batch_size": best,
        "cost_limit": state.cost_limit,
        "batch_sizes": [
            {
                "batch_size": arm.batch_size,
                "costs": arm.costs,
                "reached": arm.reached,
                "stopped": arm.stopped,
                "not_reached": arm.not_reached,
                "running": arm.running,
                "expired": arm.expired,
                "status": _arm_status(arm, best),
            }
            for arm in (state.arms[b] for b in sorted(state.arms))
        ],
    }
