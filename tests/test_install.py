"""Installation: the CLI works without the optional frameworks; a wheel (not editable) install
ships the profiles, patches and the autoload `.pth` and runs `perseus-ext frontier` on a shipped
profile; editable installs get the `.pth` too; the hook costs next to nothing at start-up.

The framework checks run in a fresh interpreter in which importing those frameworks fails, as on
a machine where only the core requirements are installed.
"""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import textwrap
import time
import zipfile
from pathlib import Path

import pytest

from perseus_ext.data import shipped_profile_names

FRAMEWORKS = ("torch", "deepspeed", "megatron", "pynvml", "matplotlib")


def _run_without_frameworks(code: str) -> subprocess.CompletedProcess:
    blocker = textwrap.dedent(
        f"""
        import sys
        for name in {FRAMEWORKS!r}:
            sys.modules[name] = None  # `import name` now raises ImportError
        """
    )
    return subprocess.run(
        [sys.executable, "-c", blocker + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_cli_help_needs_no_framework() -> None:
    result = _run_without_frameworks(
        """
        from perseus_ext.cli import main
        try:
            main(["--help"])
        except SystemExit as done:
            sys.exit(done.code)
        """
    )
    assert result.returncode == 0, result.stderr
    assert "usage: perseus-ext" in result.stdout


def test_every_subcommand_help_needs_no_framework() -> None:
    result = _run_without_frameworks(
        """
        import argparse
        from perseus_ext.cli import build_parser
        parser = build_parser()
        (subcommands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        commands = subcommands.choices
        for name in commands:
            try:
                parser.parse_args([name, "--help"])
            except SystemExit as done:
                assert done.code == 0, name
        print("checked", sorted(commands))
        """
    )
    assert result.returncode == 0, result.stderr
    assert "checked" in result.stdout


# --------------------------------------------------------------------------- wheel and editable

SOURCE = Path(__file__).resolve().parents[1]
PACKAGING_FILES = ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md", "perseus_ext_autoload.pth")
FAKE_DEEPSPEED = '''
from types import SimpleNamespace
def initialize(**kwargs):
    engine = SimpleNamespace(_config=SimpleNamespace(_param_dict=kwargs["config"]))
    return engine, None, None, None
'''


def _copy_source(destination: Path) -> Path:
    """What a build needs, copied so that building never writes into the checkout."""
    destination.mkdir()
    for name in PACKAGING_FILES:
        shutil.copy2(SOURCE / name, destination / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(SOURCE / "perseus_ext", destination / "perseus_ext", symlinks=True, ignore=ignore)
    shutil.copytree(SOURCE / "patches", destination / "patches", ignore=ignore)
    return destination


def _venv_with(wheel: Path, where: Path) -> Path:
    """A fresh venv with `wheel` installed as pip installs it; the test interpreter's own
    site-packages are added as plain path entries (their `.pth` files are not run), so the
    dependencies resolve without reinstalling them and this checkout stays invisible."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True, timeout=120)
    python = where / "bin" / "python"
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--no-deps",
         "--no-index", str(wheel)],
        check=True, timeout=300, capture_output=True,
    )
    (_site_packages(python) / "_test_dependencies.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    return python


def _site_packages(python: Path) -> Path:
    return Path(_check_output(python, "import sysconfig; print(sysconfig.get_paths()['purelib'])").strip())


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PERSEUS_AUTOLOAD")}
    return {**env, **extra}


def _check_output(python: Path, code: str, **env: str) -> str:
    result = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=300,
                            env=_clean_env(**env), cwd=python.parents[1])
    assert result.returncode == 0, result.stderr
    return result.stdout + result.stderr


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("packaging")
    source = _copy_source(root / "src")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
         "--no-index", "--wheel-dir", str(root / "dist"), str(source)],
        check=True, timeout=300, capture_output=True,
    )
    editable = subprocess.run(
        [sys.executable, "-c", "import sys; from setuptools import build_meta; "
         "print(build_meta.build_editable(sys.argv[1]))", str(root / "editable")],
        check=True, timeout=300, capture_output=True, text=True, cwd=source,
    )
    (wheel,) = (root / "dist").glob("perseus_ext-*.whl")
    return {"root": root, "source": source, "wheel": wheel,
            "editable": root / "editable" / editable.stdout.strip().splitlines()[-1]}


def test_wheel_ships_profiles_patches_and_the_autoload_hook(built) -> None:
    names = set(zipfile.ZipFile(built["wheel"]).namelist())
    assert "perseus_ext_autoload.pth" in names  # top of site-packages, not inside the package
    profiles = {n for n in names if n.startswith("perseus_ext/data/profiles/")}
    assert {f"perseus_ext/data/profiles/{p}.csv" for p in shipped_profile_names()} <= profiles
    assert "perseus_ext/data/profiles/README.md" in profiles  # the data's attribution
    assert "perseus_ext/data/patches/megatron-lm/pretrain_gpt.core_v0.16.patch" in names
    assert not any(n.startswith(("tests/", "examples/")) for n in names)
    metadata = zipfile.ZipFile(built["wheel"]).read(
        next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert "Requires-Dist: nvidia-ml-py" in metadata
    assert "Requires-Dist: deepspeed>=0.14.4; extra" in metadata


def test_wheel_install_runs_frontier_with_a_shipped_profile(built) -> None:
    python = _venv_with(built["wheel"], built["root"] / "venv-wheel")
    out = built["root"] / "frontier.json"
    started = time.perf_counter()
    result = subprocess.run(
        [str(python.parent / "perseus-ext"), "frontier", "--profile", "gpt3-175b-a100_sxm",
         "--microbatches", "4", "--out", str(out)],
        capture_output=True, text=True, timeout=300, env=_clean_env(), cwd=built["root"],
    )
    assert result.returncode == 0, result.stderr
    assert "T_min" in result.stdout and json.loads(out.read_text())["blocking_power"] == 83.64
    assert time.perf_counter() - started < 120
    location = _check_output(python, "import perseus_ext; print(perseus_ext.__file__)")
    assert location.startswith(str(_site_packages(python)))
    patches = subprocess.run([str(python.parent / "perseus-ext"), "patch-path"], capture_output=True,
                             text=True, timeout=120, env=_clean_env(), check=True).stdout.strip()
    assert Path(patches, "pretrain_gpt.core_v0.18.patch").is_file()


def test_editable_install_has_the_autoload_hook_and_the_data(built) -> None:
    names = zipfile.ZipFile(built["editable"]).namelist()
    assert "perseus_ext_autoload.pth" in names
    python = _venv_with(built["editable"], built["root"] / "venv-editable")
    printed = _check_output(python, "import sys, perseus_ext.data as d; "
                            "print(d.shipped_profile('gpt3-175b-a40')); print(d.patches_dir()); "
                            "print(sorted(m for m in sys.modules if m.startswith('perseus_ext')))")
    profile, patches, modules = printed.splitlines()
    assert Path(profile).is_file() and Path(profile).is_relative_to(built["source"])
    assert (Path(patches) / "megatron-lm" / "README.md").is_file()
    assert modules == "['perseus_ext', 'perseus_ext.autoload', 'perseus_ext.data']"


@pytest.mark.parametrize("autoload, marker", [("1", "_perseus_wrapped"), ("0", "_perseus_watched")])
def test_autoload_hooks_deepspeed_only_when_it_is_imported(built, autoload, marker) -> None:
    python = built["root"] / "venv-wheel" / "bin" / "python"
    if not python.exists():
        python = _venv_with(built["wheel"], built["root"] / "venv-wheel")
    fake = built["root"] / f"fake-deepspeed-{autoload}"
    (fake / "deepspeed").mkdir(parents=True)
    (fake / "deepspeed" / "__init__.py").write_text(FAKE_DEEPSPEED)
    code = (
        "import sys\n"
        "loaded = sorted(m for m in sys.modules if m.startswith('perseus_ext'))\n"
        "assert loaded == ['perseus_ext', 'perseus_ext.autoload'], loaded\n"
        "import deepspeed\n"
        f"assert getattr(deepspeed.initialize, {marker!r}, False)\n"
        "deepspeed.initialize(config={'perseus': {'enabled': True}}) if "
        f"{autoload!r} == '0' else None\n"
    )
    printed = _check_output(python, code, PERSEUS_AUTOLOAD=autoload, PYTHONPATH=str(fake))
    warned = "enables \"perseus\" but perseus-ext is not attached" in printed
    assert warned is (autoload == "0")


def test_autoload_line_does_nothing_where_the_package_cannot_be_imported(tmp_path) -> None:
    """The `.pth` line runs in every interpreter of the environment, also in pip's own while it
    reinstalls the package, or after an uninstall that left the line behind: where perseus_ext
    cannot be imported it must do nothing (the plain `import` line printed a traceback and
    "Remainder of file ignored" in each such process); where it can, it adds the hook."""
    site_dir = tmp_path / "site"
    site_dir.mkdir()
    shutil.copy(SOURCE / "perseus_ext_autoload.pth", site_dir)
    code = (f"import site, sys; site.addsitedir({str(site_dir)!r}); "
            "print(any(type(f).__name__ == 'DeepSpeedImportHook' for f in sys.meta_path))")

    def start(**env: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True,
                              timeout=60, cwd=tmp_path, env=_clean_env(**env))

    gone = start()
    assert (gone.returncode, gone.stderr, gone.stdout.strip()) == (0, "", "False")
    present = start(PYTHONPATH=str(SOURCE))
    assert (present.returncode, present.stderr, present.stdout.strip()) == (0, "", "True")


def test_autoload_costs_next_to_nothing_at_start_up(built) -> None:
    """The `.pth` hook runs in every Python process of the environment: it may load only its
    own two small modules, nothing the interpreter would not load anyway, and those in well
    under a millisecond or two (`-X importtime`, best of 5). A wall-clock ratio of
    `python -c pass` with and without the hook was this test's first form; on the shared
    machine its best-of-15 timings jumped between 8 and 16 ms either way."""
    python = built["root"] / "venv-wheel" / "bin" / "python"
    if not python.exists():
        python = _venv_with(built["wheel"], built["root"] / "venv-wheel")
    hook = _site_packages(python) / "perseus_ext_autoload.pth"
    parked = hook.with_suffix(".off")
    code = "import sys; print(' '.join(sorted(sys.modules)))"

    def start_up() -> tuple[set[str], dict[str, int]]:
        """Modules loaded by `python -c pass` and the import time (us) of each, cumulative."""
        result = subprocess.run([str(python), "-X", "importtime", "-c", code], check=True,
                                env=_clean_env(), timeout=60, capture_output=True, text=True)
        micros = {}
        for line in result.stderr.splitlines():
            fields = line.removeprefix("import time:").split("|")
            if len(fields) == 3 and fields[1].strip().isdigit():
                micros[fields[2].strip()] = int(fields[1])
        return set(result.stdout.split()), micros

    with_hook, _ = start_up()
    try:
        hook.rename(parked)
        without_hook, _ = start_up()
    finally:
        if parked.exists():
            parked.rename(hook)
    # `from __future__ import annotations` loads __future__ (a table of flags, ~0.1 ms)
    assert with_hook - without_hook <= {"perseus_ext", "perseus_ext.autoload", "__future__"}
    assert {"perseus_ext", "perseus_ext.autoload"} <= with_hook
    best = min(start_up()[1].get("perseus_ext.autoload", 0) for _ in range(5))
    print(f"perseus_ext.autoload imports in {best} us (cumulative, best of 5)")
    assert 0 < best < 2000


def test_unattached_section_warns_until_install_is_called(caplog) -> None:
    from types import SimpleNamespace

    from perseus_ext.adapters.deepspeed import install, warn_if_unattached
    from perseus_ext.errors import ConfigError

    config = {"perseus": {"enabled": True}}
    fake = SimpleNamespace(initialize=lambda **kwargs: (SimpleNamespace(_config=SimpleNamespace(
        _param_dict=kwargs["config"])), None, None, None))
    warn_if_unattached(fake)
    warn_if_unattached(fake)  # idempotent: one wrapper
    with caplog.at_level("WARNING", logger="perseus_ext.adapters.deepspeed"):
        fake.initialize(config=config)
    assert [r.getMessage().count("not attached") for r in caplog.records] == [1]
    caplog.clear()
    install(fake)  # now the section is checked (and this non-pipeline model rejected); no warning
    with pytest.raises(ConfigError, match="PipelineModule"):
        fake.initialize(config=config)
    assert not caplog.records
