"""README.md and docs/ quote no figure that their source does not hold.

Two kinds of figure, two checks:

- the answer table at the top of README.md is generated from results/ (``nnsight_repro.answer_table``): it must be
  what the generator makes from the committed results today;
- any other figure in README.md or docs/*.md must share its block (a paragraph, a list item with its lines, or a
  table or list with the block just above it) with a link to a file or folder under results/, and that file (or
  one in the folder) must contain the number. A figure is a number with a unit (``54.72 s``, ``78.8x``,
  ``14419 MiB``), a decimal with two or more places (``0.037``), a count ``N of M`` / ``N/M``, or any other number
  of two or more digits (``689 architectures``); single digits, fenced code, inline code, link targets and
  version numbers are not figures. A fact of the code rather than of a run is written without a figure.

A figure measured by hand and committed nowhere has no place in the docs: link its results file or drop it.
Also here: the README's limits (size, the panel answered in its first 40 lines, the commands CI and other
tools run, verbatim) and that every relative link in README.md and docs/ resolves.
"""

import re
from pathlib import Path

import pytest

from nnsight_repro import answer_table, models

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))

UNIT = r"(?:ms|s|min|h|MiB|GiB|KiB|MB|GB|KB|kB|bytes|x|×|%|core-seconds|core-s)"
WITH_UNIT = re.compile(r"(?<![\w.\-/])(\d[\d,]*(?:\.\d+)?)\s?" + UNIT + r"(?![\w])")
DECIMAL = re.compile(r"(?<![\w.\-/])(\d+\.\d{2,})(?![\w.]|\.\d)")
COUNT = re.compile(r"(?<![\w.\-/])(\d+)(?: of |/)(\d+)(?![\w.])")
#: A bare number of two or more digits (``689 architectures``): a count someone could copy by hand.
INTEGER = re.compile(r"(?<![\w.\-/#])(\d{2,}[\d,]*)(?![\w.\-/]|\.\d)")
#: A number right after one of these words is a version or a name (``Python ≥ 3.11``, ``transformers 5.23``,
#: ``PEP 440``), not a measurement.
VERSION_BEFORE = re.compile(
    r"(?:Python|python3?|Ray|ray|nnsight|ndif|transformers|torch|multimolecule|redis-py|uv|PEP|version|≥|>=|<=|<|>|v)\s*$")
LINK = re.compile(r"\[([^\]]*)\]\(([^)\s]+)\)")


def prose(text: str) -> str:
    """``text`` with what is not prose blanked out, line for line: fenced code, HTML comments, inline code,
    and link targets (a link's text stays)."""
    text = re.sub(r"```.*?```", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S)
    text = re.sub(r"<!--.*?-->", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S)
    text = re.sub(r"`[^`\n]*`", "``", text)
    return LINK.sub(lambda m: f"[{m.group(1)}]()", text)


def blocks(lines):
    """(first, last) line index of each block: lines between blank lines. A table's or a list's block also
    takes in the block just above it (unless that is a heading), where its caption and source link sit."""
    found, first = [], None
    for index, line in enumerate(lines + [""]):
        if line.strip() and first is None:
            first = index
        elif not line.strip() and first is not None:
            if lines[first].lstrip().startswith(("|", "- ")) and found and not lines[found[-1][1]].lstrip().startswith("#"):
                found[-1] = (found[-1][0], index - 1)
            else:
                found.append((first, index - 1))
            first = None
    return found


def figures(line: str):
    """The figures of one line of prose: (as written, the numbers its source must hold)."""
    found = [(m.group(0), [m.group(1), m.group(2)]) for m in COUNT.finditer(line)]
    for pattern in (WITH_UNIT, DECIMAL, INTEGER):
        for match in pattern.finditer(line):
            number = match.group(1).replace(",", "")
            if VERSION_BEFORE.search(line[: match.start()]) or any(number in seen for _, seen in found):
                continue
            found.append((match.group(0).strip(), [number]))
    return found


def results_files(doc: Path, text: str, root: Path):
    """The files under ``root``/results that the links of ``text`` name (a folder: every file in it)."""
    files = []
    for _, target in LINK.findall(text):
        path = target.split("#")[0]
        if not path or "://" in path:
            continue
        resolved = (doc.parent / path).resolve()
        if resolved != root / "results" and root / "results" not in resolved.parents:
            continue
        if resolved.is_dir():
            files += sorted(p for p in resolved.rglob("*") if p.suffix in (".json", ".md"))
        elif resolved.is_file():
            files.append(resolved)
    return files


def holds(files, number: str) -> bool:
    token = re.compile(r"(?<![\d.])" + re.escape(number) + r"(?!\d)")
    return any(token.search(f.read_text(errors="replace")) for f in files)


def disagreements(doc: Path, text: str, root: Path = ROOT):
    """Every figure of ``text`` (the contents of ``doc``) with no results link in its block, or not in the
    files it links."""
    if answer_table.START in text and answer_table.END in text:
        # The generated table is checked by regenerating it, not figure by figure.
        start, end = text.index(answer_table.START), text.index(answer_table.END)
        text = text[:start] + "\n" * text[start:end].count("\n") + text[end:]
    raw, cleaned = text.split("\n"), prose(text).split("\n")
    name = doc.relative_to(root) if root in doc.parents else doc.name
    problems = []
    for first, last in blocks(cleaned):
        files = None
        for line in cleaned[first: last + 1]:
            for shown, numbers in figures(line):
                if files is None:
                    files = results_files(doc, "\n".join(raw[first: last + 1]), root)
                if not files:
                    problems.append(f"{name}: {shown!r} has no link to a results file in its block")
                elif not all(holds(files, n) for n in numbers):
                    problems.append(f"{name}: {shown!r} is in none of {[str(f.relative_to(root)) for f in files]}")
    return problems


def test_the_answer_table_is_what_the_results_say():
    assert answer_table.current(README.read_text()) == answer_table.render(), (
        "README.md's answer table differs from the committed results: python3 -m nnsight_repro.answer_table --write")


@pytest.mark.parametrize("doc", [README, *DOCS], ids=lambda p: str(p.relative_to(ROOT)))
def test_every_figure_is_in_the_results_file_it_links(doc):
    assert disagreements(doc, doc.read_text()) == []


def test_a_figure_that_disagrees_with_its_source_is_caught(tmp_path):
    # A doc beside a results folder of its own: a right figure, a wrong one, one with no link, and non-figures.
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "run.json").write_text('{"cold_start_s": 54.72, "ratio": 78.8, "ok": 28, "of": 30}')
    (tmp_path / "docs").mkdir()
    doc = tmp_path / "docs" / "page.md"

    def check(text):
        return disagreements(doc, text, root=tmp_path)

    assert check("Cold start 54.72 s, 78.8x, 28 of 30 ([run](../results/run.json)).\n") == []
    assert sorted(check("| a | b |\n|---|---|\n| 54.72 s | 28/30 |\n")) == [
        "docs/page.md: '28/30' has no link to a results file in its block",
        "docs/page.md: '54.72 s' has no link to a results file in its block"]
    assert check("From [run](../results/):\n\n| a |\n|---|\n| 54.72 s |\n") == []
    assert check("Cold start 29.07 s ([run](../results/run.json)).\n") == [
        "docs/page.md: '29.07 s' is in none of ['results/run.json']"]
    assert check("It took 12.5 min.\n\nSee [run](../results/run.json).\n") == [
        "docs/page.md: '12.5 min' has no link to a results file in its block"]
    assert check("From [run](../results/run.json):\n\n- 28 architectures\n- 54.72 s\n") == []
    assert check("- 689 architectures\n") == ["docs/page.md: '689' has no link to a results file in its block"]
    assert check("nnsight 0.7.0, Python ≥ 3.11, transformers 5.23, PEP 440, `--batch 15 --timeout 600 s`, ndif "
                 "0.1.2, 2 layers, A1–A14, [ray#63202](https://github.com/ray-project/ray/issues/63202).\n"
                 "```\ntook 29.07 s\n```\n") == []


def test_the_readme_is_short():
    assert len(README.read_bytes()) <= 12_000


def test_the_first_40_lines_answer_for_every_panel_model():
    top = "\n".join(README.read_text().split("\n")[:40])
    assert answer_table.START in top
    missing = [name for name in models.extended() if f"`{name}` |" not in top]
    assert missing == []


@pytest.mark.parametrize("command", [
    "python3 -m nnsight_repro test",  # .ci/run runs it; benchmarks/bench_setup.py times it
    "python3 -m nnsight_repro verify",
    "pytest tests/test_envoy_overloaded_mount.py",
    "modal run modal_verify_patch.py",
    "python3 scripts/ndif_feasibility/probe_ndif.py",
    "python3 -m nnsight_repro preflight",
    'python3 -m nnsight_repro wheel --python "$(which python)"',
])
def test_the_readme_keeps_the_commands_others_run(command):
    assert command in README.read_text()


@pytest.mark.parametrize("doc", [README, *DOCS], ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(doc):
    broken = []
    for _, target in LINK.findall(re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)):
        path = target.split("#")[0]
        if path and "://" not in path and not path.startswith("mailto:") and not (doc.parent / path).exists():
            broken.append(target)
    assert broken == []
