"""What a user reads says what the program does now, not how it got there.

Why: the documentation used to be a lab notebook (benchmark runs by date and time of day,
"main before it", issue and stop numbers, commit hashes, paths of a development machine), and
code comments carried benchmark diaries too. History lives in git. These tests scan README,
every document under docs/ and examples/, and the comments and docstrings of the package, and
fail with the file:line of every diary phrase; and they keep the tables that restate the code
(the solver's option bounds and defaults, the command list) equal to the code.
"""

from __future__ import annotations

import dataclasses
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# (pattern, why it is a diary phrase); case-insensitive, matched line by line
DIARY = [
    (r"\bstop \d+\b|\bthis stop\b|\bstop's\b", "a development stop"),
    (r"\bsessions?\b", "a development session"),
    (r"\bissues? #?\d+\b", "an issue number"),
    (r"\bmain (before|at|between)\b", "a state of the main branch"),
    (r"\b\d\d?:\d\d(-\d\d?:\d\d)? UTC\b", "a time of day"),
    (r"\b20\d\d-[01]\d-[0-3]\d\b", "a date"),
    (r"\b\d\d? (Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec)\b", "a date"),
    (r"\bcommits? [0-9a-f]{7,40}\b|<[0-9a-f]{7,40} checkout>", "a commit"),
    # a short hash; a full 40-digit one pins an upstream release (patches/megatron-lm/README.md)
    (r"(?<![\w/-])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,12}\b", "a commit hash"),
    (r"(?<![\w.])/(work|tmp)/", "a machine path"),
    (r"\b(the )?code (of|before) (this|the) change\b|\bbefore this change\b", "a change's history"),
]
DIARY_RE = [(re.compile(pattern, re.IGNORECASE), why) for pattern, why in DIARY]
# a POSIX session (setsid) is not a development one
TECHNICAL = re.compile(r"(own|new|process|login) session|start_new_session|setsid", re.IGNORECASE)
# benchmark diaries in code comments: "1.05 of the wall time", "178 against 169 ms"
COMMENT_DIARY = [
    (re.compile(r"\d(\.\d+)? of the (wall|CPU) time", re.IGNORECASE), "a benchmark result"),
    (re.compile(r"\d(\.\d+)? ?(ms|µs|us|s|MiB)? against \d+(\.\d+)? ?(ms|µs|us|s|MiB)\b"), "a benchmark result"),
]


def _diary_hits(line: str, patterns=DIARY_RE) -> list[str]:
    hits = []
    for pattern, why in patterns:
        for match in pattern.finditer(line):
            if why == "a development session" and TECHNICAL.search(line):
                continue
            hits.append(f"{why}: {match.group(0)!r}")
    return hits


def _prose_lines(path: Path) -> list[tuple[int, str]]:
    """A markdown file's lines outside fenced code blocks (commands there may use /tmp)."""
    lines, fenced = [], False
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            lines.append((number, line))
    return lines


def _documents() -> list[Path]:
    paths = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")),
             *sorted((ROOT / "examples").glob("*/README.md")), *sorted((ROOT / "benchmarks").glob("*.md")),
             *sorted((ROOT / "patches").rglob("*.md"))]
    return [path for path in paths if path.is_file()]


def _comment_lines(path: Path) -> list[tuple[int, str]]:
    """A Python file's comments and docstrings (strings that open a statement), line by line."""
    text = path.read_text(encoding="utf-8")
    lines: list[tuple[int, str]] = []
    opens_statement = True  # the next token starts a statement
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type == tokenize.COMMENT:
            lines.append((token.start[0], token.string))
            continue
        if token.type == tokenize.STRING and opens_statement:
            lines += [(token.start[0] + k, line) for k, line in enumerate(token.string.splitlines())]
        opens_statement = token.type in (tokenize.NEWLINE, tokenize.NL, tokenize.INDENT, tokenize.DEDENT)
    return lines


def _report(hits: list[str]) -> str:
    return f"{len(hits)} development-diary phrase(s); history belongs in git:\n" + "\n".join(hits)


def test_the_scanners_see_what_they_scan(tmp_path):
    """The scans cover real files, and each pattern catches the phrase it is for."""
    assert len(_documents()) >= 10 and (ROOT / "README.md") in _documents()
    assert len(list((ROOT / "perseus_ext").rglob("*.py"))) >= 50
    for phrase in ("Stop 30 (26 Nov 17:10-18:00 UTC)", "this stop's code", "a later session",
                   "issue 29", "main before it", "at 16:18 UTC", "2026-11-26", "at commit 179bcb1",
                   "`<2bb61ae checkout>`", "kept in /work/coord/gpu/run4/", "--output /tmp/demo-out",
                   "side by side with the code before this change"):
        assert _diary_hits(phrase), phrase
    for phrase in ("It runs in its own session and ignores SIGINT", "a 2-core CPU machine",
                   "perseus-ext frontier --profile gpt3-175b-a100_sxm --microbatches 24",
                   "python benchmarks/solver.py --microbatches 24 --repeats 12", "1f1b 8 × 96",
                   "sha256 of the file", "GPU-5f6e7d8c",
                   "tag core_v0.16.1 (commit `55ac7082517c3878ae653c07c09c534b8aed49f6`)"):
        assert not _diary_hits(phrase), phrase
    source = '"""Docstring: 1.05 of the wall time."""\nx = "178 against 169 ms"  # 178 against 169 ms\n'
    sample = tmp_path / "sample.py"
    sample.write_text(source, encoding="utf-8")
    found = [number for number, line in _comment_lines(sample) if _diary_hits(line, COMMENT_DIARY)]
    assert found == [1, 2]  # the docstring and the comment, not the string value
    document = tmp_path / "sample.md"
    document.write_text("Prose at 16:18 UTC.\n```bash\npython x.py --output /tmp/out\n```\n", encoding="utf-8")
    assert [number for number, _ in _prose_lines(document)] == [1]  # commands in fences may use /tmp


def test_docs_carry_no_development_diary():
    hits = [f"{path.relative_to(ROOT)}:{number}: {hit}: {line.strip()[:120]}"
            for path in _documents() for number, line in _prose_lines(path) for hit in _diary_hits(line)]
    assert not hits, _report(hits)


def test_docs_name_no_development_machine_path_even_in_code_blocks():
    hits = [f"{path.relative_to(ROOT)}:{number}: {line.strip()[:120]}"
            for path in _documents()
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
            if re.search(r"(?<![\w.])/work/", line)]
    assert not hits, _report(hits)


def test_code_comments_carry_no_development_diary():
    hits = [f"{path.relative_to(ROOT)}:{number}: {hit}: {line.strip()[:120]}"
            for path in sorted((ROOT / "perseus_ext").rglob("*.py"))
            for number, line in _comment_lines(path)
            for hit in _diary_hits(line) + _diary_hits(line, COMMENT_DIARY)]
    assert not hits, _report(hits)


def test_development_material_is_not_shipped_as_docs():
    assert not (ROOT / "docs" / "helpers").exists()


# --------------------------------------------------------------------------- tables that restate code
def _table_after(path: Path, header: str) -> list[list[str]]:
    lines = path.read_text(encoding="utf-8").splitlines()
    start = lines.index(header) + 2  # past the header and its |---| row
    rows = []
    while start < len(lines) and lines[start].startswith("|"):
        cells = re.split(r"(?<!\\)\|", lines[start].strip().strip("|"))  # `\|` is a pipe inside a cell
        rows.append([cell.strip() for cell in cells])
        start += 1
    return rows


def _number(text: str) -> float:
    return float(text.strip("`").replace(",", ""))


def test_the_solver_bounds_table_in_deepspeed_md_is_the_solver_s():
    """docs/deepspeed.md's `solver` table lists every SolverOptions field with the bounds the
    config door applies (the solver's own) and the solver's default."""
    from perseus_ext.planning.options import BOUNDS, SolverOptions

    rows = _table_after(ROOT / "docs/deepspeed.md", "| `solver` key | bounds | default |")
    defaults = SolverOptions()
    assert [row[0].strip("`") for row in rows] == [f.name for f in dataclasses.fields(SolverOptions)]
    for name, bounds, default in rows:
        name = name.strip("`")
        value = getattr(defaults, name)
        if isinstance(value, bool):
            assert (bounds, default) == ("true or false", f"`{str(value).lower()}`"), name
            continue
        assert _number(default) == value, name
        shown = re.fullmatch(r"(integer|number) in \[(\S+), (\S+)\]", bounds)
        assert shown and shown.group(1) == ("integer" if isinstance(value, int) else "number"), (name, bounds)
        assert (_number(shown.group(2)), _number(shown.group(3))) == BOUNDS[name], name


def test_the_options_table_in_solver_md_has_the_solver_s_defaults():
    from perseus_ext.planning.options import SolverOptions

    rows = _table_after(ROOT / "docs/solver.md", "| field | default | allowed | meaning |")
    defaults = SolverOptions()
    assert [row[0].strip("`") for row in rows] == [f.name for f in dataclasses.fields(SolverOptions)]
    for row in rows:
        value = getattr(defaults, row[0].strip("`"))
        if isinstance(value, bool):
            assert row[1] == str(value).lower(), row
        else:
            assert _number(row[1]) == value, row


def test_readme_s_command_table_names_every_command():
    from perseus_ext.cli import COMMAND_MODULES

    rows = _table_after(ROOT / "README.md", "| command | what it does |")
    documented = [re.match(r"`perseus-ext ([\w-]+)", row[0]).group(1) for row in rows]
    assert sorted(documented) == sorted(COMMAND_MODULES), (
        f"README's command table: missing {sorted(set(COMMAND_MODULES) - set(documented))}, "
        f"unknown or twice {sorted(set(documented) - set(COMMAND_MODULES))}")


@pytest.mark.parametrize("document", ["README.md", "docs/deepspeed.md"])
def test_generated_key_tables_describe_straggler_checks_as_they_run(document):
    """The key tables come from the model's descriptions (tests/test_config.py keeps them equal);
    a straggler check is two small all-reduces and a broadcast, not an all-gather."""
    rows = {row[0]: row[2] for row in _table_after(ROOT / document, "| key | type / default | meaning |")}
    assert "all-gather" not in rows["`straggler_check_interval`"]


def test_links_between_documents_resolve():
    """Every relative link in README and the docs names a file that exists (documents move)."""
    links = [(path, number, target) for path in _documents()
             for number, line in _prose_lines(path)
             for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", line)
             if not re.match(r"[a-z]+:", target)]
    assert len(links) >= 10
    broken = [f"{path.relative_to(ROOT)}:{number}: {target}" for path, number, target in links
              if not (path.parent / target).exists()]
    assert not broken, "links to missing files:\n" + "\n".join(broken)


def test_every_benchmark_is_listed_with_its_command():
    """benchmarks/README.md names every script there, so each figure can be traced to the
    command that reproduces it."""
    listed = (ROOT / "benchmarks" / "README.md").read_text(encoding="utf-8")
    scripts = sorted(p.name for p in (ROOT / "benchmarks").iterdir() if p.suffix in (".py", ".sh"))
    assert len(scripts) >= 10
    missing = [name for name in scripts if f"`{name}`" not in listed]
    assert not missing, f"benchmarks/README.md does not list {missing}"


def test_the_policy_key_table_s_defaults_are_the_models():
    """docs/policies.md's `perseus.policy` table: every default it states is the model's."""
    from perseus_ext.config.policy import (BatchSizeOptions, PolicySection, PowerLimitOptions,
                                           URLBudgetSource, URLCarbonSource)

    models = {"": [PolicySection], "power_limit": [PowerLimitOptions], "batch_size": [BatchSizeOptions],
              "carbon": [URLCarbonSource], "budget": [URLBudgetSource]}
    checked = []
    for row in _table_after(ROOT / "docs/policies.md", "| key | type / default | meaning |"):
        stated = re.search(r'default (`?"?)([\w.]+)"?`?', row[1])
        if not stated or stated.group(2) in ("the", "a", "an"):
            continue
        for key in re.findall(r"`([\w.]+)`", row[0]):
            section, _, name = key.rpartition(".")
            for model in models[section]:
                default = model.model_fields[name].default
                value = getattr(default, "value", default)  # a StrChoice's string
                if isinstance(value, str):
                    assert value == stated.group(2), (key, row[1])
                else:
                    assert float(value) == float(stated.group(2)), (key, row[1])
                checked.append(key)
    assert len(checked) >= 12, checked
