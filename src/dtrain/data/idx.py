"""Reader for the IDX format of MNIST (http://yann.lecun.com/exdb/mnist/), plain or gzip'd.

Every way a file can be wrong ends in a DataError that names the file and what is wrong.
"""

from __future__ import annotations

import gzip
import os
import zlib

import numpy as np

from ..errors import DataError

# The third byte of the magic number names the element type (IDX specification).
_DTYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def read_idx(path: str | os.PathLike) -> np.ndarray:
    """Read an IDX file (``.gz`` or plain) into a numpy array of its stated shape."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise DataError(f"data file {path} does not exist.")
    try:
        with open(path, "rb") as fh:
            raw = fh.read()
        if raw[:2] == b"\x1f\x8b":
            raw = gzip.decompress(raw)
    except (OSError, EOFError, zlib.error) as exc:
        raise DataError(f"data file {path} is not a readable gzip file ({exc}); replace it with a good copy.") from None
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _DTYPES:
        raise DataError(f"data file {path} is not an IDX file (bad magic number {raw[:4].hex()}); replace it with a good copy.")
    dtype = np.dtype(_DTYPES[raw[2]])
    ndim = raw[3]
    header = 4 + 4 * ndim
    if ndim == 0 or len(raw) < header:
        raise DataError(f"data file {path} has a truncated IDX header; replace it with a good copy.")
    shape = tuple(int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    expected = header + int(np.prod(shape)) * dtype.itemsize
    if len(raw) != expected:
        raise DataError(
            f"data file {path} holds {len(raw)} bytes but its header {shape} needs {expected}; "
            "the file is truncated or corrupt, replace it with a good copy."
        )
    return np.frombuffer(raw, dtype=dtype, offset=header).reshape(shape)
