"""The user-facing text stays free of working history, and the README stays a short product page.

Checked over every tracked text file (`git ls-files`; a walk of the tree where git or the repository is missing):
no "session N" phrase, which belongs in git history, not in docs, comments or configs. The README starts with the
two commands a new user needs, stays under its length budget, and every relative link in it names a file that
exists and, with a `#fragment`, a heading of that file.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SESSION_RE = re.compile(r"\bsession\s+\d+", re.IGNORECASE)
TEXT_SUFFIXES = {".md", ".py", ".sh", ".yaml", ".yml", ".toml"}
TEXT_NAMES = {"Makefile"}
SKIP_DIRS = {".git", ".venv", "node_modules", "__pycache__", ".ruff_cache", ".pytest_cache", "build", "dist"}

README_MAX_LINES = 220
README_COMMANDS = ("make run", "make test")


def _is_text(path: str) -> bool:
    name = os.path.basename(path)
    return name in TEXT_NAMES or os.path.splitext(name)[1] in TEXT_SUFFIXES


def _tracked_text_files() -> list[Path]:
    """Tracked text files, relative to the repository root; every text file under it where git cannot say."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=30
        ).stdout.decode()
        paths = [p for p in out.split("\0") if p]
    except (OSError, subprocess.SubprocessError):
        paths = []
        for dirpath, dirnames, filenames in os.walk(ROOT):
            dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS]
            rel = os.path.relpath(dirpath, ROOT)
            paths += [os.path.normpath(os.path.join(rel, f)) for f in filenames]
    # a tracked file deleted in the working tree is not there to read
    return [ROOT / p for p in paths if _is_text(p) and (ROOT / p).is_file()]


def test_no_session_phrases():
    this_file = Path(__file__).resolve()
    hits = []
    for path in _tracked_text_files():
        if path.resolve() == this_file:
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        for lineno, line in enumerate(text.splitlines(), 1):
            if SESSION_RE.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{lineno}: {line.strip()[:100]}")
    assert not hits, "working-history wording ('session N') in tracked files:\n" + "\n".join(hits)


def _readme_lines() -> list[str]:
    return (ROOT / "README.md").read_text(encoding="utf-8").splitlines()


def test_readme_length():
    n = len(_readme_lines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines, more than {README_MAX_LINES}"


def test_readme_starts_with_the_two_commands():
    lines = [line for line in _readme_lines() if line.strip()]
    assert lines[0].startswith("# "), "README.md starts with its title"
    assert lines[1].strip().startswith("```"), "the title is followed by the code block of the two commands"
    for i, command in enumerate(README_COMMANDS, start=2):
        assert lines[i].startswith(command), f"line {i + 1} of the README's start is `{command} ...`: {lines[i]!r}"
    assert lines[len(README_COMMANDS) + 2].strip() == "```", "the first code block holds the two commands alone"


def _slug(heading: str) -> str:
    """A Markdown heading's anchor as GitHub makes it: lower case, punctuation dropped, spaces to hyphens."""
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    in_code = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith("```"):
            in_code = not in_code
            continue
        m = None if in_code else re.match(r"#{1,6}\s+(.*)", line)
        if m:
            slug = _slug(m.group(1))
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def test_readme_links_resolve():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        file_part, _, fragment = target.partition("#")
        path = ROOT / file_part if file_part else ROOT / "README.md"
        if not path.exists():
            broken.append(f"{target}: no such file")
        elif fragment and path.suffix == ".md" and fragment not in _anchors(path):
            broken.append(f"{target}: no heading with that anchor in {file_part or 'README.md'}")
    assert not broken, "README.md links that lead nowhere:\n" + "\n".join(broken)
