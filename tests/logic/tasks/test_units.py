"""Plain logic: precision, strategies registry, config validation, checkpoints, tasks."""


import pytest

from dtrain import ConfigError
from dtrain.tasks import load_task


def test_digits_task_and_unknown_task():
    task = load_task("digits")
    assert len(task.train_set) + len(task.test_set) == 1797
    with pytest.raises(ConfigError, match="unknown task 'imagenet'"):
        load_task("imagenet")
    with pytest.raises(ConfigError, match="takes no option 'depth'"):
        load_task("digits", options={"depth": "3"})


def test_digits_are_read_from_scikit_learns_file_as_load_digits_reads_them(monkeypatch):
    """The task reads the file scikit-learn ships (no import of scikit-learn in each process):
    the same pixels and labels as ``load_digits``, by the file or by the fallback."""
    load_digits = pytest.importorskip("sklearn.datasets").load_digits
    from dtrain.tasks import digits

    expected = load_digits()
    pixels, labels = digits.load_arrays()
    assert pixels.dtype == expected.data.dtype and (pixels == expected.data).all()
    assert labels.dtype.name == "int64" and (labels == expected.target).all()
    monkeypatch.setattr(digits.os.path, "isfile", lambda path: False)  # a layout without the file
    assert (digits.load_arrays()[0] == expected.data).all()
    monkeypatch.setattr(digits.importlib.util, "find_spec", lambda name: None)  # scikit-learn missing
    with pytest.raises(ConfigError, match=r"needs scikit-learn; install it with: pip install 'dtrain\[digits\]'"):
        load_task("digits")


def test_user_task_from_module_function():
    task = load_task("tests.user_task:make", options={"hidden": "8"})
    assert task.name == "tests.user_task:make"
    assert task.build_model()[0].out_features == 8
