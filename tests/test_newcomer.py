"""What a new user meets in the first hour: README's environment runs the examples, CI fails
when set-up fails, config mistakes name `perseus.<key>` and suggest the key or value meant, the
extras the messages name exist, and doctor does not claim clock permission without a GPU."""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from perseus_ext.errors import ConfigError
from perseus_ext.runtime import PerseusConfig

ROOT = Path(__file__).resolve().parents[1]


def config_error(section: dict) -> str:
    with pytest.raises(ConfigError) as caught:
        PerseusConfig.from_dict({"enabled": True, **section})
    return str(caught.value)


# --------------------------------------------------------------------------- config mistakes
def test_a_mistyped_key_or_value_gets_a_did_you_mean():
    assert "perseus.log_pth (did you mean perseus.log_path?)" in config_error({"log_pth": "x.jsonl"})
    assert ("perseus.policy.etta (did you mean perseus.policy.eta?)"
            in config_error({"policy": {"type": "zeus", "etta": 0.5}}))
    message = config_error({"mode": "optimise"})
    assert message.startswith("perseus.mode ") and '(did you mean "optimize"?)' in message
    assert '(did you mean "zeus"?)' in config_error({"policy": {"type": "zues"}})
    # nothing close: no suggestion, the allowed values are listed
    assert "did you mean" not in config_error({"mode": "banana"})


def test_an_unwritable_log_path_fails_at_the_door(tmp_path):
    """Root may write everywhere access() can tell, but nothing can be created in /proc: the
    door tries, instead of the first iteration's FileNotFoundError."""
    message = config_error({"log_path": "/proc/perseus-logs/{rank}.jsonl"})
    assert message.startswith('perseus.log_path "/proc/perseus-logs/0.jsonl" (rank 0) cannot be created')
    assert "cannot be created" in config_error({"summary_path": "/proc/summary.json"})
    fine = PerseusConfig.from_dict({"log_path": str(tmp_path / "new" / "dir" / "{rank}.jsonl")})
    assert fine.log_path.endswith("{rank}.jsonl") and not (tmp_path / "new").exists()  # nothing left behind


def test_an_unknown_simulated_gpu_names_perseus_gpu():
    message = config_error({"gpu": "sim:a100"})
    assert message.startswith('perseus.gpu "sim:a100": unknown simulated preset') and "a100_sxm" in message
    assert "(did you mean \"pace\"?)" in config_error({"gpu": "sim:a100_sxm?pase=0"})
    assert config_error({"gpu": "sim:a40?period=x"}).startswith("perseus.gpu ")


def test_a_simulated_workload_without_a_simulated_gpu_fails_at_the_door(monkeypatch):
    """On a machine without a GPU this section used to pass, log a permission warning and a
    GPUNotSupportedError traceback per rank, and exit 0 having done nothing."""
    monkeypatch.delenv("PERSEUS_GPU", raising=False)
    workload = {"simulated_workload": {"forward_seconds": 0.01, "backward_seconds": 0.02}}
    message = config_error(workload)
    assert "perseus.simulated_workload" in message and 'set perseus.gpu to "sim:a100_sxm"' in message
    assert "perseus.gpu" in config_error({"gpu": "nvml", **workload})
    monkeypatch.setenv("PERSEUS_GPU", "sim:a40")
    assert PerseusConfig.from_dict({"enabled": True, **workload}).simulated_workload is not None


def test_every_extra_a_message_or_doc_names_exists():
    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    named: dict[str, set[str]] = {}
    for path in [*ROOT.glob("perseus_ext/**/*.py"), *ROOT.glob("**/*.md"), *ROOT.glob("examples/**/*.sh")]:
        if ".venv" in path.parts:
            continue
        for group in re.findall(r"perseus-ext\[([a-z0-9_,-]+)\]", path.read_text(encoding="utf-8")):
            for extra in group.split(","):
                named.setdefault(extra, set()).add(str(path.relative_to(ROOT)))
    missing = {extra: sorted(paths) for extra, paths in named.items() if extra not in extras}
    assert not missing, f"extras named but not in pyproject.toml: {missing}"


def test_doctor_claims_no_clock_permission_without_a_gpu(monkeypatch, capsys):
    """As root on a machine without NVML, doctor used to print 'permission to set clocks: yes'."""
    from perseus_ext.cli import main

    monkeypatch.setitem(sys.modules, "pynvml", None)
    assert main(["doctor", "--gpu", "nvml"]) == 1
    printed = capsys.readouterr().out
    assert "permission to set clocks: no GPU to set" in printed
    assert "perseus-ext[nvml]" not in printed


# --------------------------------------------------------------------------- CI
def _readme_test_command() -> str:
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)\n```", readme, re.S)
    return next(block for block in blocks if "pytest" in block)


def test_ci_runs_readmes_test_command_step_by_step():
    steps = _readme_test_command().split(" && ")
    lines = [line.strip() for line in (ROOT / ".ci/run").read_text().splitlines()]
    positions = [lines.index(step) for step in steps]  # ValueError: a step is missing
    assert positions == sorted(positions)


def _executable(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def test_ci_fails_when_an_install_step_fails(tmp_path):
    """A failing pip used to end only the `&&` chain; the script went on and its last step decided."""
    repo, fake_bin = tmp_path / "repo", tmp_path / "bin"
    (repo / ".ci").mkdir(parents=True)
    shutil.copy(ROOT / ".ci/run", repo / ".ci/run")
    reached = tmp_path / "reached"
    _executable(repo / "benchmarks/deepspeed_versions.sh", f"touch {reached}\n")
    # python3 makes a venv whose pip fails; the servers are "installed" so apt-get is not run
    _executable(fake_bin / "python3", "#!/bin/sh\nmkdir -p .venv/bin\n"
                "printf '#!/bin/sh\\necho pip failed >&2\\nexit 1\\n' > .venv/bin/pip\n"
                "printf '#!/bin/sh\\nexit 0\\n' > .venv/bin/python\nchmod +x .venv/bin/pip .venv/bin/python\n")
    for server in ("prometheus", "prometheus-pushgateway"):
        _executable(fake_bin / server, "#!/bin/sh\nexit 0\n")
    env = dict(os.environ, PATH=f"{fake_bin}:{os.environ['PATH']}")
    done = subprocess.run(["bash", str(repo / ".ci/run")], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0, done.stdout + done.stderr
    assert "pip failed" in done.stderr and not reached.exists()


# --------------------------------------------------------------------------- Megatron example
@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_megatron_tiny_example_runs_from_readmes_venv(tmp_path):
    """README installs into `.venv` at the checkout's root and never activates it; the script
    used to run the system python3 (`No module named 'torch'`). Here the checkout's `.venv` is
    this test's environment, and PATH holds a python3 that has no torch."""
    pytest.importorskip("megatron.core")
    checkout = tmp_path / "checkout"
    shutil.copytree(ROOT / "examples/megatron_gpt3", checkout / "examples/megatron_gpt3")
    (checkout / ".venv").symlink_to(Path(sys.prefix))  # README's `python3 -m venv .venv`
    fake_bin = tmp_path / "bin"
    _executable(fake_bin / "python3", "#!/bin/sh\necho \"No module named 'torch'\" >&2\nexit 1\n")
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHON", "VIRTUAL_ENV")}
    env.update(PATH=f"{fake_bin}:/usr/bin:/bin", TRAIN_ITERS="12",
               PYTHONPATH=os.environ.get("PYTHONPATH", str(ROOT)))
    done = subprocess.run(["bash", str(checkout / "examples/megatron_gpt3/run_tiny_cpu.sh")], env=env,
                          capture_output=True, text=True, timeout=540)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert "perseus-ext" in output and "No module named" not in output


# --------------------------------------------------------------------------- short jobs
@pytest.mark.distributed
def test_a_job_of_50_deployed_iterations_measures_its_saving_by_default(caplog):
    """With the default baseline_fraction (0.01) a 60-iteration job used to end with no probe,
    no measured saving and no word on when profiling pays back."""
    import logging

    from perseus_ext.planning.schedule import build_schedule
    from perseus_ext.runtime import PerseusRuntime
    from perseus_ext.observability.phase import Phase
    from runtime_helpers import make_config, sim_gpu, train

    config = make_config(straggler_check_interval=10)  # the default check interval, default fraction
    assert config.baseline_fraction == PerseusConfig().baseline_fraction == 0.01
    runtime = PerseusRuntime(config, schedule=build_schedule("1f1b", 1, 4), stage=0, gpu=sim_gpu())
    caplog.set_level(logging.INFO, logger="perseus_ext")
    while runtime.phase is not Phase.DEPLOYED:
        train(runtime, 1)
    train(runtime, 52)  # 50 deployed iterations recorded (records arrive about an iteration late)
    runtime.close()
    estimate = runtime.probes.estimate()
    assert estimate is not None and estimate.probes >= 3, estimate
    assert estimate.saving_low is not None and estimate.saving_low <= estimate.saving <= estimate.saving_high
    summary = runtime.summary()
    assert summary["energy_saving_vs_default"] is not None
    told = [r.getMessage() for r in caplog.records if "profiling (" in r.getMessage()]
    assert len(told) == 1, told  # once
    assert "vs default clocks" in told[0] and ("repays it after" in told[0] or "nothing to repay" in told[0]
                                                or "not repaid" in told[0])


# --------------------------------------------------------------------------- one output flag
@pytest.mark.parametrize("command", ["frontier", "emulate", "demo", "report", "doctor"])
def test_every_command_writes_its_output_with_one_flag(command, capsys):
    """`frontier --out` was a file, `demo --out` a folder, `emulate --output` a file, `report` and
    `doctor` took `--json PATH`: now `--output` everywhere (and `--plot` for a figure)."""
    from perseus_ext.cli import main

    with pytest.raises(SystemExit):
        main([command, "--help"])
    assert "--output" in capsys.readouterr().out


def test_old_output_spellings_still_work_with_a_deprecation_line(tmp_path, capsys):
    from perseus_ext.cli import main

    new, old = tmp_path / "new.json", tmp_path / "old.json"
    base = ["frontier", "--profile", "gpt3-175b-a100_sxm", "--microbatches", "2", "-q"]
    assert main([*base, "--output", str(new)]) == 0
    assert "deprecated" not in capsys.readouterr().err and new.is_file()
    assert main([*base, "--out", str(old)]) == 0
    assert "perseus-ext: --out is deprecated; use --output" in capsys.readouterr().err and old.is_file()
    assert main(["doctor", "--gpu", "sim:a40?pace=0&period=0.02", "--updates", "2", "--json",
                 str(tmp_path / "doctor.json")]) == 0
    assert "perseus-ext: --json is deprecated; use --output" in capsys.readouterr().err
    assert (tmp_path / "doctor.json").is_file()
