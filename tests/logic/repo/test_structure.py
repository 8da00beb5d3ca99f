"""The strategy contract, the --comm rule, the DTRAIN_* options and the import map (tier 1: no process group)."""

from __future__ import annotations

import ast
import pathlib

import pytest

from dtrain import options, strategies
from dtrain.comm import CommSpec
from dtrain.errors import ConfigError
from dtrain.options import LaunchLink, Options
from dtrain.strategies import Capabilities, Strategy
from tests.paths import ROOT


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
           "DTRAIN_PLUGIN": "tests.support.faults", "DTRAIN_LAUNCHER_PID": "123", "DTRAIN_LAUNCH_DIR": "/tmp/x"}
    opts = Options.from_env(env)
    assert (opts.diag.stall_timeout, opts.diag.debug, opts.comm.method, opts.comm.warmup, opts.testing.plugin) == (
        30.0, True, "powersgd:4", 5, "tests.support.faults")
    assert Options.from_env({}) == Options()
    link = LaunchLink.from_env(env)
    assert (link.launcher_pid, link.launch_dir) == (123, "/tmp/x") and LaunchLink.from_env({}) == LaunchLink()
    with pytest.raises(ConfigError, match=r"DTRAIN_STALL_TIMEOUT='soon' is not a number of seconds"):
        Options.from_env({"DTRAIN_STALL_TIMEOUT": "soon"})


def test_options_go_back_to_the_variables_they_came_from():
    env = {"DTRAIN_STALL_TIMEOUT": "30.0", "DTRAIN_DEBUG": "1", "DTRAIN_RUN_DIR": "/r", "DTRAIN_COMM": "fp16",
           "DTRAIN_COMM_WARMUP": "5", "DTRAIN_PARALLEL": "dp_shard=2", "DTRAIN_STARTUP_TIMEOUT": "60.0",
           "DTRAIN_PLUGIN": "tests.support.faults", "DTRAIN_FAKE_GPUS": "2",
           "DTRAIN_LAUNCHER_PID": "123", "DTRAIN_LAUNCH_DIR": "/tmp/x", "DTRAIN_ELASTIC": "job@h:1",
           "DTRAIN_LOCAL_RANK_ARG": "--local_rank"}
    opts = Options.from_env(env)
    assert opts.testing.plugin == "tests.support.faults" and opts.testing.fake_gpus == 2
    assert opts.to_env() == env and Options().to_env() == {}
    assert LaunchLink.from_env({"DTRAIN_LAUNCHER_PID": "x"}).launcher_pid == 0  # the link never fails


def test_options_are_parsed_once_and_handed_over_through_one_writer(monkeypatch):
    parses = []
    real = options.Diagnostics.from_env.__func__
    monkeypatch.setattr(options.Diagnostics, "from_env", classmethod(lambda cls, env: parses.append(1) or real(cls, env)))
    monkeypatch.delenv("DTRAIN_DEBUG", raising=False)
    monkeypatch.setenv("DTRAIN_STALL_TIMEOUT", "30")
    assert options.current().diag.stall_timeout == 30.0 and options.current().diag.debug is False
    assert len(parses) == 1  # the second read comes from the cache
    previous = options.hand_over(diag={"debug": True, "stall_timeout": 900.0})  # 900 is the default: the variable goes
    assert previous == {"DTRAIN_DEBUG": None, "DTRAIN_STALL_TIMEOUT": "30"}
    assert options.current().diag == options.Diagnostics(debug=True) and len(parses) == 2
    options.put_back(previous)
    assert options.current().diag.stall_timeout == 30.0 and not options.current().diag.debug
    with pytest.raises(ConfigError, match=r"run option debug \(DTRAIN_DEBUG\) got str"):
        options.hand_over(diag={"debug": "yes"})


# -- the map holds (../shared/STYLE.md): imports flow one way, no cycles --------------------------------------------

SRC = ROOT / "src" / "dtrain"

LAYERS = {
    # 0: the command and its entry point
    "cli": 0, "__main__": 0,
    # 1: the faces: the ready job (its fault-tolerant loop too, train/ft_replica.py), tasks, bench, launcher,
    # legacy APIs, the planner and its dry run, the package root
    "train": 1, "tasks": 1, "bench": 1, "plan": 1, "dryrun": 1, "launch": 1, "compat": 1, "dtrain": 1,
    # 2: what a training script holds (the context and its parts: step, evaluation, start-up, preemption)
    "context": 2,
    # 3: the mechanisms
    "strategies": 3, "parallel": 3, "precision": 3, "comm": 3, "data": 3, "checkpoint": 3, "metrics": 3, "diag": 3,
    "options": 3,
    # per-step fault tolerance on torchft (ft/: the spec, the global order, the ledger, the Manager's session, the
    # groups' launcher): under both the ready job and the context
    "ft": 3,
    # 4: the ground: who and where (world/: sources, device, process group, interfaces, SLURM), errors, helpers
    "world": 4, "errors": 4, "_log": 4, "_version": 4, "_check": 4,
}
"""Each top-level module or folder of dtrain and its floor; a module may import its own floor and those below."""


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in SRC.rglob("*.py"):
        parts = ("dtrain", *path.relative_to(SRC).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(name: str, path: pathlib.Path, modules: dict[str, pathlib.Path], *, top_level: bool) -> set[str]:
    """The dtrain modules ``name`` imports (TYPE_CHECKING imports too; inside functions unless ``top_level``),
    without its own parent packages (Python imports those first anyway), except the package root."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if top_level and isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            if isinstance(child, ast.Import):
                found.update(a.name for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    up = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join([*up, base] if base else up)
                found.update(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in child.names)
            visit(child)

    visit(ast.parse(path.read_text()))
    out = set()
    for target in found:
        while target and target not in modules:
            target = target.rpartition(".")[0]
        if target and target != name and (target == "dtrain" or not name.startswith(target + ".")):
            out.add(target)
    return out


def _unit(name: str) -> str:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else "dtrain"


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
            if len(component) > 1:
                out.append(sorted(component))

    for v in graph:
        if v not in index:
            connect(v)
    return out


def test_no_import_cycles():
    modules = _modules()
    graph = {name: _imports(name, path, modules, top_level=True) for name, path in modules.items()}
    assert _cycles(graph) == []


def test_every_module_has_a_floor():
    assert sorted({_unit(name) for name in _modules()} - set(LAYERS)) == []


def test_imports_point_down_the_floors():
    modules = _modules()
    upward = []
    for name, path in sorted(modules.items()):
        for target in sorted(_imports(name, path, modules, top_level=False)):
            if _unit(target) != _unit(name) and LAYERS[_unit(target)] < LAYERS[_unit(name)]:
                upward.append(f"{name} -> {target}")
    assert upward == []


def test_no_two_folders_import_each_other():
    modules = _modules()
    uses: dict[str, set[str]] = {}
    for name, path in modules.items():
        uses.setdefault(_unit(name), set()).update(_unit(t) for t in _imports(name, path, modules, top_level=False))
    mutual = sorted(f"{a} <-> {b}" for a in uses for b in uses[a] if a < b and a in uses.get(b, ()) and "dtrain" not in (a, b))
    assert mutual == []


def test_the_package_root_holds_only_the_public_face():
    """The root keeps the public package, the errors, the two public values and private helpers; every layer else
    lives in a folder (STYLE.md's map: world/, context/, the mechanisms' folders)."""
    loose = sorted(p.stem for p in SRC.glob("*.py"))
    assert loose == ["__init__", "__main__", "_check", "_log", "_version", "errors", "options", "precision"], loose
    assert set(LAYERS) == {p.name for p in SRC.iterdir() if p.is_dir() and (p / "__init__.py").exists()} | {
        *loose, "dtrain"} - {"__init__"}


def _all_imports(path: pathlib.Path) -> set[str]:
    """Every module name ``path`` imports, absolute as written (relative imports made absolute from dtrain's)."""
    parts = ("dtrain", *path.relative_to(SRC).with_suffix("").parts)
    package = parts if path.name == "__init__.py" else parts[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = [*package[: len(package) - node.level + 1]] if node.level else []
            module = ".".join([*base, node.module] if node.module else base)
            found.add(module)
            found.update(f"{module}.{a.name}" for a in node.names)
    return found


def test_the_package_never_imports_the_test_harness():
    """What only tests and benchmarks use lives in tests/support/ (STYLE.md: the package is the product; the lab
    stays with the tests): no module of dtrain imports ``tests`` (or the old ``dtrain.testing``), and the wheel,
    built from src/ only, holds no harness."""
    assert not (SRC / "testing").exists()
    bad = sorted(f"{path.relative_to(SRC)} imports {name}" for path in SRC.rglob("*.py") for name in _all_imports(path)
                 if name == "tests" or name.startswith(("tests.", "dtrain.testing")))
    assert bad == []
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert '[tool.setuptools.packages.find]\nwhere = ["src"]' in pyproject  # tests/ never goes into the wheel
    assert (ROOT / "tests" / "support" / "__init__.py").exists()
