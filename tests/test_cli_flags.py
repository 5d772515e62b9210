"""Every command-line mistake names its flag, before anything is launched or read."""

from __future__ import annotations

import pytest

from perseus_ext.cli import main


@pytest.mark.parametrize("argv, expected", [
    (["demo", "--output", "/proc/no/such"], "--output /proc/no/such: cannot write there"),  # was [Errno 2] after launching
    (["demo", "--stages", "30", "--pipelines", "16"], "--stages 30 x --pipelines 16 is 480 processes"),  # was launched
    (["demo", "--slowdown", "nan"], "argument --slowdown: nan is out of range"),  # was accepted
    (["demo", "--timeout", "-1"], "argument --timeout: -1 is out of range"),  # was accepted
    (["demo", "--iterations", "10"], "argument --iterations: 10 is out of range: use 40.."),
    (["batch-size", "x.db", "--timeout", "0"], "argument --timeout: 0 is out of range"),
])
def test_a_flag_mistake_names_the_flag(argv, expected, capsys):
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse's own refusal
        code = exit_.code
    err = capsys.readouterr().err
    assert code == 2 and expected in err and "Traceback" not in err
