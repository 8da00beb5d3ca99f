"""Plain logic: precision, strategies registry, config validation, checkpoints, tasks."""


import pytest
import torch

from dtrain import CheckpointError
from dtrain.checkpoint import atomic_save, safe_load


def test_atomic_save_and_safe_load(tmp_path):
    path = tmp_path / "c.pt"
    atomic_save({"w": torch.ones(3), "step": 4}, path)
    assert safe_load(path)["step"] == 4
    assert [p.name for p in tmp_path.iterdir()] == ["c.pt"], "no temporary file left behind"


def test_safe_load_refuses_truncated_and_pickles(tmp_path):
    path = tmp_path / "c.pt"
    atomic_save({"w": torch.ones(1000)}, path)
    path.write_bytes(path.read_bytes()[:200])
    with pytest.raises(CheckpointError, match="c.pt cannot be read"):
        safe_load(path)

    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    torch.save({"x": Evil()}, tmp_path / "evil.pt")
    with pytest.raises(CheckpointError, match="evil.pt"):
        safe_load(tmp_path / "evil.pt")
