"""The typed `perseus` section: every key's good and bad values, nested key paths in messages,
valid examples in every message, door checks of paths and saved profiles, generated docs, and
property tests (arbitrary JSON never raises anything but ConfigError)."""

from __future__ import annotations

import dataclasses
import json
import re
import tracemalloc
from pathlib import Path
from typing import Annotated, Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import TypeAdapter

from perseus_ext.config import Mode, NvmlSpec, PerseusConfig, SimulatedWorkload, parse_gpu_spec
from perseus_ext.config.key_table import key_table_markdown
from perseus_ext.config.perseus import solver_bounds
from perseus_ext.config.policy import CarbonSourceKind, PolicyMode, PolicySection, PolicyType
from perseus_ext.config.rules import Section, dataclass_section, field_rule
from perseus_ext.config.sections import profile_sidecar
from perseus_ext.errors import ConfigError, SolverError
from perseus_ext.planning.solver import SolverOptions

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = re.compile(r"^(?P<key>perseus[\w.\[\]]*) (must be|uses|formats|is not a valid) .*; e\.g\. (?P<example>.+)$")


def error_of(section: Any) -> str:
    with pytest.raises(ConfigError) as caught:
        PerseusConfig.from_dict(section)
    return str(caught.value)


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    """Relative output paths land in a fresh writable directory; sections that give a
    simulated_workload run on the simulated GPU of env PERSEUS_GPU (the key left null)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PERSEUS_GPU", "sim:a100_sxm")


# --------------------------------------------------------------------------- defaults, round trip
def test_defaults_and_round_trip():
    assert PerseusConfig.from_dict(None) == PerseusConfig.from_dict({}) == PerseusConfig()
    default = PerseusConfig()
    assert default.enabled is False and default.mode == "optimize" and default.mode is Mode.OPTIMIZE
    assert default.policy is None and default.solver is None and default.control_timeout_s == 1800.0
    config = PerseusConfig.from_dict({
        "enabled": True,
        "mode": "observe",
        "candidate_clocks": [1200, 1410],
        "communication_clock": "min",
        "solver": {"min_grid_points": 300, "resolution": 0.002},
        "policy": {"type": "chase", "eta": 0.3, "carbon": {"callback": "time:time", "max_carbon": 500}},
        "simulated_workload": {"forward_seconds": 0.01, "backward_seconds": [0.02, 0.03]},
        "log_path": "logs/perseus-{rank}.jsonl",
    })
    assert config.candidate_clocks == (1410, 1200)  # fastest first
    assert config.mode == "observe"
    assert isinstance(config.solver, SolverOptions) and config.solver.min_grid_points == 300
    assert config.solver.anchors == SolverOptions().anchors
    assert isinstance(config.policy, PolicySection) and config.policy.type is PolicyType.CHASE
    assert config.policy.carbon_source is CarbonSourceKind.CALLBACK
    assert config.simulated_workload.seconds(1, "backward") == 0.03
    assert config.simulated_workload.seconds(1, "forward") == 0.01
    dumped = config.to_dict()
    assert json.loads(json.dumps(dumped))["policy"]["type"] == "chase"
    assert PerseusConfig.from_dict(dumped) == config
    assert PerseusConfig.from_dict(json.loads(json.dumps(dumped))) == config


def test_typed_sub_sections_are_accepted_as_built():
    policy = PolicySection.parse({"type": "zeus", "mode": "power_limit"})
    config = PerseusConfig.from_dict({"policy": policy, "solver": SolverOptions(min_grid_points=40)})
    assert config.policy is policy and config.policy.mode is PolicyMode.POWER_LIMIT
    assert config.solver.min_grid_points == 40
    # a SolverOptions cannot even be built outside the bounds the door applies to a dict
    with pytest.raises(SolverError, match="min_grid_points"):
        SolverOptions(min_grid_points=-5)
    assert "perseus.solver.min_grid_points" in error_of({"solver": {"min_grid_points": -5}})


def test_simulated_workload_checks_its_stage_count():
    workload = SimulatedWorkload.model_validate({"forward_seconds": [0.1, 0.2], "backward_seconds": 0.3})
    workload.check_stages(2)
    with pytest.raises(ConfigError, match=r"perseus.simulated_workload.forward_seconds has 2 entries .* 3 stages"):
        workload.check_stages(3)


# --------------------------------------------------------------------------- every key: good values
GOOD = [
    ("enabled", True, True),
    ("mode", "observe", Mode.OBSERVE),
    ("gpu", "sim:a40?slowdown=1.2", parse_gpu_spec("sim:a40?slowdown=1.2")),
    ("gpu", "nvml", NvmlSpec()),
    ("seed", 7, 7),
    ("dry_run", False, False),
    ("strict", True, True),
    ("warmup_iterations", 0, 0),
    ("profiling_iterations_per_clock", 3, 3),
    ("candidate_clocks", (990, 1410), (1410, 990)),
    ("clock_stride", 6, 6),
    ("early_stop", False, False),
    ("early_stop_patience", 1, 1),
    ("blocking_power_w", 83, 83.0),
    ("profile_path", "profiles/new.csv", "profiles/new.csv"),
    ("frontier_path", "out/frontier.json", "out/frontier.json"),
    ("solve_in_background", False, False),
    ("solver", {"progress": True}, SolverOptions(progress=True)),
    ("control_timeout_s", 1, 1.0),
    ("control_timeout_s", 7 * 24 * 3600, 604800.0),
    ("straggler_check_interval", 1, 1),
    ("straggler_threshold", 0.5, 0.5),
    ("straggler_hysteresis", 0, 0.0),
    ("straggler_confirmations", 1, 1),
    ("communication_clock", 705, 705),
    ("communication_clock", None, None),
    ("log_interval", 0, 0),
    ("log_path", "run/{rank:03d}.jsonl", "run/{rank:03d}.jsonl"),
    ("log_path", "run/{{literal}}-{rank}.jsonl", "run/{{literal}}-{rank}.jsonl"),
    ("summary_path", "summary.json", "summary.json"),
]


@pytest.mark.parametrize("key, value, expected", GOOD, ids=[f"{k}={v!r}" for k, v, _ in GOOD])
def test_good_values(key, value, expected):
    assert getattr(PerseusConfig.from_dict({key: value}), key) == expected


# --------------------------------------------------------------------------- every key: bad values
BAD = [
    ({"enabled": "yes"}, "perseus.enabled must be true or false, got \"yes\""),
    ({"enabled": 1}, "perseus.enabled must be true or false"),
    ({"mode": "turbo"}, 'perseus.mode must be one of "optimize", "observe", got "turbo"'),
    ({"gpu": "cuda:0"}, "perseus.gpu \"cuda:0\" is not understood; use 'nvml', 'zeusd' or 'sim:<preset>'"),
    ({"gpu": "sim:a40?slowdown=0"}, "perseus.gpu \"sim:a40?slowdown=0\": slowdown=0.0: input should be greater than 0"),
    ({"gpu": "sim:a4?pace=0"}, "perseus.gpu \"sim:a4?pace=0\": unknown simulated preset 'a4' (did you mean \"a40\"?)"),
    ({"gpu": 3}, "perseus.gpu must be"),
    ({"seed": -1}, "perseus.seed must be an integer >= 0, got -1"),
    ({"seed": "1"}, "perseus.seed must be an integer >= 0"),
    ({"dry_run": "auto"}, "perseus.dry_run must be true or false"),
    ({"strict": None}, "perseus.strict must be true or false, got null"),
    ({"warmup_iterations": 1.5}, "perseus.warmup_iterations must be an integer >= 0, got 1.5"),
    ({"warmup_iterations": True}, "perseus.warmup_iterations must be an integer >= 0, got true"),
    ({"profiling_iterations_per_clock": 0}, "perseus.profiling_iterations_per_clock must be an integer >= 1"),
    ({"candidate_clocks": [1410, "fast"]}, "perseus.candidate_clocks[1] must be a clock in MHz >= 1"),
    ({"candidate_clocks": [1410, 0]}, "perseus.candidate_clocks[1] must be a clock in MHz >= 1, got 0"),
    ({"candidate_clocks": [1410, 1410]}, "perseus.candidate_clocks must be a non-empty list of distinct clocks"),
    ({"candidate_clocks": []}, "perseus.candidate_clocks must be a non-empty list"),
    ({"candidate_clocks": 1410}, "perseus.candidate_clocks must be a non-empty list"),
    ({"clock_stride": 0}, "perseus.clock_stride must be an integer >= 1"),
    ({"early_stop": "no"}, "perseus.early_stop must be true or false"),
    ({"early_stop_patience": -2}, "perseus.early_stop_patience must be an integer >= 1"),
    ({"blocking_power_w": -3}, "perseus.blocking_power_w must be a positive number of watts, got -3"),
    ({"blocking_power_w": float("inf")}, "perseus.blocking_power_w must be a positive number of watts"),
    ({"profile_path": ""}, "perseus.profile_path must be a non-empty path"),
    ({"profile_path": "/etc/hostname/p.csv"}, "perseus.profile_path \"/etc/hostname/p.csv\" cannot be created"),
    ({"frontier_path": "."}, "perseus.frontier_path \".\" is a directory"),
    ({"profile_path": "a\u0000b.csv"}, "perseus.profile_path \"a\\u0000b.csv\" is not a usable path"),
    ({"solve_in_background": 0}, "perseus.solve_in_background must be true or false"),
    ({"solver": [300]}, "perseus.solver must be an object"),
    ({"solver": {"min_grid_points": -5}}, "perseus.solver.min_grid_points must be an integer in [2, 20000], got -5"),
    ({"solver": {"resolution": 0}}, "perseus.solver.resolution must be a number in [1e-06, 10]"),
    ({"solver": {"grid_oversampling": 1000}}, "perseus.solver.grid_oversampling must be an integer in [1, 16]"),
    ({"solver": {"anchors": 1}}, "perseus.solver.anchors must be an integer in [2, 4096]"),
    ({"solver": {"anchor_budget": -1}}, "perseus.solver.anchor_budget must be an integer in [0, 1000000]"),
    ({"solver": {"max_memory_gib": 1e6}}, "perseus.solver.max_memory_gib must be a number in [0.1, 1024]"),
    ({"solver": {"polish_budget": -1}}, "perseus.solver.polish_budget must be an integer in [0, 1000000000000]"),
    ({"solver": {"progress": "yes"}}, "perseus.solver.progress must be true or false"),
    ({"solver": {"min_grid_point": 5}},
     "unknown key(s) perseus.solver.min_grid_point (did you mean perseus.solver.min_grid_points?); known keys: "
     "anchor_budget"),
    ({"control_timeout_s": 1e15}, "perseus.control_timeout_s must be a number of seconds in [1, 604800], got 1000000000000000.0"),
    ({"control_timeout_s": 0.001}, "perseus.control_timeout_s must be a number of seconds in [1, 604800], got 0.001"),
    ({"straggler_check_interval": 0}, "perseus.straggler_check_interval must be an integer >= 1"),
    ({"straggler_threshold": 0}, "perseus.straggler_threshold must be a number in (0, 1), got 0"),
    ({"straggler_threshold": 1}, "perseus.straggler_threshold must be a number in (0, 1)"),
    ({"straggler_hysteresis": -0.1}, "perseus.straggler_hysteresis must be a number in [0, 1)"),
    ({"straggler_threshold": 0.02, "straggler_hysteresis": 0.05},
     "perseus.straggler_hysteresis (0.05) must be smaller than perseus.straggler_threshold (0.02)"),
    ({"straggler_confirmations": 0}, "perseus.straggler_confirmations must be an integer >= 1"),
    ({"communication_clock": "max"}, 'perseus.communication_clock must be null, "min" or a clock in MHz'),
    ({"communication_clock": 0}, "perseus.communication_clock must be null"),
    ({"communication_clock": True}, "perseus.communication_clock must be null"),
    ({"log_interval": -1}, "perseus.log_interval must be an integer >= 0"),
    ({"log_path": "logs/{rnk}.jsonl"}, "perseus.log_path uses {rnk}"),
    ({"log_path": "logs/{}.jsonl"}, "perseus.log_path uses {}"),
    ({"log_path": "logs/{rank.real}.jsonl"}, "perseus.log_path uses {rank.real}"),
    ({"log_path": "logs/{rank.jsonl"}, "perseus.log_path is not a valid template"),
    ({"log_path": "logs/{rank:99999}.jsonl"}, "perseus.log_path formats {rank} in an unsupported way"),
    ({"log_path": "/etc/hostname/{rank}.jsonl"}, "perseus.log_path \"/etc/hostname/0.jsonl\" (rank 0) cannot be created"),
    ({"summary_path": "{job}/s.json"}, "perseus.summary_path uses {job}"),
    ({"summary_path": "/etc/hostname/s.json"}, "perseus.summary_path \"/etc/hostname/s.json\" cannot be created"),
    ({"simulated_workload": 0.1}, "perseus.simulated_workload must be an object"),
    ({"simulated_workload": {"forward_seconds": 0.01}}, "perseus.simulated_workload.backward_seconds is required"),
    ({"simulated_workload": {"forward_seconds": 0.01, "backward_seconds": [0.02, 0]}},
     "perseus.simulated_workload.backward_seconds[1] must be a number of seconds in (0, 3600], got 0"),
    ({"simulated_workload": {"forward_seconds": 1e9, "backward_seconds": 1}},
     "perseus.simulated_workload.forward_seconds must be a number of seconds in (0, 3600]"),
    ({"simulated_workload": {"forward_seconds": [], "backward_seconds": 1}},
     "perseus.simulated_workload.forward_seconds must be a non-empty list"),
    ({"simulated_workload": {"forward_seconds": 1, "backward_seconds": 1, "step": 2}},
     "unknown key(s) perseus.simulated_workload.step; known keys: backward_seconds, forward_seconds"),
    ({"policy": "zeus"}, "perseus.policy must be an object, got \"zeus\"; e.g. {\"type\": \"zeus\", \"eta\": 0.5}"),
    ({"policy": {"name": "perseus"}}, "unknown key(s) perseus.policy.name; known keys: batch_size, budget, carbon, eta"),
    ({"policy": {"type": "greedy"}}, 'perseus.policy.type must be one of "perseus", "zeus", "chase"'),
    ({"policy": {"type": "zeus", "eta": 1.5}}, "perseus.policy.eta must be in [0, 1], got 1.5"),
    ({"policy": {"type": "zeus", "period_s": 0}}, "perseus.policy.period_s must be a positive number of seconds"),
    ({"policy": {"type": "zeus", "power_limit": {"profile_iters": 0}}},
     "perseus.policy.power_limit.profile_iters must be an integer >= 1, got 0"),
    ({"policy": {"type": "zeus", "power_limit": {"limits_w": [300, -1]}}},
     "perseus.policy.power_limit.limits_w[1] must be a positive number of watts"),
    ({"policy": {"type": "chase", "carbon": {"url": "ftp://x"}}}, "perseus.policy.carbon.url must be an http(s) URL"),
    ({"policy": {"type": "chase", "carbon": {"url": "http://[::1"}}}, "perseus.policy.carbon.url must be an http(s) URL"),
    ({"policy": {"type": "chase", "carbon": {"csv": "a.csv", "align": "noon"}}},
     'perseus.policy.carbon.align must be one of "start", "clock"'),
    ({"policy": {"type": "chase", "carbon": {"callback": "math:nope"}}}, "cannot import 'math:nope'"),
    ({"policy": {"type": "chase", "carbon": {"callback": "math:pi"}}}, "'math:pi' is not callable"),
    ({"policy": {"type": "chase", "carbon": {"url": "https://x.org", "headers": {"k": 1}}}},
     "perseus.policy.carbon.headers must be an object of string headers"),
    ({"policy": {"type": "zeus", "batch_size": {"db": "b.db", "job_id": "j", "batch_sizes": [8, 8],
                                                 "default_batch_size": 8}}},
     "perseus.policy.batch_size.batch_sizes must be a non-empty list of distinct positive integers"),
    ({"policy": {"type": "zeus", "batch_size": {"db": "b.db", "job_id": "j", "batch_sizes": [8],
                                                 "default_batch_size": 8, "beta": 1}}},
     "perseus.policy.batch_size.beta must be a number > 1"),
    ({"policy": {"type": "zeus", "batch_size": {"db": "/etc/hostname/b.db", "job_id": "j", "batch_sizes": [8],
                                                 "default_batch_size": 8}}},
     "perseus.policy.batch_size.db \"/etc/hostname/b.db\" cannot be created"),
]


@pytest.mark.parametrize("section, message", BAD, ids=[json.dumps(s)[:60] for s, _ in BAD])
def test_bad_values_name_the_key(section, message):
    assert message in error_of(section)


@pytest.mark.parametrize("section, message", BAD, ids=[json.dumps(s)[:60] for s, _ in BAD])
def test_the_example_in_every_message_is_valid(section, message):
    """Replacing the bad value by the message's example fixes that key."""
    for line in error_of(section).splitlines():
        match = EXAMPLE.match(line)
        if match is None:
            continue
        path = re.findall(r"\w+|\[\d+\]", match["key"])[1:]
        fixed = json.loads(json.dumps(section))
        target = fixed
        for part in path[:-1]:
            target = target[int(part[1:-1])] if part.startswith("[") else target[part]
        last = path[-1]
        target[int(last[1:-1]) if last.startswith("[") else last] = json.loads(match["example"])
        try:
            PerseusConfig.from_dict(fixed)
        except ConfigError as err:
            assert match["key"] + " " not in str(err) + " ", (line, str(err))


def test_several_mistakes_are_listed_one_per_line():
    message = error_of({"seed": -1, "mode": "fast", "policy": {"type": "zeus", "eta": 2}})
    lines = message.splitlines()
    assert lines[0] == "3 mistakes in perseus:"
    assert [line.split()[1] for line in lines[1:]] == ["perseus.mode", "perseus.seed", "perseus.policy.eta"]
    assert "Input should" not in message and "pydantic" not in message


def test_unknown_keys_are_worded_the_same_everywhere():
    cases = {
        "perseus": {"bogus": 1},
        "perseus.policy": {"policy": {"bogus": 1}},
        "perseus.policy.power_limit": {"policy": {"type": "zeus", "power_limit": {"bogus": 1}}},
        "perseus.policy.carbon": {"policy": {"type": "chase", "carbon": {"csv": "a", "bogus": 1}}},
        "perseus.solver": {"solver": {"bogus": 1}},
        "perseus.simulated_workload": {"simulated_workload": {"forward_seconds": 1, "backward_seconds": 1, "bogus": 1}},
    }
    for where, section in cases.items():
        assert error_of(section).startswith(f"unknown key(s) {where}.bogus; known keys: "), where


def test_section_must_be_an_object():
    assert error_of([1, 2]) == 'perseus must be an object, got [1, 2]; e.g. {"enabled": true}'


def test_only_the_gpu_questions_are_left_for_later():
    """Supported clocks need the GPU: any positive, distinct clocks pass the door."""
    config = PerseusConfig.from_dict({"candidate_clocks": [1234, 5], "communication_clock": 5})
    assert config.candidate_clocks == (1234, 5) and config.communication_clock == 5


# --------------------------------------------------------------------------- saved profiles
def test_saved_profile_needs_its_blocking_power(tmp_path):
    profile = tmp_path / "profile.csv"
    profile.write_text("stage,instruction,frequency,time,energy\n")
    assert "profile.csv.json is missing" in error_of({"profile_path": str(profile)})
    given = PerseusConfig.from_dict({"profile_path": str(profile), "blocking_power_w": 80})
    assert given.saved_blocking_power_w is None and given.blocking_power_w == 80.0
    profile_sidecar(profile).write_text(json.dumps({"blocking_power_w": 0}))
    assert "profile.csv.json: blocking_power_w: Input should be greater than 0" in error_of({"profile_path": str(profile)})
    profile_sidecar(profile).write_text("{")
    assert "profile.csv.json: the side file of perseus.profile_path is not valid JSON" in error_of(
        {"profile_path": str(profile)})
    profile_sidecar(profile).write_text(json.dumps({"blocking_power_w": 83.64, "gpu": "A100"}))
    config = PerseusConfig.from_dict({"profile_path": str(profile)})
    assert config.saved_blocking_power_w == 83.64 and config.blocking_power_w is None
    assert PerseusConfig.from_dict(config.to_dict()) == config
    assert "is not a file" in error_of({"profile_path": str(tmp_path)})
    new = PerseusConfig.from_dict({"profile_path": str(tmp_path / "new" / "p.csv")})
    assert new.saved_blocking_power_w is None  # the job profiles and saves there


# --------------------------------------------------------------------------- policy section alone
def test_policy_config_is_typed_with_enums():
    config = PolicySection.parse({"type": "zeus", "mode": "power_limit", "power_limit": {"step_w": 50}})
    assert config.type is PolicyType.ZEUS and config.type == "zeus"
    assert config.mode is PolicyMode.POWER_LIMIT and config.mode == "power_limit"
    assert config.power_limit.step_w == 50.0 and config.power_limit.warmup_iters == 3  # defaults applied
    assert config.carbon_source is None and config.batch_size is None
    assert PolicySection.parse(None) == PolicySection()
    chase = PolicySection.parse({"type": "chase", "carbon": {"url": "https://grid.example/now", "timeout_s": 3}})
    assert chase.carbon_source is CarbonSourceKind.URL


@pytest.mark.parametrize("section, message", [
    ({"mode": "power_limit"}, "perseus.policy.mode 'power_limit' needs perseus.policy.type 'zeus' or 'chase'"),
    ({"type": "chase"}, "perseus.policy.carbon needs exactly one source"),
    ({"type": "chase", "carbon": {}}, "perseus.policy.carbon needs exactly one source"),
    ({"type": "chase", "carbon": {"csv": "a", "callback": "time:time"}}, "needs exactly one source"),
    ({"type": "zeus", "carbon": {"csv": "a"}}, "perseus.policy.carbon is only used by perseus.policy.type 'chase'"),
    ({"eta": 0.2}, "perseus.policy.eta has no effect with perseus.policy.type 'perseus'"),
    ({"type": "zeus", "batch_size": {"db": "b.db"}},
     "perseus.policy.batch_size.job_id is required to optimise the batch size across runs"),
    ({"type": "zeus", "batch_size": {"db": "b.db", "job_id": "j", "batch_sizes": [8, 16], "default_batch_size": 32}},
     "perseus.policy.batch_size.default_batch_size 32 must be one of batch_sizes [8, 16]"),
])
def test_policy_rules_across_keys(section, message):
    with pytest.raises(ConfigError) as caught:
        PolicySection.parse(section)
    assert message in str(caught.value)


# --------------------------------------------------------------------------- solver door
@dataclasses.dataclass(frozen=True)
class _CheckedOptions:
    """Stands for a SolverOptions whose __post_init__ checks its own bounds."""

    low: int = 1
    high: int = 2

    def __post_init__(self) -> None:
        if self.low > self.high:
            raise SolverError(f"low ({self.low}) must not exceed high ({self.high})")


def test_solver_constructor_errors_name_the_key():
    """An error the dataclass raises on itself (SolverError) becomes a ConfigError naming its keys."""

    class Holder(Section):
        options: Annotated[Any, dataclass_section(lambda: _CheckedOptions, dict, where="perseus.solver", example={"low": 1},
                                                  errors=(SolverError,))] = None

    from perseus_ext.config.rules import parse

    assert parse(Holder, {"options": {"low": 1}}, root="perseus").options == _CheckedOptions(1, 2)
    with pytest.raises(ConfigError) as caught:
        parse(Holder, {"options": {"low": 5}}, root="perseus")
    assert str(caught.value) == "perseus.solver.low, perseus.solver.high: low (5) must not exceed high (2)"


def test_every_solver_option_has_door_bounds():
    bounds = solver_bounds()
    assert set(bounds) == {f.name for f in dataclasses.fields(SolverOptions)}
    defaults = SolverOptions()
    for name, bound in bounds.items():  # the solver's defaults are inside its bounds
        TypeAdapter(bound).validate_python(getattr(defaults, name))


# --------------------------------------------------------------------------- generated docs
def _table_in(path: Path) -> str:
    lines = path.read_text(encoding="utf-8").splitlines()
    start = lines.index("| key | type / default | meaning |")
    end = start
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    return "\n".join(lines[start:end])


@pytest.mark.parametrize("document", ["README.md", "docs/deepspeed.md"])
def test_key_tables_are_generated_from_the_model(document):
    assert _table_in(ROOT / document) == key_table_markdown(), (
        f"regenerate {document}'s key table: python -m perseus_ext.config.key_table")


def test_every_key_has_a_description_an_example_a_row_and_a_flag():
    import argparse

    from perseus_ext.adapters.megatron_args import add_perseus_args, flag_name

    parser = add_perseus_args(argparse.ArgumentParser())
    table = key_table_markdown()
    for name, info in PerseusConfig.model_fields.items():
        assert info.description and info.description.endswith("."), name
        rule = field_rule(PerseusConfig, name)
        assert rule.example is not None, name
        assert f"| `{name}` |" in table, name
        assert flag_name(name) in parser._option_string_actions, name
    for name in PolicySection.model_fields:
        assert PolicySection.model_fields[name].description, name
        field_rule(PolicySection, name)


# --------------------------------------------------------------------------- properties
NO_COLON = st.characters(blacklist_characters=":", blacklist_categories=("Cs",))
LEAVES = (
    st.none() | st.booleans() | st.integers() | st.floats()
    | st.text(NO_COLON, max_size=12) | st.sampled_from([-(10**30), 1e308, "min", "{rank}", "sim:a40"])
    | st.just(5000).map(lambda digits: 10**digits)  # past Python's int-to-str limit
)
JSON = st.recursive(
    LEAVES,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(NO_COLON, max_size=8), children, max_size=4),
    max_leaves=16,
)
POLICY_KEYS = list(PolicySection.model_fields) + ["csv", "url", "callback", "step_w", "db"]


def _section_strategy(keys: list[str]) -> st.SearchStrategy:
    return st.dictionaries(st.sampled_from(keys) | st.text(NO_COLON, max_size=8), JSON, max_size=6)


SECTIONS = st.one_of(
    JSON,
    _section_strategy(list(PerseusConfig.model_fields)),
    st.fixed_dictionaries({"policy": _section_strategy(POLICY_KEYS)}),
    st.fixed_dictionaries({"solver": _section_strategy([f.name for f in dataclasses.fields(SolverOptions)])}),
    st.fixed_dictionaries({"simulated_workload": _section_strategy(["forward_seconds", "backward_seconds"])}),
)


@pytest.mark.timeout(120)  # the whole run: a hang fails instead of blocking CI
@settings(max_examples=400, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(SECTIONS)
def test_any_json_is_a_config_or_one_config_error(section):
    """Never another exception, never a pydantic message, never much memory (16 MiB peak)."""
    tracemalloc.start()
    try:
        PerseusConfig.from_dict(section)
    except ConfigError as err:
        message = str(err)
        assert message and "Input should" not in message and "validation error" not in message
        assert all("perseus" in line for line in message.split("\n")), message
    finally:
        peak_bytes = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert peak_bytes < 16 * 2**20


def test_every_sub_section_applies_its_defaults():
    from perseus_ext.config.policy import (
        DEFAULT_LEASE_S, DEFAULT_MAX_RESPONSE_BYTES, DEFAULT_NETWORK_TIMEOUT_S, DEFAULT_URL_FIELD,
        DEFAULT_URL_TIMEOUT_S, BudgetScope, CSVCarbonSource, FixedBudget, TraceAlignment,
    )

    carbon = PolicySection.parse({"type": "chase", "carbon": {"url": "https://grid.example/ci"}}).carbon
    assert carbon.kind is CarbonSourceKind.URL and carbon.location == "https://grid.example/ci"
    assert carbon.field == DEFAULT_URL_FIELD and carbon.timeout_s == DEFAULT_URL_TIMEOUT_S
    assert carbon.max_response_bytes == DEFAULT_MAX_RESPONSE_BYTES and carbon.headers == {}
    assert (carbon.max_carbon, carbon.forecast_horizon_s) == (None, None)
    csv = PolicySection.parse({"type": "chase", "carbon": {"csv": "ci.csv", "max_carbon": 500}}).carbon
    assert csv == CSVCarbonSource(csv="ci.csv", align=TraceAlignment.START, max_carbon=500.0)
    fixed = PolicySection.parse({"type": "power_budget", "budget": {"watts": 300}}).budget
    assert fixed == FixedBudget(watts=300.0, scope=BudgetScope.GPU)
    polled = PolicySection.parse({"type": "power_budget",
                                  "budget": {"url": "https://dc.example/budget", "scope": "job"}}).budget
    assert polled.scope is BudgetScope.JOB
    assert polled.kind is CarbonSourceKind.URL and polled.field is None  # no carbon default
    assert PolicySection.parse({"type": "zeus"}).carbon is None
    assert PolicySection.parse({"type": "zeus"}).budget is None
    batch = PolicySection.parse({"type": "zeus", "batch_size": {
        "db": "b.db", "job_id": "j", "batch_sizes": [8, 16], "default_batch_size": 8}}).batch_size
    assert batch.location == "b.db" and batch.lease_s == DEFAULT_LEASE_S
    assert batch.timeout_s == DEFAULT_NETWORK_TIMEOUT_S and batch.target_metric is None


def test_a_section_dumps_to_what_validates_back_to_it():
    """Every sub-section serialises with the model's own dump, defaults included."""
    section = PerseusConfig.from_dict({
        "gpu": "zeusd:sim:a40?pace=0&slowdown_ranks=1-2",
        "policy": {"type": "power_budget", "budget": {"url": "https://dc.example/budget", "headers": {"k": "v"}},
                   "batch_size": {"store": "sqlite:///state/bso.db", "job_id": "j", "batch_sizes": [8, 16],
                                  "default_batch_size": 16, "target_metric": {"name": "loss", "value": 2}}},
    })
    dumped = json.loads(json.dumps(section.to_dict()))
    assert dumped["gpu"] == "zeusd:sim:a40?pace=0&slowdown_ranks=1,2"
    assert dumped["policy"]["budget"]["timeout_s"] == 2.0 and dumped["policy"]["power_limit"]["step_w"] == 25.0
    assert PerseusConfig.from_dict(dumped) == section


@pytest.mark.parametrize("section, keys", [
    ({"seed": -1, "policy": {"type": "zeus", "eta": 2}}, ("perseus.seed", "perseus.policy.eta")),
    ({"candidate_clocks": [1410, 0]}, ("perseus.candidate_clocks",)),
    ({"bogus": 1, "solver": {"anchor": 3}}, ("perseus.bogus",)),  # unknown keys stop the section
    ({"solver": {"anchor": 3}}, ("perseus.solver.anchor",)),
    ({"straggler_threshold": 0.02, "straggler_hysteresis": 0.05},
     ("perseus.straggler_hysteresis", "perseus.straggler_threshold")),
    ({"gpu": "nvml", "simulated_workload": {"forward_seconds": 1, "backward_seconds": 1}},
     ("perseus.simulated_workload", "perseus.gpu")),
    ({"prometheus": {"address": "0.0.0.0"}}, ("perseus.prometheus.port", "perseus.prometheus.pushgateway")),
    ({"policy": {"type": "perseus", "mode": "power_limit"}}, ("perseus.policy.mode", "perseus.policy.type")),
    ({"policy": {"type": "zeus", "batch_size": {"store": "b.db", "job_id": "j", "batch_sizes": [8],
                                                "default_batch_size": 16}}},
     ("perseus.policy.batch_size.default_batch_size", "perseus.policy.batch_size.batch_sizes")),
])
def test_a_config_error_carries_the_keys_it_is_about(section, keys, monkeypatch):
    monkeypatch.delenv("PERSEUS_PROMETHEUS_PORT", raising=False)
    monkeypatch.delenv("PERSEUS_PUSHGATEWAY", raising=False)
    with pytest.raises(ConfigError) as caught:
        PerseusConfig.from_dict(section)
    assert caught.value.keys == keys
    assert keys[0] in str(caught.value)
