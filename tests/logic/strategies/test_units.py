"""Plain logic: precision, strategies registry, config validation, checkpoints, tasks."""


import pytest

from dtrain import ConfigError, strategies


def test_unknown_strategy_lists_the_known_ones():
    with pytest.raises(ConfigError, match=r"unknown strategy 'fdsp'; choose one of: .*ddp.*single"):
        strategies.build("fdsp")
