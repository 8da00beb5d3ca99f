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


def test_user_task_from_module_function():
    task = load_task("tests.user_task:make", options={"hidden": "8"})
    assert task.name == "tests.user_task:make"
    assert task.build_model()[0].out_features == 8
