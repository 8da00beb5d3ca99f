"""Reading checkpoints: a folder is valid when its manifest lists exactly its plain files with
their sizes and sha256, it holds what its kind needs, and its DCP metadata reads through
``dcp_safe``; only then is ``state.pt`` loaded, with ``weights_only=True``."""

from __future__ import annotations

import json
import os
import re
import zipfile
from dataclasses import dataclass
from typing import Any

from .._log import logger
from ..errors import CheckpointError
from . import dcp_safe
from .io import safe_load
from .sharded import SHARDED_DIR, consolidated
from .store import FORMAT, MANIFEST, STATE_FILE, STEP_DIR, list_checkpoints, sha256_of

_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_JSON_TYPES = {dict: "an object", list: "a list", str: "a string", int: "an integer", float: "a number",
               bool: "a boolean", type(None): "null"}


@dataclass(frozen=True)
class Verdict:
    path: str
    step: int | None
    ok: bool
    problem: str = ""
    bytes: int = 0
    meta: dict[str, Any] | None = None


def _jtype(value: Any) -> str:
    return _JSON_TYPES.get(type(value), type(value).__name__)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _plain_relpath(name: str) -> bool:
    parts = name.split("/")
    return bool(name) and not os.path.isabs(name) and "\\" not in name and "\0" not in name and \
        all(p not in ("", ".", "..") for p in parts) and name != MANIFEST


def schema_problem(manifest: Any, folder: str) -> str | None:
    """What is wrong with a parsed manifest, or None; the text follows "<manifest> is invalid: "."""
    if not isinstance(manifest, dict):
        return f"it is {_jtype(manifest)}, not an object"
    for key, want in (("format", "an integer"), ("step", "an integer"), ("files", "an object")):
        if key not in manifest:
            return f"it has no {key!r} field"
        value = manifest[key]
        if (want == "an integer" and not _is_int(value)) or (want == "an object" and not isinstance(value, dict)):
            return f"field {key!r} is {_jtype(value)}, not {want}"
    if manifest["format"] != FORMAT:
        return f"format {manifest['format']}; this dtrain reads format {FORMAT} (a newer dtrain wrote it?)"
    m = STEP_DIR.match(os.path.basename(os.path.normpath(folder)))
    if m and int(m.group(1)) != manifest["step"]:
        return f"it says step {manifest['step']}, but the folder is {os.path.basename(os.path.normpath(folder))}"
    for name, info in manifest["files"].items():
        if not _plain_relpath(name):
            return f"it lists {name[:80]!r}, not a plain path inside the checkpoint"
        if not isinstance(info, dict):
            return f"the entry of {name} is {_jtype(info)}, not an object"
        for key in ("bytes", "sha256"):
            if key not in info:
                return f"the entry of {name} has no {key!r} field"
        if not _is_int(info["bytes"]) or info["bytes"] < 0:
            return f"'bytes' of {name} is {_jtype(info['bytes'])} ({str(info['bytes'])[:40]}), not a size"
        if not isinstance(info["sha256"], str) or not _SHA256.match(info["sha256"]):
            return f"'sha256' of {name} is not 64 hex digits"
    return None


def _files_on_disk(folder: str) -> tuple[set[str], list[str]]:
    """Relative paths of the files under ``folder`` (but the manifest), and its symbolic links."""
    files, links = set(), []
    for root, dirs, names in os.walk(folder):
        for n in [*dirs, *names]:
            full = os.path.join(root, n)
            if os.path.islink(full):
                links.append(os.path.relpath(full, folder))
        for n in names:
            rel = os.path.relpath(os.path.join(root, n), folder).replace(os.sep, "/")
            if rel != MANIFEST:
                files.add(rel)
    return files, links


def _read_manifest(path: str) -> tuple[dict[str, Any] | None, str]:
    manifest_path = os.path.join(path, MANIFEST)
    try:
        with open(manifest_path, encoding="utf-8") as fh:
            manifest = json.load(fh)
    except FileNotFoundError:
        return None, f"{manifest_path} is missing (an incomplete save?)"
    except (OSError, ValueError) as exc:
        return None, f"{manifest_path} is unreadable ({str(exc)[:120]})"
    problem = schema_problem(manifest, path)
    if problem is not None:
        return None, f"{manifest_path} is invalid: {problem}"
    return manifest, ""


def _file_set_problem(path: str, listed: set[str]) -> str | None:
    on_disk, links = _files_on_disk(path)
    if links:
        return f"{os.path.join(path, links[0])} is a symbolic link; a checkpoint holds plain files only"
    extra = sorted(on_disk - listed)
    if extra:
        return f"{os.path.join(path, extra[0])} is not in the manifest" + (f" ({len(extra)} such files)" if len(extra) > 1 else "")
    missing = sorted(listed - on_disk)
    if missing:
        return f"{os.path.join(path, missing[0])} is missing"
    if STATE_FILE not in listed:
        return f"its manifest does not list {STATE_FILE}, which every checkpoint holds"
    sharded = sorted(n for n in listed if n.startswith(SHARDED_DIR + "/"))
    if sharded and f"{SHARDED_DIR}/{dcp_safe.METADATA_FILE}" not in listed:
        return f"it holds {SHARDED_DIR}/ files but its manifest does not list {SHARDED_DIR}/{dcp_safe.METADATA_FILE}"
    return None


def verify(path: str, *, load: bool = True) -> Verdict:
    """Check a checkpoint folder (or a single ``.pt`` file) as loading will: the manifest, the
    checksums, the sharded metadata, then (``load``) its ``state.pt`` through the safe loader."""
    if not os.path.exists(path):
        return Verdict(path, None, False, f"{path} does not exist")
    if os.path.isfile(path):
        return _verify_file(path, load=load)
    verdict = _verify_folder(path)
    if not (verdict.ok and load):
        return verdict
    try:
        state = safe_load(os.path.join(path, STATE_FILE), map_location="cpu", mmap=True)
    except CheckpointError as exc:
        return Verdict(path, verdict.step, False, str(exc).rstrip("."), verdict.bytes, verdict.meta)
    problem = state_problem(state)
    if problem is not None:
        return Verdict(path, verdict.step, False, f"{os.path.join(path, STATE_FILE)}: {problem}", verdict.bytes, verdict.meta)
    return verdict


def _verify_folder(path: str) -> Verdict:
    """The folder's manifest, file set, checksums and sharded metadata."""
    manifest, problem = _read_manifest(path)
    if manifest is None:
        return Verdict(path, None, False, problem)
    step, files = manifest["step"], manifest["files"]
    problem = _file_set_problem(path, set(files))
    if problem is not None:
        return Verdict(path, step, False, problem, meta=manifest)
    total = 0
    for name, info in sorted(files.items()):
        file = os.path.join(path, name)
        size = os.path.getsize(file)
        total += size
        if size != info["bytes"]:
            return Verdict(path, step, False, f"{file} has {size} bytes, the manifest says {info['bytes']} (truncated?)", total, manifest)
        if sha256_of(file) != info["sha256"]:
            return Verdict(path, step, False, f"{file} fails its sha256 checksum (corrupted)", total, manifest)
    if f"{SHARDED_DIR}/{dcp_safe.METADATA_FILE}" in files:
        try:
            md, shards = dcp_safe.read_metadata(os.path.join(path, SHARDED_DIR))
            absent = [s for s in shards if f"{SHARDED_DIR}/{s}" not in files]
            if absent:
                return Verdict(path, step, False, f"{os.path.join(path, SHARDED_DIR, absent[0])} is missing (its metadata names it)", total, manifest)
            dcp_safe.check_entries(os.path.join(path, SHARDED_DIR), md)
        except CheckpointError as exc:
            return Verdict(path, step, False, str(exc).rstrip("."), total, manifest)
    return Verdict(path, step, True, "", total, manifest)


def _verify_file(path: str, *, load: bool = True) -> Verdict:
    """A single file passes when it is a torch.save archive the safe loader reads (``load``)."""
    size = os.path.getsize(path)
    try:
        with zipfile.ZipFile(path) as zf:
            ok = any(n.endswith("/data.pkl") or n == "data.pkl" for n in zf.namelist())
    except (zipfile.BadZipFile, OSError, ValueError):
        ok = False
    if not ok:
        return Verdict(path, None, False, f"{path} is not a checkpoint (neither a checkpoint folder nor a torch.save file)", size)
    if load:
        try:
            safe_load(path, map_location="cpu", mmap=True)
        except CheckpointError as exc:
            return Verdict(path, None, False, str(exc).rstrip("."), size)
    return Verdict(path, None, True, "single file, no checksum", size)


def read_checkpoint(path: str, name: str = STATE_FILE, map_location: Any = "cpu") -> Any:
    """Verify, then load one file of a checkpoint safely. CheckpointError names file and problem."""
    if os.path.isfile(path):
        return safe_load(path, map_location=map_location)
    verdict = verify(path, load=False)  # the load below is the state's check
    if not verdict.ok:
        raise CheckpointError(f"checkpoint {path}: {verdict.problem}.")
    return safe_load(os.path.join(path, name), map_location=map_location)


def read_latest_name(folder: str) -> tuple[str | None, str]:
    """The checkpoint ``latest`` names (a path) and, when it names nothing usable, why."""
    try:
        with open(os.path.join(folder, "latest"), encoding="utf-8") as fh:
            name = fh.read(256).strip()
    except FileNotFoundError:
        return None, ""
    except (OSError, ValueError) as exc:
        return None, f"{os.path.join(folder, 'latest')} is unreadable ({exc})"
    if not STEP_DIR.match(name):
        return None, f"{os.path.join(folder, 'latest')} names {name[:60]!r}, not a step-* checkpoint"
    path = os.path.join(folder, name)
    if not os.path.isdir(path):
        return None, f"{os.path.join(folder, 'latest')} names {name}, which does not exist"
    return path, ""


def newest_valid(folder: str) -> tuple[str | None, list[str]]:
    """The checkpoint to resume from: ``latest`` if valid, else the newest valid one, each one
    skipped with a warning. Returns (path or None, the problems seen)."""
    latest, why = read_latest_name(folder)
    if why:
        logger.warning(f"{why}; using the newest valid checkpoint instead.")
    candidates = [p for _, p in reversed(list_checkpoints(folder))]
    if latest in candidates:
        candidates.remove(latest)
        candidates.insert(0, latest)
    problems = []
    for path in candidates:
        verdict = verify(path)
        if verdict.ok:
            return path, problems
        problems.append(verdict.problem)
        logger.warning(f"skipping checkpoint {path}: {verdict.problem}; trying the previous one.")
    return None, problems


def resolve(path: str) -> str:
    """A checkpoint folder, a checkpoint directory (its latest valid checkpoint), or a file."""
    if not os.path.exists(path):
        raise CheckpointError(f"checkpoint {path} does not exist.")
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, MANIFEST)) and list_checkpoints(path):
        found, problems = newest_valid(path)
        if found is None:
            raise CheckpointError(f"{path} holds {len(problems)} checkpoint(s) and none is valid (newest: {problems[0]}).")
        return found
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, MANIFEST)) and not _looks_like_checkpoint(path):
        raise CheckpointError(f"{path} holds no checkpoints (no step-* folders, no manifest.json); give a checkpoint or a --checkpoint-dir.")
    return path


def _looks_like_checkpoint(path: str) -> bool:
    return STEP_DIR.match(os.path.basename(os.path.normpath(path))) is not None or os.path.exists(os.path.join(path, STATE_FILE))


def state_problem(state: Any) -> str | None:
    """What makes a loaded ``state.pt`` no dtrain training state (wrong types included), or None."""
    if not isinstance(state, dict):
        return f"{STATE_FILE} holds a {type(state).__name__}, not a dtrain training state"
    if not isinstance(state.get("objects"), dict):
        return f"{STATE_FILE} has no 'objects' mapping; it is not a dtrain training-state checkpoint"
    if not _is_int(state.get("step")):
        return f"{STATE_FILE} has no integer 'step'"
    sharded = state.get("sharded") or []
    if not isinstance(sharded, (list, tuple)) or not all(isinstance(n, str) for n in sharded):
        return f"{STATE_FILE}'s 'sharded' is not a list of names"
    return None


def read_whole(path: str) -> Any:
    """Checkpoint ``path``'s state (checksums verified first), its sharded entries read whole."""
    state = read_checkpoint(path)
    problem = state_problem(state)
    if problem is not None and not os.path.isfile(path):
        raise CheckpointError(f"checkpoint {path}: {problem}.")
    if problem is None and state.get("sharded"):
        state = {**state, "objects": {**state["objects"], **consolidated(path)}}
    return state
