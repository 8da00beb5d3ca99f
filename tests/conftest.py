"""Shared fixtures: every test must leave no process group, no changed environment and no stray thread.

The tests live in three tiers (docs/testing.md): tests/logic/, tests/multiprocess/ and tests/gpu/,
each mirroring src/dtrain/'s folders; tests/logic/conftest.py keeps processes out of the logic tier."""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

# run_distributed's ranks fork from one server that imported torch once, not each importing it afresh
# (seconds a rank; the suite starts hundreds). Set before dtrain.launch.local is imported.
os.environ.setdefault("DTRAIN_LOCAL_START", "forkserver")

import pytest
import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
MNIST_DIR = ROOT.parent / "shared" / "data" / "mnist"


# Variables that libraries set on import (scikit-learn's OpenMP, torch's inductor cache).
_SET_BY_LIBRARIES = ("KMP_", "TORCHINDUCTOR_")


@pytest.fixture(autouse=True)
def _no_leaks():
    env_before = dict(os.environ)
    threads_before = {t.ident for t in threading.enumerate()}
    yield
    assert not dist.is_initialized(), "test left a process group initialised"
    changed = {k for k in set(env_before) | set(os.environ) if env_before.get(k) != os.environ.get(k)}
    changed = {k for k in changed if k != "PYTEST_CURRENT_TEST" and not k.startswith(_SET_BY_LIBRARIES)}
    assert not changed, f"test changed environment variables: {sorted(changed)}"
    leaked = [t for t in threading.enumerate() if t.ident not in threads_before and t.is_alive() and not t.daemon]
    deadline = time.monotonic() + 5  # a pool's worker that ends on its own (transformers' loader) is no leak
    for t in leaked:
        t.join(max(0.0, deadline - time.monotonic()))
    leaked = [t for t in leaked if t.is_alive()]
    assert not leaked, f"test left threads running: {leaked}"


@pytest.fixture(autouse=True)
def _restore_dtrain_logger():
    """``dtrain.cli.main`` points dtrain's logger at the test's captured stderr (and stops propagation);
    give later tests the logger as it was, so their caplog sees dtrain's warnings."""
    log = logging.getLogger("dtrain")
    saved = (list(log.handlers), log.propagate, log.level)
    yield
    log.handlers[:], log.propagate, log.level = saved


@pytest.fixture
def mnist_dir() -> Path:
    if not (MNIST_DIR / "train-images-idx3-ubyte.gz").exists():
        pytest.skip(f"MNIST files not found in {MNIST_DIR}")
    return MNIST_DIR


TIERS = ("logic", "multiprocess", "gpu")


def pytest_collection_modifyitems(config, items):
    # pyproject's testpaths names the tiers one by one (the logic tier first): a test file outside them would never run.
    tests = ROOT / "tests"
    stray = sorted(str(p.relative_to(ROOT)) for p in tests.rglob("test_*.py") if p.relative_to(tests).parts[0] not in TIERS)
    if stray:
        raise pytest.UsageError(f"test files outside the tiers {', '.join(f'tests/{t}/' for t in TIERS)}: {', '.join(stray)}; "
                                "move each into the tier and area it belongs to (docs/testing.md)")
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """A private SLURM cluster (slurmctld + two slurmd emulating nodes n1, n2) for this test
    session; skipped with the reason where slurm-wlm/munge are missing or will not start."""
    from tests.support.slurm import PrivateSlurm, SlurmUnavailable

    try:
        cluster = PrivateSlurm.start(tmp_path_factory.mktemp("slurm"))
    except SlurmUnavailable as exc:
        pytest.skip(f"private SLURM cluster not available: {exc}")
    yield cluster
    cluster.stop()
