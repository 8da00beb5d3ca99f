"""A small real image folder for tests and benchmarks: handwritten digits written as RGB JPEGs
in torchvision's layout (``ROOT/train/CLASS/*.jpg``, ``ROOT/val/CLASS/*.jpg``), so decoding
is real and nothing is downloaded.

Digits come from MNIST's IDX files when ``mnist_dir`` holds them, else from scikit-learn's
bundled 8x8 digits; each is scaled to ``size`` pixels and tinted per image (so the three
channels differ).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np


def _digits(mnist_dir: str | os.PathLike | None, count: int) -> tuple[np.ndarray, np.ndarray]:
    if mnist_dir is not None and (Path(mnist_dir) / "train-images-idx3-ubyte.gz").exists():
        from dtrain.data import read_idx

        images = read_idx(Path(mnist_dir) / "train-images-idx3-ubyte.gz")[:count]
        labels = read_idx(Path(mnist_dir) / "train-labels-idx1-ubyte.gz")[:count]
        return images.astype(np.uint8), labels.astype(np.int64)
    from dtrain.tasks.digits import load_arrays

    pixels, labels = load_arrays()
    images = pixels.reshape(-1, 8, 8)
    return (images[:count] * 255.0 / 16.0).astype(np.uint8), labels[:count]


def write_digit_folder(root: str | os.PathLike, *, classes: int = 10, train_per_class: int = 20, val_per_class: int = 5,
                       size: int = 32, mnist_dir: str | os.PathLike | None = None, quality: int = 90) -> Path:
    """Write the folder and return ``root``. Deterministic: the same arguments give the same files."""
    from PIL import Image

    per_class = train_per_class + val_per_class
    images, labels = _digits(mnist_dir, 60_000 if mnist_dir else 1797)
    rng = np.random.default_rng(0)
    root = Path(root)
    for c in range(classes):
        picked = np.flatnonzero(labels == c)[:per_class]
        if len(picked) < per_class:
            raise ValueError(f"only {len(picked)} digits of class {c}; ask for at most {len(picked)} per class")
        for n, i in enumerate(picked):
            split = "train" if n < train_per_class else "val"
            folder = root / split / f"digit{c}"
            folder.mkdir(parents=True, exist_ok=True)
            gray = Image.fromarray(images[i]).resize((size, size), Image.BILINEAR)
            tint = rng.uniform(0.5, 1.0, size=3)
            rgb = (np.asarray(gray, dtype=np.float32)[..., None] * tint).clip(0, 255).astype(np.uint8)
            Image.fromarray(rgb, "RGB").save(folder / f"{n:05d}.jpg", quality=quality)
    return root
