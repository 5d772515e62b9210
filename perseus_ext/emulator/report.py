"""Tables, CSV/JSON files and figures of emulation results."""

from __future__ import annotations

import csv
import json
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


def _mj(joules: float) -> str:
    return f"{joules / 1e6:.2f}"


def summary_table(emulations: Sequence[Emulation], markdown: bool = False) -> str:
    """The savings table: one row per (job size, scenario)."""
    headers = [
        "microbatches", "GPUs", "DP", "T'/T", "max-clock MJ/iter", "perseus MJ/iter",
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
            _mj(em.baseline.iteration.total),
            _mj(em.outcomes[PERSEUS].iteration.total),
            f"{_pct(zeus.saving)} ({zeus.note})",
            _pct(em.intrinsic_saving),
            _pct(em.extrinsic_saving),
            _pct(em.total_saving),
        ])
    return format_table(headers, rows, markdown)


def detail_table(emulation: Emulation, markdown: bool = False) -> str:
    """Every strategy of one emulation with its energy split (MJ per iteration, whole job)."""
    headers = [
        "strategy", "iter time (s)", "energy", "computation", "bubble", "sync wait",
        "straggler stall", "saving", "clocks",
    ]
    rows = []
    for key in STRATEGIES:
        out = emulation.outcomes[key]
        it = out.iteration
        rows.append([
            out.label, f"{it.time:.2f}", _mj(it.total), _mj(it.computation), _mj(it.bubble),
            _mj(it.sync_wait), _mj(it.straggler_stall), _pct(out.saving), out.note,
        ])
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
            row.append(f"{_pct(em.total_saving)} ({_pct(em.intrinsic_saving)} + "
                       f"{_pct(em.extrinsic_saving)})")
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
    from perseus_ext import plotting

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
    from perseus_ext import plotting

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
