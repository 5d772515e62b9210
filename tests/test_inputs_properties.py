"""Hypothesis: every reader of a user's file answers any content with a value or the project's
own error (one line naming the file), never another exception. The report's logs and frontier
files have theirs in test_inputs_report.py, saved profiles in test_faults_config.py."""

from __future__ import annotations

import argparse
import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from perseus_ext.adapters.megatron_args import add_perseus_args, config_from_args
from perseus_ext.emulator.scenario import StragglerScenario
from perseus_ext.errors import PerseusError
from perseus_ext.policies.carbon import CARBON, CSVCarbonTrace
from perseus_ext.policies.power_budget import POWER_BUDGET

SETTINGS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
CELLS = st.one_of(st.sampled_from(["1", "1.2", "0", "-1", "nan", "inf", "1e300", "1e-300", "", " ", "2024-05-01T01:00Z",
                                   "x", "\x00", '"', "1,5"]),
                  st.floats().map(repr), st.integers(-10 ** 20, 10 ** 20).map(str), st.text(max_size=5))
LINES = st.lists(st.lists(CELLS, max_size=3).map(",".join), max_size=6)


def _csv(header: str, lines: list[str], noise: bytes, at: float) -> bytes:
    body = "\n".join([header, *lines]).encode("utf-8", "surrogatepass")
    position = int(len(body) * at)
    return body[:position] + noise + body[position:]


def _one_line(err: Exception) -> None:
    assert "\n" not in str(err), str(err)


@SETTINGS
@given(header=st.sampled_from(["slowdown", "iteration,slowdown", "", "1.5", "a,b"]), lines=LINES,
       noise=st.binary(max_size=8), at=st.floats(0, 1))
def test_any_slowdown_trace_gives_a_scenario_or_our_error(tmp_path, header, lines, noise, at):
    path = tmp_path / "trace.csv"
    path.write_bytes(_csv(header, lines, noise, at))
    try:
        scenario = StragglerScenario.from_trace(path)
    except PerseusError as err:
        _one_line(err)
    else:
        assert all(1.0 <= f <= 100.0 for f in scenario.factors) and abs(sum(scenario.weights) - 1) < 1e-9


@SETTINGS
@given(header=st.sampled_from(["timestamp,carbon_intensity", "time,budget_w", "datetime,intensity,x", "", "a"]),
       lines=LINES, noise=st.binary(max_size=8), at=st.floats(0, 1), budget=st.booleans())
def test_any_signal_trace_gives_a_trace_or_our_error(tmp_path, header, lines, noise, at, budget):
    path = tmp_path / "signal.csv"
    path.write_bytes(_csv(header, lines, noise, at))
    try:
        trace = CSVCarbonTrace(path, quantity=POWER_BUDGET if budget else CARBON)
    except PerseusError as err:
        _one_line(err)
    else:
        assert trace.intensity(0.0) is not None and trace.max_intensity <= 1e12


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70) | st.floats() | st.text(max_size=6),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children, max_size=3),
    max_leaves=8)
KEYS = st.sampled_from(["warmup_iterations", "mode", "gpu", "policy", "perseus", "log_path", "solver", "x"])


@SETTINGS
@given(document=st.one_of(st.binary(max_size=40), st.dictionaries(KEYS, JSON_VALUES, max_size=4).map(
    lambda d: json.dumps(d).encode())), depth=st.integers(0, 40))
def test_any_perseus_config_file_gives_a_config_or_our_error(tmp_path, document, depth):
    path = tmp_path / "perseus.json"
    path.write_bytes(b'{"perseus": ' * depth + document + b"}" * depth)
    try:  # the parser may validate the section itself (and then config_from_args reads it back)
        config_from_args(add_perseus_args(argparse.ArgumentParser(exit_on_error=False)).parse_args(
            ["--perseus", "--perseus-config", str(path)]))
    except PerseusError as err:
        assert "--perseus-config" in str(err)
