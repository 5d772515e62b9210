"""`perseus-ext emulate`'s output says what it emulated and what its columns mean: the job's
shape (DP, TP, PP), extrinsic saving only where another pipeline can be slowed, a legend under
every table, figures whose series are all visible; `--output` and `--chunks` refused clearly."""

from __future__ import annotations

import csv
import json

import pytest

from perseus_ext.observability import plotting
from perseus_ext.cli import main

PROFILE = ["--profile", "gpt3-175b-a100_sxm"]


def test_one_pipeline_states_its_shape_and_shows_no_extrinsic_saving(capsys):
    assert main(["emulate", *PROFILE, "--microbatches", "16", "--slowdown", "1.2"]) == 0
    out = capsys.readouterr().out
    assert "job shape, 16 microbatches: DP 1 x TP 1 x PP 8 = 8 GPUs (one pipeline: give --global-batch" in out
    summary = out[out.index("Savings vs all GPUs at max clock"):].splitlines()
    row = summary[3]
    assert "extrinsic" in summary[1] and "n/a (DP 1)" in row
    assert any(line.strip().startswith("DP 1: one pipeline") for line in summary)
    # the detail table's energies in a unit that shows them (8 GPUs: kJ, not 0.01 MJ)
    assert "(energy in kJ per iteration, whole job)" in out
    max_clock = next(line for line in out.splitlines() if line.strip().startswith("all GPUs at max clock"))
    assert float(max_clock.split("clock")[1].split()[1]) > 1.0  # the energy cell


def test_data_parallel_jobs_show_extrinsic_and_every_column_is_explained(capsys):
    assert main(["emulate", *PROFILE, "--tp", "8", "--global-batch", "64", "--microbatches", "16",
                 "--slowdown", "1.2"]) == 0
    out = capsys.readouterr().out
    assert "DP 4 x TP 8 x PP 8 = 256 GPUs" in out
    summary = out[out.index("Savings vs all GPUs at max clock"):].splitlines()
    cells = summary[3].split()
    assert "n/a" not in summary[3] and cells[-2].endswith("%") and cells[-1].endswith("%")
    legend = " ".join(line.strip() for line in out.splitlines() if line.startswith("  "))
    for column in ("iter time (s)", "computation", "bubble", "sync wait", "straggler stall", "clocks",
                   "intrinsic", "extrinsic", "total saving", "Zeus global clock"):
        assert f"{column}:" in legend, column


def test_the_sweep_explains_perseus_t_star_and_detected(capsys, tmp_path, monkeypatch):
    drawn = []
    monkeypatch.setattr(plotting, "_save", lambda figure, path: drawn.append(figure))
    assert main(["emulate", *PROFILE, "--microbatches", "16", "--sweep", "1.0", "1.2", "1.5",
                 "--plot-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    legend = " ".join(line.strip() for line in out.splitlines() if line.startswith("  "))
    assert "perseus T* / perseus-ext stopping at T*:" in legend and "perseus detected /" in legend
    assert "margin: perseus-ext minus the better of" in legend
    axis = drawn[0].axes[0]
    labels = [text.get_text() for text in axis.get_legend().get_texts()]
    assert len(axis.get_lines()) == len(labels)  # every legend entry is a line of its own
    series = [part for label in labels for part in label.split(" = ")]
    assert len(series) == 5  # perseus-ext, intrinsic only, stopping at T*, global clock, EnvPipe-style


@pytest.mark.parametrize("name", ["x.xlsx", "x", "x.parquet"])
def test_an_output_of_another_format_is_one_error_line(name, tmp_path, capsys):
    target = tmp_path / name
    assert main(["emulate", *PROFILE, "--microbatches", "8", "--output", str(target)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"perseus-ext emulate: error: --output {target}:")
    assert "end the file name in .csv or .json" in err[0]
    assert not target.exists()


def test_csv_and_json_outputs_hold_every_strategy(tmp_path, capsys):
    assert main(["emulate", *PROFILE, "--microbatches", "8", "--output", str(tmp_path / "r.csv")]) == 0
    assert main(["emulate", *PROFILE, "--microbatches", "8", "--output", str(tmp_path / "r.JSON")]) == 0
    with open(tmp_path / "r.csv", newline="") as handle:
        from_csv = list(csv.DictReader(handle))
    from_json = json.loads((tmp_path / "r.JSON").read_text())
    assert len(from_csv) == len(from_json) == 7
    assert [row["strategy"] for row in from_csv] == [row["strategy"] for row in from_json]


def test_chunks_that_do_not_fit_the_profile_name_chunks(capsys):
    assert main(["emulate", *PROFILE, "--microbatches", "8", "--schedule", "interleaved", "--chunks", "3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--chunks 3 x --pp 2 = 6 virtual stages" in err[0]
    assert "give --chunks dividing 8 (1, 2, 4, 8)" in err[0]
