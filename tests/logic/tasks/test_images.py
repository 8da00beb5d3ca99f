"""The `images` task on a small folder of real JPEG files (MNIST digits written as RGB JPEGs at
test time), its bad inputs, its synthetic source, exact resume with DataLoader workers, and the
data-wait figures of `dtrain train`."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import TensorDataset

from dtrain.data import ShardSampler, default_num_workers, loader_options
from dtrain.errors import ConfigError, DataError
from dtrain.metrics import DataWait, meters
from tests.paths import ROOT

MNIST_DIR = ROOT.parent / "shared" / "data" / "mnist"
SIZE = "32"  # pixels: tiny, so resnet18 runs a step in well under a second on a CPU


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """10 classes x (20 train + 5 val) JPEGs of 32 x 32 pixels."""
    from tests.support.images import write_digit_folder

    return write_digit_folder(tmp_path_factory.mktemp("digits-jpeg"), size=32, mnist_dir=MNIST_DIR)


def _load(**kw):
    from dtrain.tasks import load_task

    data_dir = kw.pop("data_dir", None)
    return load_task("images", data_dir=data_dir, options={k: str(v) for k, v in kw.items()})


# -- plain logic -------------------------------------------------------------------------------

def test_default_workers_follow_the_cores_per_process():
    in_memory = TensorDataset(torch.zeros(4, 1))
    assert default_num_workers(in_memory, 1, cpus=64) == 0  # nothing to decode
    files = torch.utils.data.Dataset()
    assert default_num_workers(files, 2, cpus=2) == 0  # one core per process: none to spare
    assert default_num_workers(files, 1, cpus=4) == 3  # one core for the training process
    assert default_num_workers(files, 8, cpus=96) == 8  # capped
    assert loader_options(0, torch.device("cpu")) == {"num_workers": 0, "pin_memory": False}
    assert loader_options(2, torch.device("cuda")) == {"num_workers": 2, "pin_memory": True, "persistent_workers": True, "prefetch_factor": 2,
                                                       **({"multiprocessing_context": "fork"} if sys.platform.startswith("linux") else {})}


def test_data_wait_keeps_the_first_batch_apart_and_takes_medians(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(meters, "time", SimpleNamespace(perf_counter=lambda: now[0]))  # this module's clock only
    w = DataWait()
    assert w.median_ms() is None
    for wait_s in (0.5, 0.010, 0.030, 0.020):  # the first (the workers' start) is kept apart
        w.ready()
        now[0] += wait_s
        w.got_batch()
        now[0] += 1.0  # the step itself, not a wait
    assert w.first_ms == 500.0 and w.steps == 3 and w.total_s == pytest.approx(0.060)
    assert w.window_median_ms() == 20.0 and w.window_median_ms() is None  # a window empties when read
    assert w.median_ms() == 20.0


def test_channels_last_changes_conv_weights_and_says_when_there_are_none(monkeypatch):
    import dtrain.parallel.convnets as convnets
    from dtrain.strategies import build

    said: list[str] = []
    monkeypatch.setattr(convnets, "note_once", said.append)
    conv = convnets.apply_channels_last(torch.nn.Conv2d(3, 4, 3), build("single"))
    assert conv.weight.is_contiguous(memory_format=torch.channels_last) and said == []
    convnets.apply_channels_last(torch.nn.Linear(3, 4), build("single"))
    assert len(said) == 1 and "no 4-D (convolution) weights" in said[0], said


def test_keyed_sampler_yields_seed_epoch_index():
    s = ShardSampler(10, rank=1, world_size=2, seed=7, keyed=True)
    keys = list(iter(s))
    assert all(k[:2] == (7, 0) for k in keys) and sorted(k[2] for k in keys) == sorted(list(ShardSampler(10, rank=1, world_size=2, seed=7))[:5])


def test_augmentation_is_keyed_on_the_sample_not_the_reader(folder):
    pytest.importorskip("torchvision")
    ds = _load(data_dir=folder, size=SIZE).train_set
    torch.manual_seed(1)
    before = torch.rand(1)
    a, b = ds[(0, 3, 5)], ds[(0, 3, 5)]
    torch.manual_seed(1)
    assert torch.equal(torch.rand(1), before)  # the caller's random stream is untouched
    assert torch.equal(a[0], b[0]) and a[1] == b[1]
    assert not torch.equal(ds[(0, 4, 5)][0], a[0])  # another epoch: another crop


def test_folder_task_shape(folder):
    pytest.importorskip("torchvision")
    task = _load(data_dir=folder, size=SIZE)
    assert len(task.train_set) == 200 and len(task.test_set) == 50 and task.train_set.classes[0] == "digit0"
    model = task.build_model()
    assert model.fc.out_features == 10  # num_classes from the folder
    assert [type(b).__name__ for b in task.blocks(model)] == ["Sequential"] * 4  # ResNet stages
    x, y = task.train_set[0]
    assert x.shape == (3, 32, 32) and x.dtype == torch.float32 and 0 <= y < 10
    assert task.test_set[0][0].shape == (3, 32, 32)


def test_resnets_are_sequential_with_torchvisions_names_and_outputs():
    """So that pipeline can cut them between stages; the same weights, keys and outputs."""
    tv = pytest.importorskip("torchvision")
    from dtrain.tasks.images import resnet_as_sequential

    torch.manual_seed(0)
    plain = tv.models.resnet18(weights=None, num_classes=4).eval()
    seq = resnet_as_sequential(plain).eval()
    assert isinstance(seq, torch.nn.Sequential) and list(seq.state_dict()) == list(plain.state_dict())
    x = torch.randn(2, 3, 32, 32)
    assert torch.equal(seq(x), plain(x))


# -- bad input ---------------------------------------------------------------------------------

def test_bad_folders_and_model_names_say_what_and_how(folder, tmp_path):
    pytest.importorskip("torchvision")
    with pytest.raises(DataError, match=r"no train/ folder in .*DIR/train/CLASS"):
        _load(data_dir=tmp_path)
    (tmp_path / "train").mkdir()
    with pytest.raises(DataError, match="has no class sub-folders"):
        _load(data_dir=tmp_path)
    with pytest.raises(ConfigError, match="needs --data-dir"):
        _load()
    with pytest.raises(ConfigError, match=r"no classification model 'resnet19'; closest: resnet18, .*resnet101"):
        _load(data_dir=folder, model="resnet19")
    with pytest.raises(ConfigError, match="source 'imagenet' unknown"):
        _load(data_dir=folder, source="imagenet")


def test_missing_torchvision_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchvision", None)  # import torchvision now raises ImportError
    with pytest.raises(ConfigError, match=r"pip install 'dtrain\[vision\]'"):
        _load(source="synthetic")


@pytest.fixture
def broken(folder, tmp_path) -> tuple[Path, Path]:
    import shutil

    shutil.copytree(folder, tmp_path / "d")
    bad = tmp_path / "d" / "train" / "digit3" / "00002.jpg"
    bad.write_bytes(bad.read_bytes()[:40])  # a JPEG cut short: the header parses, the data does not
    return tmp_path / "d", bad


def test_skip_bad_replaces_and_counts_unreadable_images(broken):
    pytest.importorskip("torchvision")
    data, bad = broken
    ds = _load(data_dir=data, size=SIZE, skip_bad="true").train_set
    i = next(n for n, (p, _) in enumerate(ds.samples) if p == str(bad))
    x, y = ds[i]
    assert ds.skipped == 1 and x.shape == (3, 32, 32)
    assert y == ds.samples[i + 1][1]  # the next readable image stands in, the same on every read
    assert ds[i][1] == y and ds.skipped == 2
