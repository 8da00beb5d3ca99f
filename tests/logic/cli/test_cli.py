"""The command line as a user meets it: launchers, the ready job, and one clear line for bad input."""

from __future__ import annotations

import gzip
import shutil
import socket

import pytest

from tests.paths import TESTS
from tests.support import run_cli_here

SCRIPT = str(TESTS / "scripts" / "allreduce.py")


def test_rendezvous_listens_on_loopback_only():
    psutil = pytest.importorskip("psutil")
    from dtrain.launch.store import host_store

    store, port = host_store("127.0.0.1", 0)
    try:
        listening = [c for c in psutil.Process().net_connections(kind="tcp") if c.status == "LISTEN" and c.laddr.port == port]
        assert listening and all(c.laddr.ip == "127.0.0.1" for c in listening)
    finally:
        del store


@pytest.fixture
def bad(capsys):
    """Run ``dtrain ARGS`` in this process: it must end with the one line holding ``expect`` (returned),
    exit status 2. (As subprocesses they cost an interpreter start each; a real process's single line
    is checked by tests/multiprocess/cli/test_bad_inputs.py's subprocess cases.)"""
    def check(args: list[str], expect: str) -> str:
        code = run_cli_here(args)
        err = capsys.readouterr().err.strip()
        _one_line(code, err, expect)
        return err

    return check


def _one_line(code: int, err: str, expect: str) -> None:
    assert code == 2, (code, err)
    assert "Traceback" not in err
    assert len(err.splitlines()) == 1, f"expected one line, got:\n{err}"
    assert err.startswith("dtrain: error: ") and expect in err, err


def test_bad_strategy(bad):
    bad(["train", "--strategy", "fdsp"], "unknown strategy 'fdsp'; choose one of:")


def test_bad_precision(bad):
    bad(["train", "--precision", "fp8"], "unknown precision 'fp8'; choose one of: fp32, bf16-mixed, fp16-mixed")


def test_bad_task(bad):
    bad(["train", "--task", "imagenet"], "unknown task 'imagenet'")


def test_missing_data_dir(bad, tmp_path):
    bad(["train", "--task", "mnist", "--data-dir", str(tmp_path / "nope")], "does not exist")


def test_missing_data_file(bad, tmp_path):
    bad(["train", "--task", "mnist", "--data-dir", str(tmp_path)], "has no train-images-idx3-ubyte.gz")


def test_corrupt_idx_file(bad, tmp_path, mnist_dir):
    for f in mnist_dir.glob("*-ubyte.gz"):
        shutil.copy(f, tmp_path / f.name)
    labels = tmp_path / "t10k-labels-idx1-ubyte.gz"
    labels.write_bytes(gzip.compress(gzip.decompress(labels.read_bytes())[:-100]))
    bad(["train", "--task", "mnist", "--data-dir", str(tmp_path)], "t10k-labels-idx1-ubyte.gz holds")


def test_zero_processes(bad):
    bad(["train", "-n", "0"], "-n/--nproc must be >= 1, got 0")
    bad(["run", "-n", "0", SCRIPT], "-n/--nproc must be >= 1, got 0")


def test_port_in_use(bad):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        bad(["train", "-n", "2", "--master-port", str(port)], f"--master-port {port} is already in use")


def test_batch_not_divisible_by_grad_accum(bad):
    bad(["train", "--batch-size", "48", "--grad-accum", "5"], "--batch-size 48 is not divisible by --grad-accum 5")


def test_unknown_flag_is_one_line(bad):
    bad(["train", "--epoch", "3"], "unrecognized arguments")


def test_missing_script(bad):
    bad(["run", "-n", "2", "nope.py"], "script nope.py does not exist")


def test_cli_bad_layout_is_one_line(bad):
    bad(["train", "--task", "digits", "-n", "2", "--parallel", "dp_shard=3"],
        "dtrain: error: --parallel dp_shard=3: dp_shard=3 = 3 processes, but the job has 2; "
        "make the product 2 (e.g. dp_shard=2 with the rest as given).")


def test_run_checks_the_layout_before_starting_workers(bad, tmp_path):
    script = tmp_path / "s.py"
    script.write_text("raise SystemExit('must not run')\n")
    bad(["run", "-n", "2", "--parallel", "tp=4", str(script)],
        "dtrain: error: --parallel tp=4: tp=4 = 4 processes, but the job has 2; make the product 2, or start 4 processes.")


def test_cli_bad_comm_is_one_line_and_status_2(bad):
    bad(["train", "--task", "digits", "-n", "2", "--comm", "powersgd:0"],
        "dtrain: error: --comm powersgd:0: the rank must be an integer >= 1 (e.g. powersgd:2).")


# Refused before any process starts; each ran as a subprocess in its area's multi-process file.
def test_lm_corpus_too_small_is_one_line(bad, tmp_path):
    (tmp_path / "tiny.txt").write_bytes(b"hello world")
    line = bad(["train", "--task", "lm", "--data-dir", str(tmp_path / "tiny.txt")], "dtrain: error: task 'lm': the corpus of")
    assert "11 bytes" in line, line


def test_fsdp_wrap_without_fsdp_is_one_line(bad):
    bad(["train", "--strategy", "ddp", "--fsdp-wrap", "Linear"], "--fsdp-wrap applies to --strategy fsdp or hsdp")


@pytest.mark.parametrize("flags, message", [
    (["--startup-timeout", "0"], "argument --startup-timeout: it must be a finite number of seconds >= 1, got 0"),
    (["--nnodes", "1:2", "--master-addr", "127.0.0.1", "--local-addr", "192.0.2.77"],
     "--local-addr 192.0.2.77 is not an address of this host"),
])
def test_bad_address_flags_end_in_one_line(bad, tmp_path, flags, message):
    bad(["train", "--task", "digits", "--max-steps", "2", "--checkpoint-dir", str(tmp_path / "ck"), "--save-every", "1", *flags],
        message)


def test_run_on_a_port_in_use_is_one_line(bad):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        bad(["run", "-n", "2", "--master-port", str(port), SCRIPT], f"--master-port {port} is already in use on 127.0.0.1; choose another port")
