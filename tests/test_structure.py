"""The strategy contract, the --comm rule and the DTRAIN_* options (tier 1: no process group)."""

from __future__ import annotations

import pytest

from dtrain import strategies
from dtrain.comm import CommSpec
from dtrain.errors import ConfigError
from dtrain.options import Options, launcher_link
from dtrain.strategies import Capabilities, Strategy


@pytest.mark.parametrize("name", strategies.available())
def test_every_strategy_meets_the_contract(name):
    strat = strategies.build(name)
    assert isinstance(strat, Strategy) and strat.name == name
    assert isinstance(type(strat).capabilities, Capabilities)


def test_capabilities_answer_what_callers_ask():
    caps = {name: strategies.build(name).capabilities for name in strategies.available()}
    assert [n for n, c in caps.items() if c.sharded_state] == ["composed", "fsdp", "hsdp", "pipeline"]
    assert [n for n, c in caps.items() if c.collective_forward] == ["composed", "fsdp", "hsdp"]
    assert [n for n, c in caps.items() if c.staged_step] == ["pipeline"]
    assert [n for n, c in caps.items() if c.supports_comm] == ["ddp"]


def test_comm_rule_lives_where_strategies_are_built():
    fp16 = CommSpec.parse("fp16")
    assert strategies.build("auto", comm=fp16, distributed=True).config.comm == fp16  # auto -> ddp
    assert strategies.build("auto", distributed=False).name == "single"
    with pytest.raises(ConfigError, match="works with the ddp strategy, not 'fsdp'"):
        strategies.build("fsdp", comm=fp16, distributed=True)
    assert strategies.build("fsdp", comm=fp16, distributed=False).name == "fsdp"  # one process: a note
    assert strategies.comm_options("zero1", CommSpec.parse("none"), distributed=True) == {}


def test_options_read_every_dtrain_setting_once():
    env = {"DTRAIN_STALL_TIMEOUT": "30", "DTRAIN_DEBUG": "1", "DTRAIN_COMM": "powersgd:4", "DTRAIN_COMM_WARMUP": "5",
           "DTRAIN_FAULT_INJECT": "1:25", "DTRAIN_LAUNCHER_PID": "123", "DTRAIN_LAUNCH_DIR": "/tmp/x"}
    opts = Options.from_env(env)
    assert (opts.stall_timeout, opts.debug, opts.comm, opts.comm_warmup, opts.fault_inject) == (30.0, True, "powersgd:4", 5, (1, 25))
    assert Options.from_env({}) == Options()
    assert launcher_link(env) == (123, "/tmp/x") and launcher_link({}) == (0, None)
    with pytest.raises(ConfigError, match=r"DTRAIN_FAULT_INJECT='x' is not RANK:STEP"):
        Options.from_env({"DTRAIN_FAULT_INJECT": "x"})
    with pytest.raises(ConfigError, match=r"DTRAIN_STALL_TIMEOUT='soon' is not a number of seconds"):
        Options.from_env({"DTRAIN_STALL_TIMEOUT": "soon"})
