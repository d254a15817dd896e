"""Every code block of README.md and docs/*.md runs as written (#38.11).

Each ```` ```python ```` block runs in a fresh process and each ```` ```bash ```` block under
``bash -e -o pipefail``, in a scratch folder holding links to ``examples/`` and ``experiments/``, with
this checkout importable and ``flexsp``, ``python`` and ``torchrun`` taken from this interpreter. An
HTML comment on the line above a block (invisible on the rendered page, visible in the source) says
how to run it instead:

    <!-- snippet: skip (why) -->      not run: GPU-only, minutes long, or run by a named test; the reason is required
    <!-- snippet: torchrun N -->      a python block run on N gloo ranks under torchrun
    <!-- snippet: after -->           run after the page's previous python block, in one program (it uses its names)

Snippets keep their own sizes tiny, so a reader who copies one also gets a run of seconds.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

from scripts import experiment

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^([ \t]*)```(\w*)[^\n]*\n(.*?)^\1```[ \t]*$", re.S | re.M)   # list items indent theirs
DIRECTIVE = re.compile(r"<!--\s*snippet:\s*(.*?)\s*-->\s*$")
RUN = {"python", "bash"}
TIMEOUT = 300


@dataclass(frozen=True)
class Snippet:
    page: Path
    line: int
    language: str
    code: str
    directive: str = ""
    before: str = ""   # the page's previous python block(s), for ``after``

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    @property
    def skip(self) -> str | None:
        found = re.fullmatch(r"skip\s*\((.+)\)", self.directive)
        return found.group(1).strip() if found else None

    @property
    def ranks(self) -> int:
        found = re.search(r"torchrun\s+(\d+)", self.directive)
        return int(found.group(1)) if found else 1


def snippets(page: Path) -> list[Snippet]:
    """The runnable blocks of ``page``, each with the directive on the line above its fence."""
    text, out, program = page.read_text(), [], ""
    for match in FENCE.finditer(text):
        language = match.group(2)
        if language not in RUN:
            continue
        above = text[:match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        directive = DIRECTIVE.search(above)
        directive = directive.group(1) if directive else ""
        line = text.count("\n", 0, match.start()) + 1
        code = textwrap.dedent(match.group(3))
        before = program if language == "python" and "after" in [p.strip() for p in directive.split(",")] else ""
        if language == "python":
            program = before + code
        out.append(Snippet(page, line, language, code, directive, before))
    return out


ALL = [s for page in PAGES for s in snippets(page)]


def test_directives_are_known_and_skips_say_why():
    for s in ALL:
        if s.directive.startswith("skip"):
            assert re.fullmatch(r"skip\s*\(.{10,}\)", s.directive), f"{s.name}: a skip needs its reason: '{s.directive}'"
            continue
        for part in filter(None, (p.strip() for p in s.directive.split(","))):
            assert re.fullmatch(r"torchrun\s+\d+|after", part), f"{s.name}: unknown directive '{part}'"
    ran = [s for s in ALL if not s.skip]
    assert len(ran) >= 10 and {s.page.name for s in ran} >= {"README.md", "concepts.md", "design.md",
                                                               "huggingface.md", "training.md"}


def test_finds_fenced_blocks_and_their_directives(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("x\n\n```python\na = 1\n```\n\n<!-- snippet: torchrun 2, after -->\n```python\nprint(a)\n```\n\n"
                    "<!-- snippet: skip (needs a GPU, or 8 nodes) -->\n```bash\nflexsp x\n```\n```\noutput\n```\n")
    first, second, third = snippets(page)
    assert (first.code, first.before, second.before, second.ranks) == ("a = 1\n", "", "a = 1\n", 2)
    assert (third.language, third.skip, second.skip) == ("bash", "needs a GPU, or 8 nodes", None)


def _shims(folder: Path) -> None:
    """``flexsp``, ``python`` and ``torchrun`` on PATH, all this interpreter (with this checkout first)."""
    folder.mkdir()
    for name, target in (("flexsp", "-m flexsp"), ("python", ""), ("python3", ""),
                         ("torchrun", "-m torch.distributed.run")):
        shim = folder / name
        shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" {target} "$@"\n')
        shim.chmod(0o755)


@pytest.mark.parametrize("snippet", ALL, ids=[s.name for s in ALL])
def test_snippet_runs(snippet: Snippet, tmp_path):
    if snippet.skip:
        pytest.skip(snippet.skip)
    for name in ("examples", "experiments"):
        (tmp_path / name).symlink_to(ROOT / name)
    _shims(tmp_path / ".bin")
    launcher, env = experiment("launch").torchrun(snippet.ranks)
    env.update(PATH=f"{tmp_path / '.bin'}{os.pathsep}{env['PATH']}", MPLBACKEND="Agg")
    if snippet.language == "bash":
        command = ["bash", "-e", "-o", "pipefail", "-c", snippet.code]
    else:
        (tmp_path / "snippet.py").write_text(snippet.before + snippet.code)
        command = [*launcher, "snippet.py"]
    proc = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, f"{snippet.name} ({snippet.directive or 'plain'}) exited {proc.returncode}:\n" \
                                 f"{snippet.code}\n--- output ---\n{(proc.stdout + proc.stderr)[-4000:]}"
