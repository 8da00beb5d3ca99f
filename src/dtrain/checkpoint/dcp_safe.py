"""Read torch.distributed.checkpoint (DCP) folders without running code a file could hold: DCP
unpickles ``.metadata`` and non-tensor entries without restriction. Here ``.metadata`` goes through
an unpickler that resolves only the classes torch writes there (Python's "Restricting Globals"),
shard files must be plain names inside the folder, non-tensor entries load with ``weights_only``."""

from __future__ import annotations

import contextlib
import io
import os
import pathlib
import pickle
from collections.abc import Iterator
from typing import Any

import torch

from ..errors import CheckpointError, first_line
from .io import load_refusal

METADATA_FILE = ".metadata"

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
#: (module, name) of every class and function torch writes in a ``.metadata`` file (besides dtypes and paths).
_ALLOWED = {
    (_DCP_METADATA, name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "ChunkStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # maps a layout's name ("torch.strided") to the layout
}
_PATHS = ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath")  # StorageMeta.checkpoint_id


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(vars(torch).get(name), torch.dtype):  # vars: no lazy submodule import
            return vars(torch)[name]
        if module in ("pathlib", "pathlib._local") and name in _PATHS:  # pathlib._local: Python 3.13's name
            return getattr(pathlib, name)
        raise pickle.UnpicklingError(f"it names {module}.{name}, which DCP metadata never holds")


def read_metadata(folder: str) -> tuple[Any, list[str]]:
    """The DCP ``Metadata`` of ``folder`` and the shard files it names (sorted); CheckpointError
    (one line, naming the file) for anything but metadata as torch writes it."""
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorStorageMetadata,
    )

    path = os.path.join(folder, METADATA_FILE)
    refused = f"{path} is refused"
    try:
        with open(path, "rb") as fh:
            md = _MetadataUnpickler(fh).load()
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing; a sharded checkpoint needs it.") from None
    except Exception as exc:  # noqa: BLE001 -- whatever a crafted pickle raises; nothing ran
        first = first_line(exc)
        raise CheckpointError(f"{refused}: not DCP metadata as torch writes it ({first[:200]}); nothing in it was run.") from None
    if not isinstance(md, Metadata) or not isinstance(md.state_dict_metadata, dict) or not isinstance(md.storage_data, dict):
        raise CheckpointError(f"{refused}: it is not a DCP Metadata record (got {type(md).__name__}).")
    for key, entry in md.state_dict_metadata.items():
        if not isinstance(key, str) or not isinstance(entry, (TensorStorageMetadata, BytesStorageMetadata)):
            raise CheckpointError(f"{refused}: entry {str(key)[:80]!r} is a {type(entry).__name__}, not tensor or bytes metadata.")
    files = set()
    for index, info in md.storage_data.items():
        name = getattr(info, "relative_path", None)
        if not isinstance(index, MetadataIndex) or not _plain_name(name) or not _offsets_ok(info):
            raise CheckpointError(f"{refused}: a storage entry names {str(name)[:80]!r}; shard files are plain names inside the folder.")
        files.add(name)
    return md, sorted(files)


def check_entries(folder: str, md: Any) -> None:
    """Load every non-tensor entry of the shard files with weights_only=True (they are small:
    optimizer hyper-parameters), so ``verify`` refuses what a load would refuse."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    for index, info in md.storage_data.items():
        if not isinstance(md.state_dict_metadata.get(index.fqn), BytesStorageMetadata) or info.transform_descriptors:
            continue
        file = os.path.join(folder, info.relative_path)
        with open(file, "rb") as fh:
            fh.seek(info.offset)
            data = fh.read(info.length)
        try:
            _safe_bytes(io.BytesIO(data))
        except CheckpointError as exc:
            raise CheckpointError(f"{file}: entry {index.fqn[:80]!r}: {str(exc)[0].lower()}{str(exc)[1:]}") from None


def _plain_name(name: Any) -> bool:
    return (isinstance(name, str) and name not in ("", ".", "..") and not name.startswith(".")
            and "/" not in name and "\\" not in name and os.sep not in name and "\0" not in name)


def _offsets_ok(info: Any) -> bool:
    ints = [getattr(info, "offset", None), getattr(info, "length", None)]
    descriptors = getattr(info, "transform_descriptors", None)
    return (all(type(v) is int and v >= 0 for v in ints)
            and (descriptors is None or (isinstance(descriptors, (list, tuple)) and all(isinstance(d, str) for d in descriptors))))


def _reader(folder: str) -> Any:
    from torch.distributed.checkpoint import FileSystemReader

    class SafeReader(FileSystemReader):
        """FileSystemReader whose metadata comes from the restricted unpickler."""

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            from torch.distributed.checkpoint.metadata import StorageMeta

            md, _ = read_metadata(folder)
            if getattr(md, "storage_meta", None) is None:
                md.storage_meta = StorageMeta()
            md.storage_meta.load_id = self.load_id  # what FileSystemReader.read_metadata does after loading
            return md

    return SafeReader(folder)


def _safe_bytes(value: io.BytesIO) -> io.BytesIO:
    """A non-tensor entry loaded with weights_only=True, saved again for the planner's own
    torch.load: what that load sees was built from plain types only."""
    try:
        obj = torch.load(value, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 -- UnpicklingError and whatever a crafted entry raises
        raise CheckpointError(f"a non-tensor entry of a shard file is refused ({load_refusal(exc)}); nothing in it was run.") from None
    out = io.BytesIO()
    torch.save(obj, out)
    out.seek(0)
    return out


def _planner(empty: bool = False) -> Any:
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner

    base = _EmptyStateDictLoadPlanner if empty else DefaultLoadPlanner

    class SafePlanner(base):  # type: ignore[valid-type,misc]
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            super().load_bytes(read_item, _safe_bytes(value))

    return SafePlanner()


def load(state: dict[str, Any], folder: str) -> None:
    """``dcp.load(state, folder)``, through the restricted reader and planner. Collective when
    a process group is up (as dcp.load)."""
    import torch.distributed.checkpoint as dcp

    read_metadata(folder)  # a refusal raised inside dcp.load would come back wrapped in its traceback
    with _unwrapped():
        dcp.load(state, storage_reader=_reader(folder), planner=_planner())


def load_whole(folder: str) -> dict[str, Any]:
    """Every entry of ``folder`` as plain tensors and values, in this process (no process group)."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    read_metadata(folder)
    state: dict[str, Any] = {}
    with _unwrapped():
        _load_state_dict(state, storage_reader=_reader(folder), planner=_planner(empty=True), no_dist=True)
    return state


@contextlib.contextmanager
def _unwrapped() -> Iterator[None]:
    """DCP wraps every rank's failure in a CheckpointException, a BaseException (which
    ``except Exception`` misses) whose text is a traceback; raise the first failure itself."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as exc:
        failures = [f[0] if isinstance(f, tuple) else f for f in exc.failures.values()]
        first = next((f for f in failures if isinstance(f, CheckpointError)), failures[0] if failures else None)
        if isinstance(first, BaseException):
            raise first from None
        raise RuntimeError(str(exc).strip().splitlines()[-1]) from None
