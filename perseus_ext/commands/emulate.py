"""`perseus-ext emulate`: a whole job's energy with and without perseus-ext, from stage profiles.

Example (the paper's GPT-3 175B large-scale setup at T'/T = 1.2)::

    perseus-ext emulate --profile gpt3-175b-a100_sxm \\
        --tp 8 --pp 8 --global-batch 1536 --microbatches 12 24 48 96 \\
        --blocking-power a100 --scale 10 --slowdown 1.2
"""

from __future__ import annotations

import argparse

from perseus_ext.commands.arguments import (
    add_blocking_power_argument,
    add_profile_argument,
    bounded_float,
    bounded_int,
    check_plotting,
    check_writable_dir,
    check_writable_file,
)

MAX_PARALLEL = 1 << 20  # GPUs per stage / stages / samples: far above any real job
MAX_MICROBATCHES = 4096
MAX_SCALE = 1e6
MAX_SYNC_GAP_S = 1e5
MAX_GPU_POWER_W = 1e5
MAX_SLOWDOWN = 100.0  # perseus_ext.emulator.scenario's (not imported here: --help stays fast)
DEFAULT_SWEEP = [1.0, 1.05, 1.1, 1.2, 1.3, 1.5, 2.0]
OUTPUT_SUFFIXES = (".csv", ".json")  # what emulator.report.write_records writes
# --schedule choices -> planning.schedule.ScheduleKind values; the torch ones are built by
# torch.distributed.pipelining's own classes (adapters.torch_pipelining_orders)
SCHEDULE_KINDS = {"1f1b": "1f1b", "interleaved": "interleaved", "combined_1f1b": "combined_1f1b",
                  "zero-bubble": "zero_bubble", "zb-v": "zbv", "dualpipev": "dualpipev"}
TORCH_SCHEDULES = ("zero-bubble", "zb-v", "dualpipev")
V_SHAPED = ("zb-v", "dualpipev")  # exactly two chunks per stage
SCHEDULE_CHOICES = list(SCHEDULE_KINDS)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "emulate",
        help="emulate a large TP x PP x DP job's energy with and without perseus-ext",
        description=(
            "Emulate one training iteration of a whole TP x PP x DP job from per-stage profiles: "
            "iteration time and energy with all GPUs at max clock, a Zeus-style global clock, an "
            "EnvPipe-style plan, perseus-ext intrinsic only, and perseus-ext intrinsic + extrinsic "
            "(wait-aware) under a straggler scenario. Uses the runtime's planner and straggler policy."
        ),
    )
    job = parser.add_argument_group("job")
    add_profile_argument(job)
    job.add_argument("--tp", type=bounded_int(1, MAX_PARALLEL), default=1,
                     help="tensor-parallel degree: GPUs per stage (default 1)")
    job.add_argument("--pp", type=bounded_int(1, MAX_PARALLEL), default=None,
                     help="pipeline stages (default: the profile's stage count)")
    job.add_argument("--microbatches", type=bounded_int(1, MAX_MICROBATCHES), nargs="+", required=True,
                     help="microbatches per pipeline per iteration; several values emulate several job sizes")
    job.add_argument("--global-batch", type=bounded_int(1, MAX_PARALLEL), default=None,
                     help="samples per iteration of the whole job; DP = global batch / (microbatches x "
                          "microbatch size) (default: one pipeline)")
    job.add_argument("--microbatch-size", type=bounded_int(1, MAX_PARALLEL), default=1,
                     help="samples per microbatch (default 1)")
    job.add_argument("--schedule", default="1f1b", choices=SCHEDULE_CHOICES,
                     help="pipeline schedule: 1f1b; interleaved and combined_1f1b (megatron-core's, with "
                          "--chunks); zero-bubble, zb-v and dualpipev (the order torch.distributed."
                          "pipelining's ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble and "
                          "ScheduleDualPipeV run; needs the torch extra)")
    job.add_argument("--chunks", type=bounded_int(1, 64), default=None,
                     help="model chunks per stage (interleaved, combined_1f1b, zero-bubble; zb-v and "
                          "dualpipev run 2) (default 1, or 2 for zb-v and dualpipev)")
    job.add_argument("--input-gradient-share", type=bounded_float(0, 1, inclusive_min=False), default=None,
                     metavar="S", help="schedules that split the backward (zero-bubble, zb-v, dualpipev): the "
                     "input-gradient half is S x the profiled backward, the weight-gradient half (1 - S) x "
                     "(time and energy; default 0.5), where the profile does not measure them")
    job.add_argument("--overlap-share", type=bounded_float(0, 1), default=None, metavar="O",
                     help="combined_1f1b: a combined unit takes forward + backward - O x the shorter of the "
                          "two, with their energies summed (default 0: no overlap credited)")

    energy = parser.add_argument_group("energy model")
    add_blocking_power_argument(energy)
    energy.add_argument("--scale", type=bounded_float(0, MAX_SCALE, inclusive_min=False), default=1.0,
                        help="the full model has SCALE times the profiled layers per stage: stage "
                             "times and per-GPU energies are multiplied by SCALE (paper: 10)")
    energy.add_argument("--energy-scale", type=bounded_float(0, MAX_SCALE, inclusive_min=False), default=None,
                        help="per-GPU energy multiplier if it differs from --scale")
    energy.add_argument("--stage-constant", action="store_true",
                        help="plan one clock per stage for the whole iteration, as perseus-ext does under "
                             "megatron-core's full-iteration CUDA graphs (benchmarks/graph_safe_plans.py "
                             "compares both)")
    energy.add_argument("--clock-budgets", action="store_true",
                        help="also print what each clock-change budget costs one pipeline (no budget, 10, 5 "
                             "and 2 changes/s per GPU, one clock per stage) at T'/T 1.0 and 1.05")

    scenario = parser.add_argument_group("straggler scenario (default: none)")
    which = scenario.add_mutually_exclusive_group()
    which.add_argument("--slowdown", type=bounded_float(1, MAX_SLOWDOWN), default=None,
                       help="one pipeline is this many times slower (T'/T, e.g. 1.2)")
    which.add_argument("--slowdown-distribution", default=None, metavar="F:W,...",
                       help="share of iterations at each slowdown, e.g. '1.0:0.9,1.2:0.07,1.5:0.03'")
    which.add_argument("--slowdown-trace", default=None, metavar="CSV",
                       help="per-iteration slowdowns (column 'slowdown' or the first column)")
    which.add_argument("--sweep", type=bounded_float(1, MAX_SLOWDOWN), nargs="*", default=None, metavar="F",
                       help="one steady straggler per factor (default factors 1.0, 1.05, 1.1, 1.2, 1.3, 1.5, 2.0)")

    budget = parser.add_argument_group("power budget")
    budget.add_argument("--power-budget", type=bounded_float(0, 1, inclusive_min=False), nargs="*",
                        default=None, metavar="FRACTION",
                        help="also print throughput at equal average power: perseus-ext's budget "
                             "policy vs one global power limit vs one global clock, at these "
                             "fractions of the all-max-clock power (default 0.6, 0.65, ..., 1.0)")

    swing = parser.add_argument_group("power swing (the whole job's, gradient sync included; docs/power.md)")
    swing.add_argument("--sync-gap-s", type=bounded_float(0, MAX_SYNC_GAP_S), default=None, metavar="SECONDS",
                       help="the gradient sync and optimizer step after every iteration, in seconds (default: "
                            "5%% of the all-max-clock iteration time)")
    swing.add_argument("--sync-gap-power", type=bounded_float(0, MAX_GPU_POWER_W), default=None, metavar="WATTS",
                       help="what each GPU draws during the gradient sync and optimizer step (default: the "
                            "blocking power)")

    out = parser.add_argument_group("output")
    out.add_argument("--output", default=None, metavar="PATH",
                     help="write every strategy's numbers to PATH (.csv or .json)")
    out.add_argument("--plot-dir", default=None, metavar="DIR",
                     help="write figures: frontier and timeline per job size, or savings vs slowdown "
                          "with --sweep")
    out.add_argument("--plot-format", default="png", choices=["png", "svg", "pdf"],
                     help="figure file type (default: %(default)s)")
    out.add_argument("--markdown", action="store_true", help="print tables as markdown")
    parser.set_defaults(func=run)


def check_outputs(args: argparse.Namespace) -> None:
    """Fail before emulating if an output cannot be written, or is of a format it cannot hold
    (`--output x.xlsx` would be CSV text under a spreadsheet's name)."""
    from pathlib import Path

    from perseus_ext.errors import ConfigError

    if args.output:
        suffix = Path(args.output).suffix.lower()
        if suffix not in OUTPUT_SUFFIXES:
            raise ConfigError(f"--output {args.output}: {suffix or 'no suffix'} is not a format this command writes; "
                              f"end the file name in {' or '.join(OUTPUT_SUFFIXES)}")
        check_writable_file(Path(args.output), "--output")
    if args.plot_dir:
        check_plotting(None, "--plot-dir")
        check_writable_dir(Path(args.plot_dir), "--plot-dir")


def check_schedule_choice(args: argparse.Namespace) -> None:
    """Refuse, before loading anything, a schedule this installation cannot build: the torch
    ones need torch.distributed.pipelining (the `torch` extra); zb-v and dualpipev run exactly
    two model chunks per stage; the derivation flags apply only where their kinds run."""
    from perseus_ext.errors import ConfigError

    if args.schedule in TORCH_SCHEDULES:
        from perseus_ext.adapters.torch_pipelining_orders import TORCH_EXTRA, torch_available

        if not torch_available():
            raise ConfigError(f"--schedule {args.schedule}: its order comes from torch.distributed.pipelining, "
                              f"and torch is not installed; install the {TORCH_EXTRA!r} extra (pip install "
                              f"'perseus-ext[{TORCH_EXTRA}]') or use --schedule 1f1b, interleaved or combined_1f1b")
    if args.schedule in V_SHAPED and args.chunks not in (None, 2):
        raise ConfigError(f"--chunks {args.chunks}: {args.schedule} runs exactly 2 model chunks per stage (its V "
                          f"shape); leave --chunks out")
    if args.input_gradient_share is not None and args.schedule not in TORCH_SCHEDULES:
        raise ConfigError(f"--input-gradient-share: the {args.schedule} schedule runs no split backward; use it "
                          f"with --schedule zero-bubble, zb-v or dualpipev")
    if args.overlap_share is not None and args.schedule not in ("combined_1f1b",):
        raise ConfigError(f"--overlap-share: the {args.schedule} schedule emulated here runs no combined unit; use "
                          f"it with --schedule combined_1f1b")


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from perseus_ext.commands.arguments import blocking_power_w, check_pipeline_size, resolve_profile
    from perseus_ext.emulator import Emulator, JobLayout, StragglerScenario, report
    from perseus_ext.errors import ConfigError, PerseusError
    from perseus_ext.planning.derived import DerivationRule
    from perseus_ext.planning.profile import load_profile
    from perseus_ext.planning.stage_constant import solve_stage_constant

    check_schedule_choice(args)
    args.chunks = args.chunks if args.chunks is not None else (2 if args.schedule in V_SHAPED else 1)
    profile_path = resolve_profile(args.profile)
    profile = load_profile(profile_path)
    pp = args.pp if args.pp is not None else profile.num_stages // args.chunks
    blocking = blocking_power_w(args.blocking_power, profile_path)
    if args.sweep is not None:
        factors = args.sweep or DEFAULT_SWEEP
        scenario = None
    elif args.slowdown is not None:
        scenario = StragglerScenario.fixed(args.slowdown)
    elif args.slowdown_distribution is not None:
        try:
            scenario = StragglerScenario.parse(args.slowdown_distribution)
        except ConfigError as err:
            raise ConfigError(f"--slowdown-distribution: {err}") from None
    elif args.slowdown_trace is not None:
        try:
            scenario = StragglerScenario.from_trace(args.slowdown_trace)
        except PerseusError as err:
            raise ConfigError(f"--slowdown-trace: {err}") from None
    else:
        scenario = StragglerScenario.none()

    if pp < 1:
        raise ConfigError(f"--chunks {args.chunks} is more than the profile's {profile.num_stages} stages: no "
                          f"pipeline stage is left; lower --chunks or give --pp")
    if profile.num_stages not in (pp, pp * args.chunks) and args.schedule in V_SHAPED:
        ranks = sorted({profile.num_stages, profile.num_stages // 2} - {0, 1}) if profile.num_stages % 2 == 0 \
            else [profile.num_stages]
        raise ConfigError(f"--pp {pp}: {args.schedule} runs 2 chunks per stage, so the profile {profile_path.name}'s "
                          f"{profile.num_stages} stages must be the pipeline's stages or its chunks; give --pp "
                          f"{' or '.join(map(str, ranks))}")
    if profile.num_stages not in (pp, pp * args.chunks):
        divisors = [k for k in range(1, profile.num_stages + 1) if profile.num_stages % k == 0]
        raise ConfigError(f"--chunks {args.chunks} x --pp {pp} = {pp * args.chunks} virtual stages, but the profile "
                          f"{profile_path.name} has {profile.num_stages} stages: it must profile every stage "
                          f"(--pp) or every virtual stage (--pp x --chunks); give --chunks dividing "
                          f"{profile.num_stages} ({', '.join(map(str, divisors))}) without --pp, or --pp "
                          f"{profile.num_stages // args.chunks if profile.num_stages % args.chunks == 0 else profile.num_stages}")
    for microbatches in args.microbatches:
        check_pipeline_size(pp, microbatches, args.chunks, flags=("--pp", "--microbatches", "--chunks"))
        per_pipeline = microbatches * args.microbatch_size
        if args.global_batch is not None and args.global_batch % per_pipeline:
            raise ConfigError(f"--global-batch {args.global_batch} is not a multiple of --microbatches {microbatches} "
                              f"x --microbatch-size {args.microbatch_size} = {per_pipeline}: every data-parallel "
                              f"pipeline must get as many samples; give a --global-batch that is a multiple of "
                              f"{per_pipeline}")
    check_outputs(args)
    kind = SCHEDULE_KINDS[args.schedule]
    rule = DerivationRule(
        input_gradient_share=0.5 if args.input_gradient_share is None else args.input_gradient_share,
        overlap_share=0.0 if args.overlap_share is None else args.overlap_share,
    )
    emulators = []
    for microbatches in args.microbatches:
        global_batch = args.global_batch or microbatches * args.microbatch_size
        actions = None
        if args.schedule in TORCH_SCHEDULES:
            from perseus_ext.adapters.torch_pipelining_orders import torch_schedule

            actions = torch_schedule(kind, pp, microbatches, args.chunks)
        layout = JobLayout(
            tensor_parallel=args.tp, pipeline_parallel=pp, global_batch=global_batch,
            microbatches=microbatches, microbatch_size=args.microbatch_size,
            schedule=kind, chunks=args.chunks, actions=actions,
        )
        emulators.append(Emulator(
            profile, layout, blocking, time_scale=args.scale, energy_scale=args.energy_scale,
            solver=solve_stage_constant if args.stage_constant else None, derivation=rule,
        ))

    energy_scale = args.scale if args.energy_scale is None else args.energy_scale
    print(
        f"profile {profile_path.name}: {args.schedule}{f' ({args.chunks} chunks per stage)' * (args.chunks > 1)}"
        f"{', stage-constant plans' if args.stage_constant else ''}, blocking power "
        f"{blocking:g} W/GPU, stage time x{args.scale:g}, GPU energy x{energy_scale:g}"
    )
    derived = sorted({name for emulator in emulators for name in emulator.derived_kinds})
    note = report.derivation_note(derived, rule, profile_path.name) if derived else None
    if derived:
        print(f"{', '.join(derived)}: estimated from the forward/backward profile (the legends say how)")
    for emulator in emulators:
        layout = emulator.layout
        print(f"job shape, {layout.microbatches} microbatches: {report.job_shape(layout)}" + (
            " (one pipeline: give --global-batch for data-parallel pipelines)"
            if layout.data_parallel == 1 and args.global_batch is None else ""))
    if args.clock_budgets:
        _print_clock_budgets(emulators, args)
    one_pipeline = any(em.layout.data_parallel == 1 for em in emulators)
    plot_dir = Path(args.plot_dir) if args.plot_dir else None
    if scenario is None:
        sweeps = {em.layout.microbatches: em.sweep(list(factors)) for em in emulators}
        print("\nTotal saving vs all GPUs at max clock (intrinsic + extrinsic), per slowdown T'/T:")
        print(report.sweep_table(sweeps, markdown=args.markdown))
        print(report.legend("sweep", derivation=note))
        print("\nTotal saving per strategy (perseus-ext: wait-aware; margin: over the better of one "
              "global clock and EnvPipe-style):")
        print(report.comparison_table(sweeps, profile_path.stem, markdown=args.markdown))
        print(report.legend("comparison", derivation=note))
        results = [e for runs in sweeps.values() for e in runs]
        if plot_dir:
            path = plot_dir / f"savings_vs_slowdown.{args.plot_format}"
            report.plot_sweep(sweeps, path, title=f"{profile_path.stem}: energy saving vs slowdown",
                              profile_stem=profile_path.stem)
            print(f"\nwrote {path}")
    else:
        results = [em.run(scenario) for em in emulators]
        for emulation in results:
            layout = emulation.layout
            print(f"\n{layout.microbatches} microbatches, {report.job_shape(layout)}, {scenario.name} (energy in "
                  f"{report.energy_unit(emulation)} per iteration, whole job):")
            print(report.detail_table(emulation, markdown=args.markdown))
        print(report.legend("detail", derivation=note))
        print(f"\nSavings vs all GPUs at max clock, {scenario.name}:")
        print(report.summary_table(results, markdown=args.markdown))
        print(report.legend("summary", one_pipeline=one_pipeline, derivation=note))
        if plot_dir and scenario.is_steady:
            for emulator, emulation in zip(emulators, results):
                for path in report.plot_emulation(emulator, emulation, plot_dir, args.plot_format):
                    print(f"wrote {path}")
    if scenario is not None:
        _print_power_swing(emulators, results, args)
    if args.power_budget is not None:
        _print_power_budget(emulators, args, scenario)
    if args.output:
        report.write_records(results, args.output)
        print(f"wrote {args.output}")
    return 0


def _print_clock_budgets(emulators: list, args: argparse.Namespace) -> None:
    """What each clock-change budget costs one pipeline, per job size (emulator/clock_budget.py)."""
    from perseus_ext.emulator.clock_budget import LEGEND, budget_costs, budget_table

    for emulator in emulators:
        print(f"\nClock-change budgets, one pipeline of {emulator.layout.microbatches} microbatches:")
        print(budget_table(budget_costs(emulator), markdown=args.markdown))
    print(LEGEND)


def _print_power_swing(emulators: list, results: list, args: argparse.Namespace) -> None:
    """The whole job's power swing per job size: all-max clocks and perseus-ext's plans."""
    import textwrap

    from perseus_ext.emulator.swing import SyncGap, job_swings, swing_legend, swing_table

    for emulator, emulation in zip(emulators, results):
        gap = SyncGap.default_for(emulator, args.sync_gap_s, args.sync_gap_power)
        layout = emulator.layout
        print()
        print(textwrap.fill(f"Power swing of the whole job, {layout.microbatches} microbatches, {layout.num_gpus:,} "
                            f"GPUs, {emulation.scenario.name}, gradient sync + optimizer step {gap.seconds:.3g} s "
                            f"at {gap.power_w:g} W per GPU:", 100))
        print(swing_table(job_swings(emulator, emulation, gap), markdown=args.markdown))
    print(swing_legend())


def _print_power_budget(emulators: list, args: argparse.Namespace, scenario: object) -> None:
    """The equal-average-power table, per job size; under the run's steady straggler if any."""
    from perseus_ext.emulator.power_budget import DEFAULT_FRACTIONS, PowerBudgetComparison, budget_table

    fractions = args.power_budget or list(DEFAULT_FRACTIONS)
    steady = getattr(scenario, "is_steady", False)
    factor = scenario.factors[0] if steady else 1.0  # type: ignore[attr-defined]
    for emulator in emulators:
        comparison = PowerBudgetComparison(emulator, factor)
        layout = emulator.layout
        print(
            f"\nThroughput at equal average power, {layout.microbatches} microbatches, "
            f"{layout.num_gpus:,} GPUs, T'/T = {factor:g} (all-max-clock: "
            f"{comparison.max_clock_power_w / 1e6:.3f} MW, samples/s and % of its throughput):"
        )
        print(budget_table(comparison, comparison.sweep(fractions), markdown=args.markdown))
