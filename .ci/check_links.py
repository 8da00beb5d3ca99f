#!/usr/bin/env python3
"""Check the relative links of the user documentation: every `[text](target)` in README.md,
docs/*.md and benchmarks/README.md must name a file (or folder) of the repository, and a
`#fragment` a heading of that page (GitHub's anchors). Exit 1 with one line per broken link.

    python3 .ci/check_links.py            # from the repository root (or any folder: it finds the root)
    python3 .ci/check_links.py FILE.md    # only these pages
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES = ("README.md", "docs/*.md", "benchmarks/README.md")
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~)")


def prose(text: str) -> str:
    """The page without fenced code blocks and inline code (a link there is not a link)."""
    out, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line.lstrip()):
            fenced = not fenced
            continue
        if not fenced:
            out.append(re.sub(r"`[^`]*`", "", line))
    return "\n".join(out)


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens, repeats numbered."""
    seen: dict[str, int] = {}
    found = set()
    fenced = False
    for line in page.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line.lstrip()):
            fenced = not fenced
        m = None if fenced else re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        found.add(slug if n == 0 else f"{slug}-{n}")
    return found


def broken(page: Path) -> list[str]:
    problems = []
    for m in LINK.finditer(prose(page.read_text(encoding="utf-8"))):
        target = m.group(1) or m.group(2)
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, fragment = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        where = page.relative_to(ROOT)
        if not dest.exists():
            problems.append(f"{where}: link to {target}: no such file")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            problems.append(f"{where}: link to {target}: no heading #{fragment} in {dest.relative_to(ROOT)}")
    return problems


def main(argv: list[str]) -> int:
    pages = [Path(a).resolve() for a in argv] or sorted(p for g in PAGES for p in ROOT.glob(g))
    problems = [line for page in pages for line in broken(page)]
    for line in problems:
        print(line)
    print(f"{len(pages)} page(s), {len(problems)} broken link(s)", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
