"""Tables, CSV/JSON files and figures of emulation results."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Sequence

import numpy as np

from perseus_ext.emulator.core import (
    ENVPIPE,
    GLOBAL_CLOCK,
    INTRINSIC,
    MAX_CLOCK,
    PERSEUS,
    PERSEUS_DETECTED,
    PERSEUS_T_STAR,
    STRATEGIES,
    Emulation,
    Emulator,
)
from perseus_ext.planning.derived import DerivationRule

# Total savings the Perseus paper (SOSP'24) reports for its emulation, per (profile file stem,
# microbatches): {T'/T: saving}. Only the figures its text states; the sweep shows "-" elsewhere.
PAPER_SAVINGS: dict[tuple[str, int], dict[float, float]] = {
    ("gpt3-175b-a100_sxm", 96): {1.2: 0.270},
}
COMPARED = (GLOBAL_CLOCK, ENVPIPE, PERSEUS_T_STAR, PERSEUS_DETECTED, PERSEUS)


def paper_savings(profile_stem: str, microbatches: int) -> dict[float, float]:
    """The paper's reported total savings for this profile and job size (often none)."""
    return PAPER_SAVINGS.get((profile_stem, microbatches), {})


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]], markdown: bool = False) -> str:
    """Right-aligned text table, or a GitHub markdown table."""
    cells = [[str(c) for c in row] for row in rows]
    if markdown:
        lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---:" for _ in headers) + "|"]
        lines += ["| " + " | ".join(row) + " |" for row in cells]
        return "\n".join(lines)
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(headers, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def job_shape(layout: object) -> str:
    """'DP 4 x TP 8 x PP 8 = 256 GPUs': the job's shape, data parallelism first."""
    return (f"DP {layout.data_parallel} x TP {layout.tensor_parallel} x PP {layout.pipeline_parallel} = "
            f"{layout.num_gpus:,} GPUs")


def _extrinsic(em: Emulation) -> str:
    """The extrinsic saving, only where another pipeline can be slowed to the straggler's pace."""
    return _pct(em.extrinsic_saving) if em.layout.data_parallel > 1 else "n/a (DP 1)"


def summary_table(emulations: Sequence[Emulation], markdown: bool = False) -> str:
    """The savings table: one row per (job size, scenario)."""
    unit, scale = _unit(max(em.baseline.iteration.total for em in emulations))
    headers = [
        "microbatches", "GPUs", "DP", "T'/T", f"max-clock {unit}/iter", f"perseus {unit}/iter",
        "Zeus global clock", "intrinsic", "extrinsic", "total saving",
    ]
    rows = []
    for em in emulations:
        zeus = em.outcomes[GLOBAL_CLOCK]
        rows.append([
            em.layout.microbatches,
            f"{em.layout.num_gpus:,}",
            em.layout.data_parallel,
            em.scenario.factors[0] if em.scenario.is_steady else em.scenario.name,
            f"{em.baseline.iteration.total / scale:.3g}",
            f"{em.outcomes[PERSEUS].iteration.total / scale:.3g}",
            f"{_pct(zeus.saving)} ({zeus.note})",
            _pct(em.intrinsic_saving),
            _extrinsic(em),
            _pct(em.total_saving),
        ])
    return format_table(headers, rows, markdown)


def _unit(joules: float) -> tuple[str, float]:
    """MJ, kJ or J: the largest that keeps `joules` at 1 or more (a small job's energy would
    otherwise print as 0.01 MJ in every cell)."""
    for unit, scale in (("MJ", 1e6), ("kJ", 1e3)):
        if joules >= scale:
            return unit, scale
    return "J", 1.0


def energy_unit(emulation: Emulation) -> str:
    """The unit `detail_table` prints this emulation's energies in."""
    return _unit(emulation.baseline.iteration.total)[0]


def detail_table(emulation: Emulation, markdown: bool = False) -> str:
    """Every strategy of one emulation with its energy split (per iteration, whole job, in
    `energy_unit`)."""
    unit, scale = _unit(emulation.baseline.iteration.total)
    # four significant digits of the largest figure; every cell with as many decimals
    decimals = max(0, 3 - int(math.floor(math.log10(max(emulation.baseline.iteration.total / scale, 1.0)))))
    headers = [
        "strategy", "iter time (s)", f"energy ({unit})", "computation", "bubble", "sync wait",
        "straggler stall", "saving", "clocks",
    ]
    rows = []
    for key in STRATEGIES:
        out = emulation.outcomes[key]
        it = out.iteration
        rows.append([out.label, f"{it.time:.2f}",
                     *(f"{value / scale:.{decimals}f}" for value in
                       (it.total, it.computation, it.bubble, it.sync_wait, it.straggler_stall)),
                     _pct(out.saving), out.note])
    return format_table(headers, rows, markdown)


def sweep_table(sweeps: dict[int, Sequence[Emulation]], markdown: bool = False) -> str:
    """Total saving (intrinsic + extrinsic) per slowdown factor (rows) and job size (columns)."""
    sizes = sorted(sweeps)
    headers = ["T'/T"] + [
        f"{m} mb / {sweeps[m][0].layout.num_gpus:,} GPUs" for m in sizes
    ]
    factors = [em.scenario.factors[0] for em in sweeps[sizes[0]]]
    rows = []
    for i, factor in enumerate(factors):
        row: list[object] = [f"{factor:.2f}"]
        for m in sizes:
            em = sweeps[m][i]
            row.append(f"{_pct(em.total_saving)} ({_pct(em.intrinsic_saving)} + {_pct(em.extrinsic_saving)})"
                       if em.layout.data_parallel > 1 else f"{_pct(em.total_saving)} (intrinsic {_pct(em.intrinsic_saving)})")
        rows.append(row)
    return format_table(headers, rows, markdown)


def comparison_table(
    sweeps: dict[int, Sequence[Emulation]], profile_stem: str = "", markdown: bool = False
) -> str:
    """Total saving per (job size, T'/T) of every compared strategy, the paper's figure where it
    reports one, and perseus-ext's margin over the best of one global clock and EnvPipe-style."""
    headers = ["microbatches", "T'/T", *(STRATEGY_SHORT[k] for k in COMPARED), "paper", "margin"]
    rows = []
    for m in sorted(sweeps):
        paper = paper_savings(profile_stem, m)
        for em in sweeps[m]:
            factor = em.scenario.factors[0]
            baseline = max(em.outcomes[GLOBAL_CLOCK].saving, em.outcomes[ENVPIPE].saving)
            reported = next((v for f, v in paper.items() if abs(f - factor) < 1e-9), None)
            rows.append([
                m, f"{factor:.2f}", *(f"{100 * em.outcomes[k].saving:.2f}%" for k in COMPARED),
                "-" if reported is None else _pct(reported),
                f"{100 * (em.total_saving - baseline):+.2f} pt",
            ])
    return format_table(headers, rows, markdown)


STRATEGY_SHORT = {
    GLOBAL_CLOCK: "global clock",
    ENVPIPE: "EnvPipe-style",
    PERSEUS_T_STAR: "perseus T*",
    PERSEUS_DETECTED: "perseus detected",
    PERSEUS: "perseus-ext",
}


STRATEGY_MEANINGS = (
    ("all GPUs at max clock", "the baseline every saving is measured against"),
    ("global clock / Zeus-style global clock", "one clock for every GPU, the least-energy one that keeps the "
     "iteration as fast as at max clock"),
    ("EnvPipe-style", "the bottleneck stage at max clock, every other stage at one lower clock"),
    ("perseus-ext intrinsic only", "every pipeline at its fastest plan, no straggler information"),
    ("perseus T* / perseus-ext stopping at T*", "non-stragglers slowed towards the straggler's time T', but "
     "never past the least-energy plan T* (the published Perseus policy, without wait-aware plans)"),
    ("perseus detected / perseus-ext, straggler at fastest plan", "non-stragglers planned for T' (wait-aware), "
     "the straggler itself left at its fastest plan"),
    ("perseus-ext / perseus-ext intrinsic + extrinsic", "every pipeline plans for T', wait-aware, the straggler "
     "included (what the runtime does)"),
)


def derivation_note(kinds: Sequence[str], rule: DerivationRule, profile_name: str) -> str:
    """Which computation kinds the emulation estimated rather than read from the profile, and
    by what rule (`planning.derived`), for the legend: a figure that rests on a model must say
    so next to it."""
    s, o = rule.input_gradient_share, rule.overlap_share
    formulas = {
        "input_gradient": f"input_gradient = {s:g} x backward",
        "weight_gradient": f"weight_gradient = {1 - s:g} x backward",
        "combined": (f"combined = forward + backward - {o:g} x min(forward, backward) in time, "
                     f"forward + backward in energy"),
    }
    rules = "; ".join(formulas[k] for k in ("input_gradient", "weight_gradient", "combined") if k in kinds)
    return (f"{profile_name} has no {', '.join(kinds)} rows; they are derived from each stage's "
            f"forward/backward rows, clock by clock (planning.derived, a model, not a measurement): {rules}"
            f"{' (time and energy)' if 'combined' not in kinds else ''}")


def legend(kind: str, *, one_pipeline: bool = False, derivation: str | None = None) -> str:
    """What every column of a table (`kind`: detail, summary, sweep, comparison) means, printed
    under it: the names are short, and a reader should not have to look them up. `derivation`
    (`derivation_note`): the computation kinds the figures estimate, and how."""
    import textwrap

    columns = {
        "detail": [("iter time (s)", "the job's iteration time (the slowest pipeline)"),
                   ("energy", "the whole job per iteration = computation + bubble + sync wait + straggler stall"),
                   ("computation", "forwards and backwards at their clocks"),
                   ("bubble", "GPUs blocked inside their own pipeline's iteration (fill, drain, neighbours)"),
                   ("sync wait", "GPUs of pipelines done early, blocked at the gradient sync"),
                   ("straggler stall", "the straggler's GPUs idle for its external slowdown"),
                   ("saving", "1 - energy / the max-clock energy"),
                   ("clocks", "the one clock, or the policy that chose the plans")],
        "summary": [("T'/T", "the straggler pipeline's slowdown"),
                    ("max-clock, perseus .../iter", "the whole job's energy per iteration, all GPUs at max "
                                                    "clock and with perseus-ext"),
                    ("Zeus global clock", "one clock for every GPU, the least-energy one that keeps the iteration "
                                          "as fast as at max clock: its saving (the clock)"),
                    ("intrinsic", "saving of the fastest plan, no straggler information"),
                    ("extrinsic", "further saving from slowing the other pipelines to the straggler's pace; "
                                  "n/a with one pipeline (DP 1)"),
                    ("total saving", "perseus-ext (intrinsic + extrinsic) vs all GPUs at max clock")],
        "sweep": [("cells", "total saving (intrinsic + extrinsic) vs all GPUs at max clock; with one "
                            "pipeline (DP 1) there is no other pipeline to slow, so no extrinsic part")],
        "comparison": [("paper", "the Perseus paper's figure where it reports one"),
                       ("margin", "perseus-ext minus the better of the global clock and EnvPipe-style")],
    }[kind]
    if kind in ("detail", "comparison"):
        columns = [(name, meaning) for name, meaning in STRATEGY_MEANINGS] + columns
    if one_pipeline:
        columns.append(("DP 1", "one pipeline (no --global-batch, or one pipeline's worth): a slowdown can "
                                "only be filled by the slowed pipeline itself"))
    if derivation:
        columns.append(("estimated kinds", derivation))
    lines = []
    for name, meaning in columns:
        lines += textwrap.wrap(f"{name}: {meaning}", 100, initial_indent="  ", subsequent_indent="      ")
    return "\n".join(lines)


def records(emulations: Sequence[Emulation]) -> list[dict]:
    return [row for em in emulations for row in em.rows()]


def write_records(emulations: Sequence[Emulation], path: str | Path) -> None:
    """One row per (emulation, strategy); the format follows the suffix (.csv or .json)."""
    path = Path(path)
    rows = records(emulations)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix.lower() == ".json":
        path.write_text(json.dumps(rows, indent=1))
        return
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def plot_emulation(emulator: Emulator, emulation: Emulation, directory: str | Path, fmt: str = "png") -> list[Path]:
    """Frontier with the deployed plans marked, and the non-straggler pipeline's timeline
    before (max clock) and after (perseus-ext), for a steady-straggler emulation."""
    from perseus_ext.observability import plotting

    directory = Path(directory)
    layout = emulation.layout
    stem = f"{layout.microbatches}mb_{layout.num_gpus}gpus"
    factor = emulation.scenario.factors[0]
    deployed = emulation.outcomes[PERSEUS].deployments[0]
    zeus = emulation.outcomes[GLOBAL_CLOCK].deployments[0].others
    marks = {}
    max_clock = emulator.max_clock_plan
    if not np.array_equal(max_clock.frequencies, emulation.frontier.baseline.frequencies):
        # Some top clocks were dominated (a lower clock is faster): the frontier's baseline
        # uses the fastest clocks, the GPUs' default is the top one.
        marks[f"all GPUs at {emulation.outcomes[MAX_CLOCK].note}"] = max_clock
    if factor > 1.0:
        marks[f"deployed on non-stragglers at T'/T={factor:g}"] = deployed.others
    marks[f"Zeus-style global clock ({emulation.outcomes[GLOBAL_CLOCK].note})"] = zeus
    frontier_path = directory / f"frontier_{stem}.{fmt}"
    plotting.plot_frontier(
        emulation.frontier, frontier_path, marks=marks,
        title=f"One pipeline of {layout.num_gpus:,} GPUs (TP{layout.tensor_parallel} x "
              f"PP{layout.pipeline_parallel}, {layout.microbatches} microbatches)",
    )
    timeline_path = directory / f"timeline_{stem}.{fmt}"
    before = emulation.outcomes[MAX_CLOCK].deployments[0].others
    straggler_time = emulator.straggler_time(factor)
    plotting.plot_timeline(
        emulator.model,
        {"before: all GPUs at max clock": before, "after: perseus-ext": deployed.others},
        timeline_path,
        title=f"Non-straggler pipeline, {layout.microbatches} microbatches, T'/T = {factor:g}",
        slowdowns=None if straggler_time is None else [straggler_time, straggler_time],
    )
    return [frontier_path, timeline_path]


def plot_sweep(
    sweeps: dict[int, Sequence[Emulation]], path: str | Path, title: str | None = None,
    profile_stem: str = "",
) -> Path:
    """Savings vs slowdown: perseus-ext total per job size; for the first job size also its
    intrinsic-only saving, the Zeus-style global clock, the EnvPipe-style baseline, perseus-ext
    stopping at T*, and the paper's figures where it reports them."""
    from perseus_ext.observability import plotting

    sizes = sorted(sweeps)
    factors = [em.scenario.factors[0] for em in sweeps[sizes[0]]]
    series: dict[str, list[float]] = {}
    for m in sizes:
        gpus = sweeps[m][0].layout.num_gpus
        series[f"perseus-ext, {m} microbatches ({gpus:,} GPUs)"] = [em.total_saving for em in sweeps[m]]
    first = sweeps[sizes[0]]
    gpus = first[0].layout.num_gpus
    for key, label in ((INTRINSIC, "perseus-ext intrinsic only"), (PERSEUS_T_STAR, "perseus-ext stopping at T*"),
                       (GLOBAL_CLOCK, "Zeus-style global clock"), (ENVPIPE, "EnvPipe-style")):
        series[f"{label} ({gpus:,} GPUs)"] = [em.outcomes[key].saving for em in first]
    for m in sizes:
        paper = paper_savings(profile_stem, m)
        if paper:
            series[f"paper, {m} microbatches"] = [
                next((v for f, v in paper.items() if abs(f - x) < 1e-9), float("nan")) for x in factors
            ]
    plotting.plot_savings(factors, series, path, title=title)
    return Path(path)
