"""MNIST from the four standard IDX files (as in torchvision's ``MNIST/raw/``), with the ConvNet
and optimizer (Adadelta, lr 1.0) of PyTorch's MNIST example."""

from __future__ import annotations

import os

import torch
from torch.utils.data import TensorDataset

from ..data.idx import read_idx
from ..errors import DataError
from . import Task
from .models import MnistNet

FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
MEAN, STD = 0.1307, 0.3081


def find_file(data_dir: str, stem: str) -> str:
    for name in (stem + ".gz", stem):
        path = os.path.join(data_dir, name)
        if os.path.isfile(path):
            return path
    raise DataError(
        f"--data-dir {data_dir} has no {stem}.gz (nor {stem}); it must hold the four MNIST IDX files "
        "(train-images-idx3-ubyte.gz, train-labels-idx1-ubyte.gz, t10k-images-idx3-ubyte.gz, t10k-labels-idx1-ubyte.gz)."
    )


def load_split(data_dir: str, split: str) -> TensorDataset:
    img_path, lbl_path = (find_file(data_dir, stem) for stem in FILES[split])
    images, labels = read_idx(img_path), read_idx(lbl_path)
    if images.ndim != 3 or labels.ndim != 1:
        raise DataError(f"data files {img_path} and {lbl_path} have shapes {images.shape} and {labels.shape}; expected N x 28 x 28 images and N labels.")
    if len(images) != len(labels):
        raise DataError(f"{img_path} holds {len(images)} images but {lbl_path} holds {len(labels)} labels; use files from the same release.")
    x = torch.from_numpy(images.copy()).float().div_(255.0).sub_(MEAN).div_(STD).unsqueeze(1)
    y = torch.from_numpy(labels.astype("int64"))
    return TensorDataset(x, y)


def make_task(data_dir: str | None = None) -> Task:
    if not data_dir:
        raise DataError("task 'mnist' needs --data-dir, the folder with the MNIST IDX files (e.g. --data-dir ../shared/data/mnist).")
    if not os.path.isdir(data_dir):
        raise DataError(f"--data-dir {data_dir} does not exist; point it at the folder with the MNIST IDX files.")
    return Task(
        name="mnist",
        build_model=MnistNet,
        train_set=load_split(data_dir, "train"),
        test_set=load_split(data_dir, "test"),
        optimizer="adadelta",
        lr=1.0,
        batch_size=64,
    )
