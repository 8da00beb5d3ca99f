"""Image classification: any torchvision classification model (never pretrained weights) on an
``ImageFolder`` layout with the ImageNet reference transforms, or on random tensors
(``source=synthetic``). Augmentation is keyed on ``(run seed, epoch, index)``, so a sample gets
the same crop whichever worker reads it and a resumed run sees the same batches.
"""

from __future__ import annotations

import difflib
import os
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset, get_worker_info

from .._log import logger
from ..errors import ConfigError, DataError
from . import Task

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)  # ImageNet's, as every torchvision recipe
SOURCES = ("folder", "synthetic")


def make_task(
    data_dir: str | None = None, model: str = "resnet18", size: int = 224, source: str = "folder",
    classes: int = 1000, samples: int = 1024, skip_bad: bool = False,
) -> Task:
    tv = _torchvision()
    if source not in SOURCES:
        raise ConfigError(f"task 'images': source {source!r} unknown; choose one of: {', '.join(SOURCES)}.")
    if size < 16:
        raise ConfigError(f"task 'images': size must be >= 16 pixels, got {size}.")
    check_model(tv, model)
    if source == "synthetic":
        if classes < 2 or samples < 1:
            raise ConfigError(f"task 'images': synthetic needs classes >= 2 and samples >= 1, got classes={classes}, samples={samples}.")
        train_set: Dataset = SyntheticImages(samples, size, classes)
        test_set: Dataset | None = None
        n_classes = classes
    else:
        train_set, test_set = folder_sets(tv, data_dir, size, skip_bad)
        n_classes = len(train_set.classes)
    return Task(
        name="images",
        build_model=lambda: build_model(tv, model, n_classes, size),
        train_set=train_set,
        test_set=test_set,
        # The ImageNet reference recipe: SGD with momentum 0.9, lr 0.1 for a global batch of 256
        # (8 processes x 32), 90 epochs (He et al. 2016; Goyal et al. 2017 for the scaling).
        optimizer="sgd",
        lr=0.1,
        batch_size=32,
        epochs=90,
        blocks=resnet_stages if _is_resnet(model) else None,
    )


def _torchvision() -> Any:
    try:
        import torchvision
    except Exception as exc:  # ImportError, or a wheel built for another torch (RuntimeError)
        raise ConfigError(
            f"task 'images' needs torchvision, which cannot be imported ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
            "install it with: pip install 'dtrain[vision]' (a torchvision built for your torch)."
        ) from None
    return torchvision


def check_model(tv: Any, name: str) -> None:
    names = sorted(tv.models.list_models(module=tv.models))
    if name not in names:
        close = difflib.get_close_matches(name, names, n=5, cutoff=0.4)
        hint = f"closest: {', '.join(close)}" if close else f"e.g. {', '.join(names[:5])}"
        raise ConfigError(f"task 'images': torchvision has no classification model {name!r}; {hint} ({len(names)} in all).")


def build_model(tv: Any, name: str, classes: int, size: int) -> nn.Module:
    """A freshly initialised model (``weights=None``: nothing is downloaded)."""
    kwargs: dict[str, Any] = {"weights": None, "num_classes": classes}
    if name in ("googlenet", "inception_v3"):
        kwargs["aux_logits"] = False  # one output tensor in training too
        kwargs["init_weights"] = True
    if name.startswith("vit_"):
        kwargs["image_size"] = size
    model = tv.models.get_model(name, **kwargs)
    return resnet_as_sequential(model) if _is_resnet(name) else model


def resnet_as_sequential(model: nn.Module) -> nn.Sequential:
    """The same ResNet as an ``nn.Sequential`` of its children (``ResNet.forward`` with a stateless
    flatten before ``fc``: state dict keys unchanged), so the pipeline can cut it between stages."""
    names = ("conv1", "bn1", "relu", "maxpool", "layer1", "layer2", "layer3", "layer4", "avgpool")
    parts = [(n, getattr(model, n)) for n in names] + [("flatten", nn.Flatten(1)), ("fc", model.fc)]
    return nn.Sequential(OrderedDict(parts))


def _is_resnet(name: str) -> bool:
    return name.startswith(("resnet", "resnext", "wide_resnet"))


def resnet_stages(model: nn.Module) -> list[nn.Module]:
    """The four stages of a torchvision ResNet: the units of checkpointing, compile, FSDP and stages."""
    return [model.layer1, model.layer2, model.layer3, model.layer4]


def folder_sets(tv: Any, data_dir: str | None, size: int, skip_bad: bool) -> tuple[ImageFolderSet, ImageFolderSet | None]:
    if not data_dir:
        raise ConfigError("task 'images' needs --data-dir DIR holding DIR/train/CLASS/*.jpg (or --task-arg source=synthetic).")
    train_dir = os.path.join(data_dir, "train")
    if not os.path.isdir(train_dir):
        raise DataError(f"task 'images': no train/ folder in {data_dir!r}; lay it out as DIR/train/CLASS/*.jpg (and DIR/val/CLASS/*.jpg).")
    classes = sorted(e.name for e in os.scandir(train_dir) if e.is_dir())
    if not classes:
        raise DataError(f"task 'images': {train_dir!r} has no class sub-folders; put each class's images in train/CLASS/.")
    index = {c: i for i, c in enumerate(classes)}
    t = tv.transforms
    augment = t.Compose([t.RandomResizedCrop(size), t.RandomHorizontalFlip(), t.ToTensor(), t.Normalize(MEAN, STD)])
    train = ImageFolderSet(_scan(tv, train_dir, index), classes, augment, skip_bad=skip_bad, keyed=True)
    train.sample_bytes = 3 * size * size * 4  # one decoded float image: sizes the prefetch (dtrain.data.plan)
    val_dir = os.path.join(data_dir, "val")
    if not os.path.isdir(val_dir):
        return train, None
    extra = sorted(e.name for e in os.scandir(val_dir) if e.is_dir() and e.name not in index)
    if extra:
        raise DataError(f"task 'images': val/ has classes that train/ lacks: {', '.join(extra[:5])}; give both the same class folders.")
    val_index = {c: i for c, i in index.items() if os.path.isdir(os.path.join(val_dir, c))}
    center = t.Compose([t.Resize(int(size * 256 / 224)), t.CenterCrop(size), t.ToTensor(), t.Normalize(MEAN, STD)])
    return train, ImageFolderSet(_scan(tv, val_dir, val_index), classes, center, skip_bad=skip_bad, keyed=False)


def _scan(tv: Any, folder: str, index: dict[str, int]) -> list[tuple[str, int]]:
    try:
        return tv.datasets.folder.make_dataset(folder, index, extensions=tv.datasets.folder.IMG_EXTENSIONS, allow_empty=True)
    except (FileNotFoundError, OSError) as exc:
        raise DataError(f"task 'images': cannot list {folder!r} ({exc}); check the folder.") from None


class ImageFolderSet(Dataset):
    """(path, class) pairs, decoded with PIL and transformed on read; ``epoch_keyed``: read by
    ``(seed, epoch, index)`` keys (see the module docstring), else a plain index."""

    def __init__(self, samples: list[tuple[str, int]], classes: list[str], transform: Callable[[Any], torch.Tensor],
                 *, skip_bad: bool, keyed: bool) -> None:
        if not samples:
            raise DataError("task 'images': found no image files (.jpg, .jpeg, .png, ...) in the class folders; check --data-dir.")
        self.samples = samples
        self.classes = classes
        self.transform = transform
        self.skip_bad = skip_bad
        self.epoch_keyed = keyed
        self._bad = torch.zeros(65, dtype=torch.int64).share_memory_()  # one slot per worker (+ main)
        self._warned: set[str] = set()

    def __len__(self) -> int:
        return len(self.samples)

    @property
    def skipped(self) -> int:
        """Reads of unreadable images that were replaced by the next readable one (this rank)."""
        return int(self._bad.sum())

    def __getitem__(self, key: int | tuple[int, int, int]) -> tuple[torch.Tensor, int]:
        seed = None
        if isinstance(key, tuple):
            run_seed, epoch, index = key
            seed = (run_seed * 1_000_003 + epoch) * 2_147_483_647 + index
        else:
            index = key
        img, target = self._read(index)
        if seed is None:
            return self.transform(img), target
        # The transforms draw from the global CPU generator: seed it for this sample, then put
        # back its state (the caller's stream is untouched). Not torch.manual_seed/fork_rng: they
        # also visit every accelerator's generator, ~1 ms a call (measured), more than a decode.
        gen = torch.default_generator
        state = gen.get_state()
        try:
            gen.manual_seed(seed % (2**63))
            return self.transform(img), target
        finally:
            gen.set_state(state)

    def _read(self, index: int) -> tuple[Any, int]:
        from PIL import Image

        for _ in range(len(self.samples)):
            path, target = self.samples[index]
            try:
                with Image.open(path) as im:
                    return im.convert("RGB"), target
            except (OSError, ValueError, SyntaxError) as exc:  # PIL's UnidentifiedImageError is an OSError
                if not self.skip_bad:
                    raise DataError(
                        f"cannot read image {path} ({exc}); fix or remove it, or pass --task-arg skip_bad=true to skip unreadable images."
                    ) from None
                self._note_bad(path, exc)
                index = (index + 1) % len(self.samples)  # deterministic stand-in: exact resume still holds
        raise DataError("task 'images': no image in the folder can be read; check --data-dir.")

    def _note_bad(self, path: str, exc: Exception) -> None:
        info = get_worker_info()
        self._bad[64 if info is None else info.id % 64] += 1
        if path not in self._warned:
            self._warned.add(path)
            logger.warning(f"skipping unreadable image {path} ({exc})")


class SyntheticImages(Dataset):
    """``samples`` random images of ``3 x size x size`` with random labels from a fixed pool of 64."""

    in_memory = True  # nothing to decode: DataLoader workers would only add copies

    def __init__(self, samples: int, size: int, classes: int) -> None:
        g = torch.Generator().manual_seed(0)
        pool = min(64, samples)
        self.images = torch.randn(pool, 3, size, size, generator=g)
        self.labels = torch.randint(0, classes, (pool,), generator=g)
        self.samples = samples

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(index, tuple):
            index = index[-1]
        return self.images[index % len(self.images)], self.labels[index % len(self.images)]

    def device_batch(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One batch of ``size`` samples, which ``DeviceLoader`` moves to the device once and hands
        out for every step: a synthetic run measures the model alone."""
        index = torch.arange(size) % len(self.images)
        return self.images[index], self.labels[index]
