"""Every measured figure in README.md and docs/*.md names the results file it comes from, and
is found in it. No cluster needed.

The rule:

* A *figure* is a number with a measurement unit: s, ms, µs, min, minutes, h, hours, seconds,
  tok/s, tokens/s, req/s, MB/s, Mbit/s, KiB, MiB, GiB, kB, MB, GB, %, × or x as a ratio (not
  "2048 × 16"), °C, W, J. "s" and "h" need a space before them ("404s" is not a figure). A
  range (1.7–3.1 min) is one figure with two numbers. Numbers in code (fenced blocks,
  `inline code`) and in URLs are not figures: those are commands, config values and messages.
* A figure's *block* is its paragraph, list item (with its indented continuation), table row or
  heading. A block's citations are the `bench/results/NAME.md|json|png` paths (also
  `NAME.{md,json}`; `NAME.md@COMMIT` for the file as that commit wrote it, e.g. a "before"
  figure) written in the block, in the paragraph that introduces its list or table (the one
  right before it), and in the headings of the sections it sits in.
* Every cited results file exists, and every block with a figure cites at least one.
* Every figure is found in one of its block's cited .md/.json files. Found means: some number
  in the file, thousands separators ignored (1,017 = 1017), rounds to the figure at the
  figure's own precision (1.14 matches 1.144, 66 matches 65.6, 3.6 does not match 3.7), or
  does so after a unit change (ms = s × 1000, s = ms / 1000, min = s / 60, h = s / 3600).
  A percentage must be written as one in the file too ("16 %" is not found in "16 clients").
  "~" and "≈" are ignored.
* A block whose figures are not measurements (settings, defaults, limits, goals, arithmetic
  from a rule, a datasheet's numbers) says so with the marker `<!-- not measured: why -->`.
  It covers its own block, or, written in the paragraph that introduces a list or table, that
  list or table too. A block with a measured figure never carries it: cite the results file,
  or drop the figure.

What this cannot see: a measured figure written without a unit (a count such as "34 ok"), and
a small integer that some other number of the cited file happens to round to.
"""

from __future__ import annotations

import bisect
import json
import re
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

NUMBER = r"\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?"
# Longest first, so "tok/s" is not read as "s"; "s" and "h" only after a space.
UNIT = (
    r"(?:\s?(?:tok/s|tokens/s|req/s|MB/s|Mbit/s|KiB|MiB|GiB|kB|MB|GB|ms|µs|°C|%|W|J"
    r"|minutes|min|hours|seconds)"
    r"|\s(?:s|h)"
    r"|\s?[×x](?!\s?\d))"
)
FIGURE = re.compile(
    rf"(?<![\w.,#-])[~≈]?(?P<low>{NUMBER})(?:\s?[–-]\s?(?P<high>{NUMBER}))?(?P<unit>{UNIT})"
    r"(?!\w)"
)
FILE_NUMBER = re.compile(rf"(?<![\w.])(?:{NUMBER})")
PERCENT_NUMBER = re.compile(rf"(?<![\w.])({NUMBER})\s?%")
CITATION = re.compile(
    r"bench/results/(?P<stem>[\w-]+)\.(?P<ext>\{[\w,]+\}|md|json|png)(?:@(?P<commit>[0-9a-f]{7,40}))?"
)
MARKER = re.compile(r"<!--\s*not measured\b.*?-->", re.DOTALL)
COMMENT_LINE = re.compile(r"\s*<!--.*-->\s*")
CODE_SPAN = re.compile(r"`[^`]*`")
URL = re.compile(r"https?://\S+")
ITEM = re.compile(r"\s*(?:[-*+]|\d+\.)\s")


@dataclass
class Block:
    """A paragraph, list item, table row or heading, with what it inherits."""

    path: Path
    line: int
    text: str
    lead_in: str = ""  # the paragraph that introduces this block's list or table
    headings: tuple[str, ...] = ()

    def citations(self) -> list[Source]:
        return cited(" ".join([self.text, self.lead_in, *self.headings]))

    def exempt(self) -> bool:
        return bool(MARKER.search(self.text) or MARKER.search(self.lead_in))


@dataclass
class _Parser:
    """Splits a Markdown file into blocks (fenced code dropped)."""

    path: Path
    blocks: list[Block] = field(default_factory=list)
    headings: dict[int, str] = field(default_factory=dict)
    current: Block | None = None
    group: str = ""  # "list", "table" or "" (plain paragraphs)
    lead_in: str = ""
    last_paragraph: str = ""
    blank_before: bool = False

    def close(self) -> None:
        if self.current is not None:
            self.blocks.append(self.current)
            if not self.group:
                self.last_paragraph = self.current.text
        self.current = None

    def start(self, line_no: int, text: str, group: str) -> None:
        self.close()
        if group != self.group:
            # A list or table is introduced by the paragraph right before it, once.
            self.lead_in, self.last_paragraph = (self.last_paragraph if group else ""), ""
            self.group = group
        heads = tuple(self.headings[k] for k in sorted(self.headings))
        self.current = Block(self.path, line_no, text, self.lead_in, heads)

    def heading(self, line_no: int, line: str) -> None:
        level = len(line) - len(line.lstrip("#"))
        self.headings = {k: v for k, v in self.headings.items() if k < level}
        self.start(line_no, line, "")
        self.headings[level] = line
        self.close()
        self.last_paragraph = ""

    def continues(self, line: str) -> bool:
        """A line that goes on with the current block: the next line of a paragraph, or an
        indented one of a list item, even after a blank line."""
        return not self.blank_before or (self.group == "list" and line.startswith("  "))

    def feed(self, line_no: int, line: str) -> None:
        if not line.strip():
            self.blank_before = True
            if self.group != "list":
                self.close()
            return
        if COMMENT_LINE.fullmatch(line) and not MARKER.search(line):
            return  # e.g. a generated table's <!-- begin --> line: no content
        if line.startswith("#"):
            self.heading(line_no, line)
        elif line.startswith("|"):
            if not re.fullmatch(r"[|\s:-]+", line):
                self.start(line_no, line, "table")
        elif ITEM.match(line):
            self.start(line_no, line, "list")
        elif self.current is not None and self.continues(line):
            self.current.text += "\n" + line
        else:
            self.start(line_no, line, "")
        self.blank_before = False


def blocks(path: Path) -> list[Block]:
    parser = _Parser(path)
    fenced = False
    for line_no, line in enumerate(path.read_text().splitlines(), 1):
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
            continue
        if not fenced:
            parser.feed(line_no, line)
    parser.close()
    return parser.blocks


@dataclass(frozen=True)
class Source:
    """A cited results file, as the tree has it or, with `@commit`, as that commit wrote it."""

    path: str  # bench/results/NAME.EXT
    commit: str | None = None

    def __str__(self) -> str:
        return f"{self.path}@{self.commit}" if self.commit else self.path


@cache
def read(source: Source) -> str | None:
    """The file's text (undecodable bytes replaced: a .png only has to be there); None when it
    is not there."""
    if source.commit is None:
        file = REPO / source.path
        return file.read_text(errors="replace") if file.is_file() else None
    shown = subprocess.run(
        ["git", "-C", str(REPO), "show", f"{source.commit}:{source.path}"],
        capture_output=True,
        check=False,
    )
    return shown.stdout.decode(errors="replace") if shown.returncode == 0 else None


def cited(text: str) -> list[Source]:
    sources = []
    for match in CITATION.finditer(text):
        for ext in match["ext"].strip("{}").split(","):
            sources.append(Source(f"bench/results/{match['stem']}.{ext}", match["commit"]))
    return list(dict.fromkeys(sources))


@dataclass(frozen=True)
class Figure:
    text: str
    numbers: tuple[str, ...]
    unit: str


def figures(text: str) -> Iterator[Figure]:
    prose = URL.sub(" ", CODE_SPAN.sub(" ", MARKER.sub(" ", text)))
    for match in FIGURE.finditer(prose):
        numbers = tuple(n for n in (match["low"], match["high"]) if n)
        yield Figure(match[0].strip(), numbers, match["unit"].strip())


@cache
def file_numbers(source: Source, percent: bool) -> list[float]:
    """The numbers written in a results file, sorted (JSON: every number, in values or keys);
    with `percent`, only those written as percentages ("97%", "2 %")."""
    text = read(source) or ""
    if source.path.endswith(".json") and text:
        text = json.dumps(json.loads(text))
    pattern = PERCENT_NUMBER if percent else FILE_NUMBER
    return sorted(float(n.replace(",", "")) for n in pattern.findall(text))


# File value × scale is compared with the figure: a figure in ms or minutes may come from a
# file in seconds.
SCALES = {
    "ms": (1, 1000),
    "s": (1, 0.001),
    "min": (1, 1 / 60),
    "minutes": (1, 1 / 60),
    "h": (1, 1 / 3600),
    "hours": (1, 1 / 3600),
}


def found(number: str, unit: str, files: list[Source]) -> bool:
    value = float(number.replace(",", ""))
    decimals = len(number.partition(".")[2])
    tolerance = 0.5 * 10**-decimals + 1e-9
    for source in files:
        values = file_numbers(source, unit == "%")
        for scale in SCALES.get(unit, (1,)):
            low = bisect.bisect_left(values, (value - tolerance) / scale)
            if low < len(values) and values[low] <= (value + tolerance) / scale:
                return True
    return False


def problems(path: Path) -> list[str]:
    out = []
    rel = path.relative_to(REPO) if path.is_relative_to(REPO) else path
    for block in blocks(path):
        where = f"{rel}:{block.line}"
        out += [
            f"{where}: cites {s}, which is not there" for s in cited(block.text) if read(s) is None
        ]
        if block.exempt():
            continue
        sources = block.citations()
        readable = [s for s in sources if not s.path.endswith(".png") and read(s)]
        for figure in figures(block.text):
            if not sources:
                out.append(f"{where}: {figure.text!r} cites no bench/results file")
            elif not all(found(n, figure.unit, readable) for n in figure.numbers):
                names = ", ".join(map(str, readable)) or "no .md/.json"
                out.append(f"{where}: {figure.text!r} is not in {names}")
    return out


@pytest.mark.parametrize("path", DOCUMENTS, ids=[str(p.relative_to(REPO)) for p in DOCUMENTS])
def test_every_figure_is_in_the_results_file_it_cites(path: Path) -> None:
    wrong = problems(path)
    assert not wrong, "\n".join(wrong)


# The rule on a sample, against a results file as a commit wrote it (it never changes).
SAMPLE = """\
A burst: 1.144 s here against 1.275 s (`bench/results/runtime_bench.md@3d16d76`).

A burst: 1.244 s (`bench/results/runtime_bench.md@3d16d76`).

The spin cost 16 % (`bench/results/runtime_bench.md@3d16d76`).

Unsourced: 20.9 s.

Settings: every 0.25 s. <!-- not measured: settings -->

The table (`bench/results/runtime_bench.md@3d16d76`):

| server | tok/s |
|---|---|
| ember | 77.7 tok/s |
| ember | 78.7 tok/s |
"""


def test_the_rule_finds_a_wrong_figure_an_unsourced_one_and_a_stray_percentage(
    tmp_path: Path,
) -> None:
    doc = tmp_path / "sample.md"
    doc.write_text(SAMPLE)
    assert [p.partition(": ")[2] for p in problems(doc)] == [
        "'1.244 s' is not in bench/results/runtime_bench.md@3d16d76",
        "'16 %' is not in bench/results/runtime_bench.md@3d16d76",
        "'20.9 s' cites no bench/results file",
        "'78.7 tok/s' is not in bench/results/runtime_bench.md@3d16d76",
    ]
