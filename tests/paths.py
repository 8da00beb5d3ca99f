"""Where the tests' support files are, for test modules at any depth of tests/."""

from pathlib import Path

TESTS = Path(__file__).resolve().parent  # scripts/, schemas/, user_task.py, slow_start_task.py
ROOT = TESTS.parent  # the repository: src/, examples/, benchmarks/, docs/, .ci/
