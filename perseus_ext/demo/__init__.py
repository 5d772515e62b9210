"""Side-by-side comparison jobs: the same DeepSpeed training under several perseus-ext variants
(disabled, observing at default clocks, optimising, with a failing GPU), launched with torchrun
on simulated GPUs, and the analysis of what each measured.

`perseus-ext demo` (perseus_ext/commands/demo.py) is one such job; the DeepSpeed end-to-end
tests run others through the same API:

    from perseus_ext import demo
    scenario = demo.Scenario(out_dir=..., stages=2, pipelines=2, variants=["observe", "perseus"])
    results = demo.launch(scenario)             # per rank, per variant
    table = demo.compare(scenario, results)     # windows, series, measured saving, model check
"""

from perseus_ext.demo.analysis import (
    by_variant,
    compare,
    job_series,
    measured_report,
    model_check,
    straggler_response,
    windows,
)
from perseus_ext.demo.launcher import launch
from perseus_ext.demo.report import plot, print_report
from perseus_ext.demo.scenario import VARIANTS, Scenario

__all__ = ["VARIANTS", "Scenario", "by_variant", "compare", "job_series", "launch", "measured_report",
           "model_check", "plot", "print_report", "straggler_response", "windows"]
