"""The Megatron `--perseus` argument group and its mapping to `PerseusConfig` (no processes)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from perseus_ext.adapters.megatron_args import FlagError, flag_name, value_kind
from perseus_ext.errors import ConfigError
from perseus_ext.megatron import add_perseus_args, chain_extra_args, config_from_args, install
from perseus_ext.config import PerseusConfig

ROOT = Path(__file__).resolve().parents[1]
PATCHES = ROOT / "patches" / "megatron-lm"


def parse(*argv: str) -> argparse.Namespace:
    """Parsed as Megatron parses, except that a bad flag raises (`exit_on_error=False`) instead of
    ending the test process; `test_a_bad_flag_is_argparses_usage_and_one_error_line` checks the exit."""
    return add_perseus_args(argparse.ArgumentParser(exit_on_error=False)).parse_args(list(argv))


def test_perseus_off_means_no_config_and_no_install():
    args = parse()
    assert args.perseus is False
    assert config_from_args(args) is None
    assert install(args) is None


def test_individual_flags_mirror_the_deepspeed_keys():
    args = parse(
        "--perseus",
        "--perseus-candidate-clocks", "1200", "1410",
        "--perseus-mode", "observe",
        "--perseus-communication-clock", "min",
        "--perseus-straggler-threshold", "0.1",
        "--perseus-early-stop", "false",
        "--perseus-simulated-workload", '{"forward_seconds": 0.01, "backward_seconds": [0.02, 0.03]}',
        "--perseus-gpu", "sim:a100_sxm",
    )
    config = config_from_args(args)
    assert config.enabled is True
    assert config.candidate_clocks == (1410, 1200)
    assert config.mode == "observe"
    assert config.communication_clock == "min"
    assert config.straggler_threshold == pytest.approx(0.1)
    assert config.early_stop is False
    assert config.simulated_workload.backward_seconds == (0.02, 0.03)


def test_config_file_is_the_deepspeed_section_and_flags_override_it(tmp_path):
    section = {"warmup_iterations": 5, "straggler_check_interval": 3}
    plain = tmp_path / "perseus.json"
    plain.write_text(json.dumps(section))
    deepspeed = tmp_path / "ds_config.json"
    deepspeed.write_text(json.dumps({"train_batch_size": 8, "perseus": section}))
    for path in (plain, deepspeed):
        config = config_from_args(
            parse("--perseus", "--perseus-config", str(path), "--perseus-warmup-iterations", "7")
        )
        assert config.warmup_iterations == 7
        assert config.straggler_check_interval == 3


def test_bad_values_name_the_flag():
    with pytest.raises(ConfigError, match="--perseus-straggler-threshold"):
        config_from_args(parse("--perseus", "--perseus-straggler-threshold", "2"))
    with pytest.raises(ConfigError, match="cannot read"):
        config_from_args(parse("--perseus", "--perseus-config", "/nonexistent/perseus.json"))
    with pytest.raises(ConfigError, match=r"perseus.early_stop must be true or false.*--perseus-early-stop"):
        config_from_args(parse("--perseus", "--perseus-early-stop", "sometimes"))


def test_flags_are_generated_from_the_model(capsys):
    parser = add_perseus_args(argparse.ArgumentParser())
    flags = {flag_name(key) for key in PerseusConfig.model_fields}
    assert flags <= set(parser._option_string_actions)
    assert flag_name("enabled") == "--perseus" and flag_name("log_path") == "--perseus-log-path"
    with pytest.raises(SystemExit):
        parser.parse_args(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert ("config key 'control_timeout_s' (a number of seconds in [1, 604800]; default 1800.0): "
            "Timeout of perseus-") in help_text
    kinds = {key: value_kind(info.annotation) for key, info in PerseusConfig.model_fields.items()}
    assert kinds["early_stop"] == kinds["dry_run"] == "bool"
    assert kinds["candidate_clocks"] == "list"
    assert kinds["solver"] == kinds["policy"] == kinds["communication_clock"] == "json"


def test_object_flags_take_json_and_null_overrides_the_file(tmp_path):
    path = tmp_path / "perseus.json"
    path.write_text(json.dumps({"blocking_power_w": 80, "policy": {"type": "zeus"}}))
    config = config_from_args(parse(
        "--perseus", "--perseus-config", str(path),
        "--perseus-blocking-power-w", "null",
        "--perseus-solver", '{"min_grid_points": 300}',
        "--perseus-policy", '{"type": "zeus", "eta": 0.7}',
        "--perseus-communication-clock", "705",
    ))
    assert config.blocking_power_w is None
    assert config.solver.min_grid_points == 300
    assert config.policy.eta == 0.7 and config.policy.type == "zeus"
    assert config.communication_clock == 705


@pytest.mark.parametrize("argv, message", [
    (["--perseus-solver", '{"min_grid_points": -5}'],
     "perseus.solver.min_grid_points must be an integer in [2, 20000], got -5; e.g. 500 (Megatron flag --perseus-solver"),
    (["--perseus-solver", "{min_grid_points: 5}"], "perseus.solver must be an object"),
    (["--perseus-candidate-clocks", "1410", "fast"], "perseus.candidate_clocks[1] must be a clock in MHz"),
    (["--perseus-control-timeout-s", "1e15"], "perseus.control_timeout_s must be a number of seconds in [1, 604800]"),
    (["--perseus-log-path", "/tmp/{job}.jsonl"], "perseus.log_path uses {job}"),
    (["--perseus-policy", '{"type": "zeus", "eta": 2}'], "perseus.policy.eta must be in [0, 1], got 2"),
    (["--perseus-seed", "-1", "--perseus-mode", "fast"],
     "(Megatron flag --perseus-mode, --perseus-seed)"),
])
def test_bad_flag_values_raise_config_error_naming_key_and_flag(argv, message):
    with pytest.raises(ConfigError) as caught:
        config_from_args(parse("--perseus", *argv))
    assert message in str(caught.value)


FLAGS = sorted(flag_name(key) for key in PerseusConfig.model_fields if key != "enabled")
SAFE_TEXT = st.text(st.characters(blacklist_characters=":", blacklist_categories=("Cs",)), max_size=16)
VALUES = SAFE_TEXT.filter(lambda text: not text.startswith("-")) | st.builds(
    json.dumps, st.recursive(st.none() | st.booleans() | st.integers(0) | st.floats(0) | SAFE_TEXT,
                             lambda children: st.lists(children, max_size=3)
                             | st.dictionaries(SAFE_TEXT, children, max_size=3), max_leaves=8))


@pytest.mark.timeout(120)  # the whole run: a hang fails instead of blocking CI
@settings(max_examples=150, deadline=None, derandomize=True)
@given(st.lists(st.tuples(st.sampled_from(FLAGS), st.lists(VALUES, min_size=1, max_size=3)), max_size=5))
def test_any_flag_values_give_a_config_or_one_config_error(pairs):
    parser = add_perseus_args(argparse.ArgumentParser(exit_on_error=False))
    argv = ["--perseus"]
    for flag, values in pairs:
        action = parser._option_string_actions[flag]
        argv += [flag, *(values if action.nargs == "+" else values[:1])]
    try:  # the section is validated as the arguments are parsed
        config = config_from_args(parser.parse_args(argv))
    except ConfigError as err:
        assert "Input should" not in str(err)
    else:
        assert config.enabled is True


def test_the_section_is_validated_as_the_arguments_are_parsed_and_parsed_once():
    parser = add_perseus_args(argparse.ArgumentParser(exit_on_error=False))
    with pytest.raises(FlagError, match="perseus.straggler_threshold") as caught:
        parser.parse_args(["--perseus", "--perseus-straggler-threshold", "2"])  # before Megatron builds anything
    assert caught.value.flags == ("--perseus-straggler-threshold",)
    assert caught.value.keys == ("perseus.straggler_threshold",)
    args = parser.parse_args(["--perseus", "--perseus-mode", "observe"])
    config = config_from_args(args)
    assert config.mode == "observe" and config_from_args(args) is config  # the door's object, handed on
    assert config_from_args(parser.parse_args([])) is None


def megatron_like_parser() -> argparse.ArgumentParser:
    """The perseus group on a parser made as Megatron-LM makes its own (`allow_abbrev=False`,
    a `--pipeline-model-parallel-size` flag)."""
    parser = argparse.ArgumentParser(prog="pretrain_gpt.py", allow_abbrev=False)
    parser.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    return add_perseus_args(parser)


def usage_error(parser: argparse.ArgumentParser, argv: list[str], capsys) -> str:
    """The one `error:` line a bad command line ends with, after checking argparse's exit 2."""
    with pytest.raises(SystemExit) as caught:
        parser.parse_args(argv)
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: pretrain_gpt.py")
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and err.rstrip().endswith(errors[0]), err
    assert "Traceback" not in err
    return errors[0]


@pytest.mark.parametrize("argv, line", [
    (["--perseus-straggler-threshold", "2"],
     "error: argument --perseus-straggler-threshold: perseus.straggler_threshold must be a number in (0, 1), got 2"),
    (["--perseus-mode", "fast", "--perseus-seed", "-1"],
     'error: arguments --perseus-mode, --perseus-seed: 2 mistakes in perseus: perseus.mode must be one of '
     '"optimize", "observe", got "fast"; e.g. "observe"; perseus.seed must be an integer >= 0, got -1; e.g. 0'),
    (["--perseus-policy", '{"type": "zeus", "eta": 2}'], "error: argument --perseus-policy: perseus.policy.eta"),
    (["--perseus-straggler-hysteresis", "0.3"],  # a mistake across keys: the flag given is blamed
     "error: argument --perseus-straggler-hysteresis: perseus.straggler_hysteresis (0.3) must be smaller"),
    (["--perseus-warmup-iteration", "3"],  # Megatron-LM refuses abbreviations; so does the perseus group
     "error: argument --perseus-warmup-iteration: perseus flags are never abbreviated; write "
     "--perseus-warmup-iterations in full"),
    (["--perseus-warmup-iteratoins", "3"],
     'error: argument --perseus-warmup-iteratoins: unrecognized perseus flag (did you mean "--perseus-warmup-iterations"?)'),
    (["--perseus-mode", "optimize", "--pipeline-model-parallel-size", "1"],
     "error: arguments --perseus-mode, --pipeline-model-parallel-size: perseus.mode 'optimize' plans GPU clocks across "
     "pipeline stages, but --pipeline-model-parallel-size is 1; use --perseus-mode observe"),
])
def test_a_bad_flag_is_argparses_usage_and_one_error_line(argv, line, capsys):
    parser = megatron_like_parser()
    assert line in usage_error(parser, ["--perseus", "--pipeline-model-parallel-size", "2", *argv], capsys)


@pytest.mark.parametrize("content, line", [
    (b'{"straggler_threshold": 2}',
     "error: argument --perseus-config: perseus.straggler_threshold must be a number in (0, 1), got 2"),
    (b'{"straggler_treshold": 0.1}', "error: argument --perseus-config: unknown key(s) perseus.straggler_treshold "
                                     "(did you mean perseus.straggler_threshold?)"),
    (b'{"warmup_iterations": NaN}', "is not valid JSON"),
    (b"[1, 2]", "error: argument --perseus-config: "),
])
def test_a_bad_config_file_is_argparses_usage_and_one_error_line(tmp_path, content, line, capsys):
    path = tmp_path / "perseus.json"
    path.write_bytes(content)
    found = usage_error(megatron_like_parser(),
                        ["--perseus", "--pipeline-model-parallel-size", "2", "--perseus-config", str(path)], capsys)
    assert line in found and found.startswith("pretrain_gpt.py: error: argument --perseus-config: ")


def test_a_flag_overriding_the_file_is_blamed_not_the_file(tmp_path, capsys):
    path = tmp_path / "perseus.json"
    path.write_text(json.dumps({"straggler_threshold": 0.5, "warmup_iterations": 2}))
    line = usage_error(megatron_like_parser(), ["--perseus", "--pipeline-model-parallel-size", "2", "--perseus-config",
                                                str(path), "--perseus-warmup-iterations", "-4"], capsys)
    assert "error: argument --perseus-warmup-iterations: perseus.warmup_iterations" in line


def test_flags_are_found_from_the_keys_the_error_carries_not_from_its_words():
    """A ConfigError's `keys` say which keys it is about: the flag follows them, whatever the
    message happens to mention (here another key by name)."""
    with pytest.raises(FlagError) as caught:
        parse("--perseus", "--perseus-straggler-hysteresis", "0.01", "--perseus-straggler-threshold", "0.005")
    message = str(caught.value)
    assert "perseus.straggler_threshold" in message and "perseus.straggler_hysteresis" in message
    blamed = set(caught.value.flags)
    assert blamed <= {"--perseus-straggler-hysteresis", "--perseus-straggler-threshold"} and blamed
    with pytest.raises(FlagError) as caught:
        parse("--perseus", "--perseus-solver", '{"min_grid_points": 1}', "--perseus-mode", "observe")
    assert caught.value.keys == ("perseus.solver.min_grid_points",) and caught.value.flags == ("--perseus-solver",)


def test_config_error_keys_survive_pickling_and_default_to_none():
    import pickle

    error = ConfigError("perseus.seed must be ...", keys=["perseus.seed", "perseus.seed"])
    assert error.keys == ("perseus.seed",)
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is ConfigError and copy.keys == ("perseus.seed",) and str(copy) == str(error)
    assert ConfigError("no key").keys == ()
    flag_error = FlagError("bad", flags=("--perseus-seed",), keys=("perseus.seed",), message="bad (flag)")
    copy = pickle.loads(pickle.dumps(flag_error))
    assert (copy.flags, copy.keys, copy.reason, str(copy)) == (("--perseus-seed",), ("perseus.seed",), "bad", "bad (flag)")


def test_our_examples_refuse_abbreviations_as_megatron_lm_does():
    """Megatron-LM's parser is made with allow_abbrev=False; the example scripts' parsers too."""
    import ast

    scripts = [ROOT / "examples" / "megatron_gpt3" / "pretrain_gpt3.py", ROOT / "examples" / "deepspeed" / "train.py"]
    for script in scripts:
        calls = [node for node in ast.walk(ast.parse(script.read_text())) if isinstance(node, ast.Call)
                 and getattr(node.func, "attr", getattr(node.func, "id", None)) == "ArgumentParser"]
        assert calls, script
        for call in calls:
            options = {keyword.arg: keyword.value for keyword in call.keywords}
            assert isinstance(options.get("allow_abbrev"), ast.Constant) and options["allow_abbrev"].value is False, script


def test_chain_extra_args_runs_every_provider_and_skips_none():
    def other(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        parser.add_argument("--other-flag", type=int, default=0)
        return parser

    parser = chain_extra_args(None, other, add_perseus_args)(argparse.ArgumentParser())
    args = parser.parse_args(["--other-flag", "3", "--perseus"])
    assert args.other_flag == 3 and args.perseus is True


def test_megatron_lm_patches_are_git_diffs_of_pretrain_gpt():
    patches = sorted(PATCHES.glob("*.patch"))
    assert [p.name for p in patches] == [
        "pretrain_gpt.core_v0.16.patch",
        "pretrain_gpt.core_v0.18.patch",
        "pretrain_gpt.core_v0.19.patch",
    ]
    for patch in patches:
        text = patch.read_text()
        assert text.startswith("diff --git a/pretrain_gpt.py b/pretrain_gpt.py")
        assert "perseus_megatron.add_perseus_args" in text
        # the parsed arguments go to install(), so bad flags fail before training
        assert "+    perseus = perseus_megatron.install(args)" in text or (
            "+    perseus = perseus_megatron.install(parse_args(extra_args_provider))" in text)
        assert "+    if perseus is not None:\n+        perseus.close()" in text
        result = subprocess.run(
            ["git", "apply", "--stat", str(patch)], capture_output=True, text=True, cwd=ROOT
        )
        assert result.returncode == 0, result.stderr
        assert "pretrain_gpt.py" in result.stdout


@pytest.mark.parametrize("module", ["perseus_ext.megatron", "perseus_ext.adapters.megatron"])
def test_importing_the_adapter_does_not_import_megatron_or_torch(module):
    code = (
        f"import sys, {module}; "
        "assert 'megatron' not in sys.modules and 'torch' not in sys.modules, sorted(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_install_hooks_megatron_core_schedules_and_close_restores_them():
    pytest.importorskip("megatron.core", reason="megatron-core is the optional 'megatron' extra")
    from megatron.core.pipeline_parallel import schedules

    from perseus_ext.adapters.megatron import PATCH_SURFACES

    names = PATCH_SURFACES[(0, 16)].names  # the installed release
    assert set(names) == {"forward_step", "backward_step", "forward_backward_no_pipelining",
                          "forward_backward_pipelining_without_interleaving",
                          "forward_backward_pipelining_with_interleaving"}
    before = {name: getattr(schedules, name) for name in names}
    perseus = install(parse("--perseus", "--perseus-mode", "observe"))
    try:
        for name in names:
            hooked = getattr(schedules, name)
            assert hooked is not before[name] and hooked.__wrapped__ is before[name]
        with pytest.raises(ConfigError, match="already installed"):
            install(parse("--perseus"))
    finally:
        summary = perseus.close()
    assert {name: getattr(schedules, name) for name in names} == before
    assert summary["megatron"] == {"stage": None, "schedule": None}  # never trained
    assert perseus.close()["megatron"]["stage"] is None  # idempotent


def test_patch_surfaces_name_every_release_and_refuse_older_ones():
    from perseus_ext.adapters.megatron_surface import PATCH_SURFACES, patch_surface

    assert sorted(PATCH_SURFACES) == [(0, 16), (0, 17), (0, 18), (0, 19)]
    assert "backward_step_multimodule" not in patch_surface("0.16.1").names
    assert "backward_step_multimodule" in patch_surface("0.19.0rc1").names
    assert patch_surface("0.20.0") == PATCH_SURFACES[(0, 19)]  # newest known, with a warning
    with pytest.raises(ConfigError, match="older than"):
        patch_surface("0.15.3")


def test_optimize_mode_without_a_pipeline_fails_at_install():
    """PP = 1 runs observe and power-limit modes; optimize gets a clear error up front."""
    pytest.importorskip("megatron.core", reason="megatron-core is the optional 'megatron' extra")
    args = parse("--perseus")
    args.pipeline_model_parallel_size = 1
    with pytest.raises(ConfigError, match="without pipeline parallelism; use --perseus-mode observe"):
        install(args)
    args = parse("--perseus", "--perseus-mode", "observe")
    args.pipeline_model_parallel_size = 1
    install(args).close()
    args = parse("--perseus", "--perseus-policy", '{"type": "zeus", "mode": "power_limit"}')
    args.pipeline_model_parallel_size = 1
    install(args).close()


def test_bad_flags_fail_at_install_not_at_the_first_step():
    with pytest.raises(ConfigError, match="--perseus-straggler-threshold"):
        install(parse("--perseus", "--perseus-straggler-threshold", "2"))


def test_a_schedule_bound_before_install_is_an_error_not_a_silent_no_op(monkeypatch):
    """A script that held megatron-core's schedule function from before install() would run it
    unhooked; its first step raises a ConfigError that says what to do instead."""
    pytest.importorskip("megatron.core", reason="megatron-core is the optional 'megatron' extra")
    from megatron.core.pipeline_parallel import schedules
    from megatron_shims import run_megatron_schedule

    bound_early = schedules.forward_backward_no_pipelining  # get_forward_backward_func() before install
    perseus = install(parse("--perseus", "--perseus-mode", "observe"))
    try:
        monkeypatch.setattr(schedules, "get_forward_backward_func", lambda **_: bound_early)
        with pytest.raises(ConfigError, match=r"before perseus_megatron.install\(\); call install\(\) first"):
            run_megatron_schedule(1, 2)
    finally:
        perseus.close()


@pytest.mark.parametrize("content, expected", [
    (b'{"perseus": ' + b'{"a": ' * 5000 + b"1" + b"}" * 5001, "nests deeper than 16 levels"),  # was RecursionError
    (b'{"warmup_iterations": 1, "warmup_iterations": 2}', "key 'warmup_iterations' is given twice"),
    (b"\xff\xfe{}", "is not UTF-8 text"),
    (b'{"warmup_iterations": NaN}', "is not valid JSON"),
    (b" " * (1 << 20) + b"{}", "more than the 1.0 MB perseus-ext reads"),  # was read whole (50 MB: 704 MB)
])
def test_a_bad_config_file_is_one_error_naming_the_flag_and_the_file(tmp_path, content, expected):
    path = tmp_path / "perseus.json"
    path.write_bytes(content)
    with pytest.raises(ConfigError) as caught:
        config_from_args(parse("--perseus", "--perseus-config", str(path)))
    message = str(caught.value)
    assert message.startswith(f"--perseus-config {path}") and expected in message and "\n" not in message
    with pytest.raises(ConfigError, match="is a directory"):
        config_from_args(parse("--perseus", "--perseus-config", str(tmp_path)))


def test_an_unknown_simulated_preset_in_the_environment_fails_at_the_door(monkeypatch):
    """perseus.gpu null reads env PERSEUS_GPU: a preset that does not exist was accepted and
    failed only when a rank opened its GPU."""
    monkeypatch.setenv("PERSEUS_GPU", "sim:bogus")
    with pytest.raises(ConfigError, match="perseus.gpu is null, so env PERSEUS_GPU names the GPU: .*unknown simulated "
                                          "preset 'bogus'.*fix PERSEUS_GPU or set perseus.gpu \\(Megatron flag --perseus-gpu\\)"):
        config_from_args(parse("--perseus"))
    monkeypatch.setenv("PERSEUS_GPU", "sim:a40")
    assert config_from_args(parse("--perseus")).gpu is None
