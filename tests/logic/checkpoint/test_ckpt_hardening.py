"""Hostile and broken checkpoints: no code runs from a checkpoint folder, every malformed one is
one line (and resume falls back past it), one writer per folder, retention never leaves a
half-deleted checkpoint."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
from pathlib import Path

import pytest
import torch

import dtrain
from dtrain import CheckpointError
from dtrain.checkpoint import list_checkpoints, verify
from dtrain.checkpoint import lock as ckpt_lock
from dtrain.checkpoint.store import prune
from dtrain.cli import main as cli_main


# -- crafting ------------------------------------------------------------------------------------
class _RunsCommand:
    """Unpickling this runs a shell command (what an attacker's pickle would do)."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def _rewrite_manifest(ckpt: Path) -> None:
    """Recompute every file's checksum, as whoever can write the folder can."""
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["files"] = {}
    for file in sorted(ckpt.rglob("*")):
        if file.is_file() and file.name != "manifest.json":
            data = file.read_bytes()
            manifest["files"][file.relative_to(ckpt).as_posix()] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    (ckpt / "manifest.json").write_text(json.dumps(manifest))


def _claim_sharded(ckpt: Path) -> None:
    """state.pt stays legitimate but says its model lives in sharded/ (as an fsdp save's does)."""
    state = torch.load(ckpt / "state.pt", weights_only=True)
    state["objects"].pop("model", None)
    state["sharded"] = ["model"]
    torch.save(state, ckpt / "state.pt")
    (ckpt / "sharded").mkdir(exist_ok=True)


def craft_metadata_attack(ckpt: Path, marker: Path) -> None:
    """sharded/.metadata is a plain pickle whose __reduce__ calls os.system."""
    _claim_sharded(ckpt)
    (ckpt / "sharded" / ".metadata").write_bytes(pickle.dumps(_RunsCommand(f"touch {marker}")))
    _rewrite_manifest(ckpt)


def craft_bytes_attack(ckpt: Path, marker: Path) -> None:
    """sharded/.metadata holds only the classes torch writes, but names a non-tensor entry whose
    bytes (DCP loads them with torch.load(weights_only=False)) run a command."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex

    _claim_sharded(ckpt)
    model = torch.load(ckpt.parent / "step-00000001" / "state.pt", weights_only=True)["objects"]["model"]
    payload = __import__("io").BytesIO()
    torch.save(_RunsCommand(f"touch {marker}"), payload)
    data = payload.getvalue()
    (ckpt / "sharded" / "__0_0.distcp").write_bytes(data)
    keys = [f"model.{k}" for k in model]
    md = Metadata(state_dict_metadata={k: BytesStorageMetadata() for k in keys},
                  storage_data={MetadataIndex(k): _StorageInfo("__0_0.distcp", 0, len(data)) for k in keys})
    (ckpt / "sharded" / ".metadata").write_bytes(pickle.dumps(md))
    _rewrite_manifest(ckpt)


def _two_checkpoints(folder: Path) -> Path:
    """step 1 (valid) and step 2 (to be tampered with) of a small model; returns step 2."""
    ctx = dtrain.init("single")
    model = ctx.setup(torch.nn.Linear(4, 3))
    ckpt = ctx.checkpoints(str(folder), keep=5)
    ckpt.save(1, model=model)
    ckpt.save(2, model=model)
    ctx.close()
    return folder / "step-00000002"


def _cli(capsys, *args):
    code = cli_main([*map(str, args)])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("craft", [craft_metadata_attack, craft_bytes_attack])
def test_crafted_sharded_checkpoint_runs_nothing_on_any_path(tmp_path, capsys, caplog, craft):
    marker = tmp_path / "PWNED"
    bad = _two_checkpoints(tmp_path / "ck")
    craft(bad, marker)

    v = verify(str(bad))
    assert not v.ok and "refused" in v.problem and "sharded" in v.problem, v.problem
    code, out, err = _cli(capsys, "ckpt", "verify", bad)
    assert code == 1 and out.startswith("FAIL") and "refused" in out and len(out.strip().splitlines()) == 1, out + err
    code, out, err = _cli(capsys, "ckpt", "ls", tmp_path / "ck")
    assert code == 0 and "INVALID" in out and "refused" in out, out + err
    for args in (("diff", bad, tmp_path / "ck" / "step-00000001"), ("consolidate", bad, tmp_path / "out.pt")):
        code, out, err = _cli(capsys, "ckpt", *args)
        assert code == 2 and "refused" in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err, (args, out, err)
    assert not (tmp_path / "out.pt").exists()
    from dtrain.checkpoint import dcp_safe

    with pytest.raises(Exception, match="refused"):  # DCP's own load, past verify: refused again
        dcp_safe.load_whole(str(bad / "sharded"))

    ctx = dtrain.init("single")
    model = ctx.setup(torch.nn.Linear(4, 3))
    with pytest.raises(CheckpointError, match="refused"):
        ctx.load(str(bad), {"model": model})
    caplog.set_level("WARNING", logger="dtrain")
    meta = ctx.checkpoints(str(tmp_path / "ck")).resume(model=model)  # falls back past the crafted one
    assert meta["step"] == 1 and "skipping checkpoint" in caplog.text and "refused" in caplog.text
    assert ctx.load(str(tmp_path / "ck"), {"model": model})["step"] == 1
    ctx.close()
    assert not marker.exists()


def test_sharded_checkpoint_metadata_passes_the_restricted_unpickler(tmp_path):
    """What torch writes (fsdp-shaped: model and flattened optimizer, tensors and bytes) reads back."""
    import torch.distributed.checkpoint as dcp

    from dtrain.checkpoint import dcp_safe

    state = {"model": {"w": torch.arange(6.0).reshape(2, 3)}, "optimizer": {"param_groups.w.lr": 0.1, "param_groups.w.betas": (0.9, 0.99)}}
    dcp.save(state, checkpoint_id=str(tmp_path), no_dist=True)
    md, files = dcp_safe.read_metadata(str(tmp_path))
    assert files == ["__0_0.distcp"] and "model.w" in md.state_dict_metadata
    dcp_safe.check_entries(str(tmp_path), md)
    whole = dcp_safe.load_whole(str(tmp_path))
    assert torch.equal(whole["model"]["w"], state["model"]["w"]) and whole["optimizer"]["param_groups.w.betas"] == (0.9, 0.99)


# -- malformed manifests and folders ---------------------------------------------------------------
def _edit_manifest(ckpt: Path, edit) -> None:
    manifest = json.loads((ckpt / "manifest.json").read_text())
    (ckpt / "manifest.json").write_text(json.dumps(edit(manifest)))


MANIFEST_CASES = {
    "a list": (lambda m: [m], "is a list, not an object"),
    "bytes as a string": (lambda m: {**m, "files": {k: {**v, "bytes": str(v["bytes"])} for k, v in m["files"].items()}}, "'bytes' of state.pt is a string"),
    "no bytes": (lambda m: {**m, "files": {k: {"sha256": v["sha256"]} for k, v in m["files"].items()}}, "has no 'bytes' field"),
    "no sha256": (lambda m: {**m, "files": {k: {"bytes": v["bytes"]} for k, v in m["files"].items()}}, "has no 'sha256' field"),
    "no files": (lambda m: {k: v for k, v in m.items() if k != "files"}, "has no 'files' field"),
    "files a list": (lambda m: {**m, "files": list(m["files"])}, "field 'files' is a list"),
    "files empty": (lambda m: {**m, "files": {}}, "state.pt is not in the manifest"),
    "a file missing": (lambda m: {**m, "files": {**m["files"], "extra.pt": m["files"]["state.pt"]}}, "extra.pt is missing"),
    "escapes the folder": (lambda m: {**m, "files": {"../step-00000001/state.pt": m["files"]["state.pt"]}}, "not a plain path"),
    "another step": (lambda m: {**m, "step": 7}, "says step 7, but the folder is step-00000002"),
}


@pytest.mark.parametrize("case", sorted(MANIFEST_CASES))
def test_malformed_manifest_is_one_line_everywhere_and_resume_falls_back(tmp_path, capsys, caplog, case):
    edit, expected = MANIFEST_CASES[case]
    bad = _two_checkpoints(tmp_path)
    state = bad / "state.pt"
    flipped = bytearray(state.read_bytes())
    flipped[len(flipped) // 2] ^= 0x01  # with "files": {} this flip went unnoticed before
    state.write_bytes(bytes(flipped))
    _edit_manifest(bad, edit)
    v = verify(str(bad))
    assert not v.ok and expected in v.problem, v.problem
    code, out, err = _cli(capsys, "ckpt", "verify", bad)
    assert code == 1 and expected in out and "Traceback" not in err and len(out.strip().splitlines()) == 1, out + err
    code, out, err = _cli(capsys, "ckpt", "ls", tmp_path)
    assert code == 0 and "INVALID" in out, out + err
    for args in (("diff", bad, tmp_path / "step-00000001"), ("consolidate", bad, tmp_path / "o.pt")):
        code, out, err = _cli(capsys, "ckpt", *args)
        assert code == 2 and expected in err and len(err.strip().splitlines()) == 1, (args, out, err)
    ctx = dtrain.init("single")
    caplog.set_level("WARNING", logger="dtrain")
    assert ctx.checkpoints(str(tmp_path)).resume(model=ctx.setup(torch.nn.Linear(4, 3)))["step"] == 1
    assert "skipping checkpoint" in caplog.text and expected in caplog.text
    ctx.close()


def test_an_unlisted_file_or_a_link_makes_a_checkpoint_invalid(tmp_path):
    bad = _two_checkpoints(tmp_path)
    (bad / "notes.txt").write_text("x")
    assert "notes.txt is not in the manifest" in verify(str(bad)).problem
    (bad / "notes.txt").unlink()
    (bad / "state.pt").rename(bad / "real.pt")
    (bad / "state.pt").symlink_to(bad / "real.pt")
    assert "is a symbolic link" in verify(str(bad)).problem


def test_verify_of_what_is_not_a_checkpoint_says_so(tmp_path, capsys):
    junk = tmp_path / "junk.pt"
    junk.write_bytes(os.urandom(4096))
    (tmp_path / "empty").mkdir()
    for path, expected in ((tmp_path / "nope", "does not exist"), (junk, "is not a checkpoint"), (tmp_path / "empty", "holds no checkpoints")):
        code, out, err = _cli(capsys, "ckpt", "verify", path)
        assert code == 2 and expected in err and len(err.strip().splitlines()) == 1 and not out, (path, out, err)
        assert "manifest" not in err or expected == "holds no checkpoints"
    good = tmp_path / "good.pt"
    torch.save({"w": torch.ones(2)}, good)
    code, out, _ = _cli(capsys, "ckpt", "verify", good)
    assert code == 0 and out.startswith("ok"), out


@pytest.mark.parametrize("pointer", ["step-00000009", "../../etc", ""])
def test_latest_pointing_nowhere_warns_and_uses_the_newest_valid(tmp_path, capsys, caplog, pointer):
    _two_checkpoints(tmp_path)
    (tmp_path / "latest").write_text(pointer + "\n")
    caplog.set_level("WARNING", logger="dtrain")
    ctx = dtrain.init("single")
    assert ctx.checkpoints(str(tmp_path)).resume(model=ctx.setup(torch.nn.Linear(4, 3)))["step"] == 2
    ctx.close()
    if pointer:
        assert "latest" in caplog.text and "newest valid" in caplog.text, caplog.text
    code, out, _ = _cli(capsys, "ckpt", "verify", tmp_path)
    assert code == 0 and out.count("ok ") == 2 and (not pointer or out.startswith("warning:")), out


def test_retention_renames_before_deleting_and_the_next_save_cleans_up(tmp_path, monkeypatch):
    import shutil

    _two_checkpoints(tmp_path)
    for step in (3, 4):
        (tmp_path / f"step-{step:08d}").mkdir()
    (tmp_path / "latest").write_text("step-00000002\n")
    seen = []

    def killed_midway(path, ignore_errors=False):  # a kill during rmtree: half of the files gone
        seen.append(path)
        first = sorted(Path(path).iterdir())[0]
        first.unlink() if first.is_file() else shutil.rmtree(first)
        raise KeyboardInterrupt

    monkeypatch.setattr("dtrain.checkpoint.store.shutil.rmtree", killed_midway)
    with pytest.raises(KeyboardInterrupt):
        prune(str(tmp_path), keep=1)
    monkeypatch.undo()
    assert os.path.basename(seen[0]).startswith(".deleting-step-00000001")
    assert [s for s, _ in list_checkpoints(str(tmp_path))] == [2, 3, 4]  # nothing half-deleted is listed
    ctx = dtrain.init("single")
    ctx.checkpoints(str(tmp_path), keep=2).save(5, model=ctx.setup(torch.nn.Linear(4, 3)))
    ctx.close()
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".")]


def test_same_run_id_is_the_same_holder_and_a_file_is_refused(tmp_path, monkeypatch):
    folder = str(tmp_path / "ck")
    me = ckpt_lock.this_holder()
    os.makedirs(folder)
    # An earlier worker of this same elastic run (another pid, still alive: our parent).
    record = {"host": me.host, "pid": os.getppid(), "run_id": me.run_id, "started": 0.0}
    (tmp_path / "ck" / "dtrain.lock").write_text(json.dumps(record))
    path = ckpt_lock.acquire(folder)
    assert json.loads(Path(path).read_text())["pid"] == os.getpid()
    ckpt_lock.release(path)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "other-run")
    (tmp_path / "ck" / "dtrain.lock").write_text(json.dumps(record))
    with pytest.raises(CheckpointError, match="in use by run"):
        ckpt_lock.acquire(folder)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="is a file, not a folder"):
        ckpt_lock.preflight(str(tmp_path / "file"))


@pytest.mark.parametrize("field, value, expected", [
    ("objects", ["model"], "no 'objects' mapping"),
    ("step", "2", "no integer 'step'"),
    ("sharded", "model", "'sharded' is not a list"),
    ("rng", ["not a state"], "RNG state is malformed"),
])
def test_state_of_wrong_types_is_one_line(tmp_path, field, value, expected):
    bad = _two_checkpoints(tmp_path)
    state = torch.load(bad / "state.pt", weights_only=True)
    state[field] = value
    torch.save(state, bad / "state.pt")
    _rewrite_manifest(bad)
    ctx = dtrain.init("single")
    with pytest.raises(CheckpointError, match=expected):
        ctx.checkpoints(str(tmp_path)).resume(path=str(bad), model=ctx.setup(torch.nn.Linear(4, 3)))
    ctx.close()
