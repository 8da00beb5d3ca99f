"""Every relative link and anchor in README.md, docs/ and benchmarks/README.md points at something
that exists (``.ci/check_links.py``): the front door's links are how a newcomer reads on."""

from __future__ import annotations

import subprocess
import sys

from tests.paths import ROOT


def test_relative_links_and_anchors_resolve():
    proc = subprocess.run([sys.executable, str(ROOT / ".ci" / "check_links.py")], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 broken link(s)" in proc.stdout + proc.stderr
