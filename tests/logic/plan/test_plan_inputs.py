"""The plan's inputs parsed where they enter (``dtrain.plan.inputs``): what a links file says
measured it, and the doctor's ``--links-out`` file as ``dtrain plan --links`` reads it back."""

from __future__ import annotations

import json

import pytest

from dtrain.errors import ConfigError
from dtrain.plan import cluster, costs, inputs

_SECONDS = {k: {"64": 1e-3, "1048576": 0.05, "4194304": 0.2} for k in costs.SHAPES}


def test_a_links_record_says_the_backend_and_device_that_measured_it():
    old = {"between": "nodes", "ranks": 2, "backend": "nccl", "seconds": _SECONDS}  # written before "device" was
    assert costs.from_record(old).device == "cuda"
    assert costs.from_record({**old, "backend": "gloo"}).device == "cpu"
    got = costs.from_record({**old, "device": "cpu", "backend": "gloo"})
    assert got.device == "cpu" and got.describe()["device"] == "cpu"
    with pytest.raises(ConfigError, match="links.json: \"device\" is \"tpu\"; a link measurement is on 'cpu' or 'cuda'"):
        costs.from_record({**old, "device": "tpu"}, "links.json")


def test_the_doctors_links_out_is_what_plan_reads_and_its_folder_is_made(tmp_path):
    from dtrain.cli.doctor_checks import DoctorConfig
    from dtrain.cli.doctor_probe import _write_links

    out = tmp_path / "new" / "links.json"  # --links-out's check allows a folder still to be made
    cfg = DoctorConfig(nnodes=1, node_rank=0, master_addr=None, master_port=None, probe=True, timeout_s=30, links_out=str(out))
    seconds = {k: {int(b): s for b, s in v.items()} for k, v in _SECONDS.items()}
    assert "written to" in _write_links(cfg, seconds, 2, "gloo")
    assert json.loads(out.read_text())["device"] == "cpu"
    back = costs.load(str(out))
    assert (back.backend, back.device, back.between) == ("gloo", "cpu", "processes")


def test_a_cluster_file_is_parsed_once_into_typed_values(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("device: h100\nnodes: 4\npeak_tflops: 989\ntree: false\nintra_latency_us: 5\n")
    got = cluster.load_file(str(f))
    assert got == {"device": "h100", "nodes": 4, "peak_tflops": 989.0, "tree": False, "intra_latency_us": 5.0}
    assert type(got["peak_tflops"]) is float and type(got["nodes"]) is int
    c = cluster.build(got)
    assert c.tree is False and c.intra_lat == pytest.approx(5e-6)
    f.write_text("device: h100\ntree: 'no'\n")  # bool('no') was True: a string is not a yes/no
    with pytest.raises(ConfigError, match="\"tree\" is \"no\", not true or false"):
        cluster.load_file(str(f))


def test_the_flags_are_named_by_their_flags():
    assert inputs.cluster_settings({"peak_tflops": 989, "nodes": None}) == {"peak_tflops": 989.0}
    with pytest.raises(ConfigError, match=r"^--nnodes 0: the number of nodes must be a whole number from 1 to 262,144; e\.g\. --nnodes 4\.$"):
        inputs.cluster_settings({"nodes": 0})
    with pytest.raises(ConfigError, match=r"^--peak-tflops -5: "):
        inputs.cluster_settings({"peak_tflops": -5.0})
