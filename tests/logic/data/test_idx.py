import gzip
import struct

import numpy as np
import pytest

from dtrain import DataError
from dtrain.data import read_idx


def _idx(arr: np.ndarray) -> bytes:
    header = bytes([0, 0, 0x08, arr.ndim]) + b"".join(struct.pack(">I", d) for d in arr.shape)
    return header + arr.astype(np.uint8).tobytes()


def test_reads_plain_and_gzip(tmp_path):
    arr = np.arange(24, dtype=np.uint8).reshape(2, 3, 4)
    (tmp_path / "a").write_bytes(_idx(arr))
    (tmp_path / "a.gz").write_bytes(gzip.compress(_idx(arr)))
    assert np.array_equal(read_idx(tmp_path / "a"), arr)
    assert np.array_equal(read_idx(tmp_path / "a.gz"), arr)


def test_truncated_file(tmp_path):
    (tmp_path / "t").write_bytes(_idx(np.zeros((4, 5)))[:-3])
    with pytest.raises(DataError, match="truncated or corrupt"):
        read_idx(tmp_path / "t")


def test_bad_magic(tmp_path):
    (tmp_path / "m").write_bytes(b"hello world, not idx")
    with pytest.raises(DataError, match="not an IDX file"):
        read_idx(tmp_path / "m")


def test_broken_gzip(tmp_path):
    data = gzip.compress(_idx(np.zeros((10, 10))))
    (tmp_path / "g.gz").write_bytes(data[: len(data) // 2])
    with pytest.raises(DataError, match="gzip"):
        read_idx(tmp_path / "g.gz")


def test_missing(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        read_idx(tmp_path / "nope")
