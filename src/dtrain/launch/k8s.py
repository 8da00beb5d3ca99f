"""A job description as a Kubeflow ``PyTorchJob`` (training-operator, ``kubeflow.org/v1``;
docs/clusters.md).

One pod per node, on the static rendezvous the Master pod hosts on its pod IP; Worker pods reach
it through the operator's service ``<name>-master-0`` and take their node rank from the
``replica-index`` label (the operator's environment variables differ between its versions). An
elastic job is the operator's elastic form: Worker pods only, the rendezvous on ``<name>-worker-0``.
"""

from __future__ import annotations

import json
import re
import shlex
from typing import Any

from ..errors import ConfigError
from .jobspec import JobSpec, mem_mib, time_seconds
from .jobvalues import dns_label
from .sbatch import job_env

API_VERSION = "kubeflow.org/v1"
INDEX_LABEL = "training.kubeflow.org/replica-index"
#: How long a worker waits for the master's service name to resolve (it appears once the master runs).
DNS_WAIT_S = 300


def render(job: JobSpec) -> dict[str, Any]:
    """The PyTorchJob manifest for ``job``, as a dict (``to_yaml``/``json.dumps`` to write it)."""
    if not job.k8s.image:
        raise ConfigError('a Kubernetes job needs an image: set [k8s] image = "registry/you/train:tag" or --image.')
    # 50, not 63: the operator names the pods' services <name>-master-0 and <name>-worker-N.
    dns_label("job name", job.name, limit=50)
    if job.layout != "node":
        raise ConfigError("layout 'process' is SLURM's; on Kubernetes each pod is a node running procs_per_node processes (layout 'node').")
    spec: dict[str, Any] = {}
    if job.elastic:
        # The operator's elastic form: no Master; its endpoint convention is <name>-worker-0.
        spec["elasticPolicy"] = {"minReplicas": job.nodes, "maxReplicas": job.max_nodes, "rdzvBackend": "c10d",
                                 "rdzvPort": job.k8s.port, "rdzvHost": f"{job.name}-worker-0", "rdzvId": job.name}
        specs: dict[str, Any] = {"Worker": _replica(job, job.max_nodes, rank0=False, master=f"{job.name}-worker-0")}
    else:
        master = f"{job.name}-master-0"
        specs = {"Master": _replica(job, 1, rank0=True, master=master)}
        if job.nodes > 1:
            specs["Worker"] = _replica(job, job.nodes - 1, rank0=False, master=master)
    run_policy: dict[str, Any] = {"cleanPodPolicy": "None", "backoffLimit": job.k8s.backoff_limit}
    if job.time:
        run_policy["activeDeadlineSeconds"] = time_seconds(job.time)
    return {
        "apiVersion": API_VERSION,
        "kind": "PyTorchJob",
        "metadata": {"name": job.name, "namespace": job.k8s.namespace, "labels": {"app.kubernetes.io/created-by": "dtrain"}},
        "spec": {"runPolicy": run_policy, **spec, "pytorchReplicaSpecs": specs},
    }


def _replica(job: JobSpec, replicas: int, *, rank0: bool, master: str) -> dict[str, Any]:
    port = job.k8s.port
    if rank0:
        node_rank, addr, wait = "0", '"$DTRAIN_POD_IP"', ""
    else:
        node_rank, addr = '"$((DTRAIN_REPLICA_INDEX + 1))"', master
        wait = (f"for i in $(seq {DNS_WAIT_S // 2}); do getent hosts {master} >/dev/null 2>&1 && break; sleep 2; done; ")
    if job.elastic:  # the rendezvous numbers the nodes; every pod names worker-0's service
        launch = ["-n", str(job.procs_per_node), "--nnodes", job.nodes_text(), "--master-addr", "@ADDR@",
                  "--master-port", str(port), "--rdzv-id", job.name]
    else:
        launch = ["-n", str(job.procs_per_node), "--nnodes", str(job.nodes), "--node-rank", "@RANK@", "--master-addr", "@ADDR@",
                  "--master-port", str(port)]
    line = shlex.join(job.task_argv(launch)).replace("@RANK@", node_rank).replace("@ADDR@", addr)
    env = [{"name": k, "value": v} for k, v in job_env(job).items()]
    env += [
        {"name": "DTRAIN_POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "DTRAIN_REPLICA_INDEX", "valueFrom": {"fieldRef": {"fieldPath": f"metadata.labels['{INDEX_LABEL}']"}}},
    ]
    resources: dict[str, dict[str, str]] = {"requests": {}, "limits": {}}
    cpus = job.cpus_per_proc * job.procs_per_node
    resources["requests"]["cpu"] = resources["limits"]["cpu"] = str(cpus)
    if job.mem_per_proc:
        resources["requests"]["memory"] = resources["limits"]["memory"] = f"{mem_mib(job.mem_per_proc) * job.procs_per_node}Mi"
    if job.gpus_per_node:
        resources["limits"]["nvidia.com/gpu"] = str(job.gpus_per_node)
    container: dict[str, Any] = {
        "name": "pytorch",  # the operator finds the training container by this name
        "image": job.k8s.image,
        "command": ["/bin/sh", "-c", wait + "exec " + line],
        "env": env,
        "ports": [{"name": "pytorchjob-port", "containerPort": port}],
        "resources": resources,
        # DataLoader workers share tensors through /dev/shm, which is 64 MiB in a pod by default.
        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}],
    }
    if job.k8s.image_pull_policy:
        container["imagePullPolicy"] = job.k8s.image_pull_policy
    if job.workdir:
        container["workingDir"] = job.workdir
    return {
        "replicas": replicas,
        "restartPolicy": "OnFailure",
        "template": {"spec": {"containers": [container], "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]}},
    }


def to_yaml(value: Any, indent: int = 0) -> str:
    """Block-style YAML; every string double-quoted as JSON writes it (a valid YAML scalar)."""
    pad = "  " * indent
    if isinstance(value, dict):
        if not value:
            return pad + "{}\n"
        out = ""
        for k, v in value.items():
            key = json.dumps(str(k)) if not re.match(r"^[A-Za-z_][A-Za-z0-9_.\-/]*$", str(k)) else str(k)
            if isinstance(v, (dict, list)) and v:
                out += f"{pad}{key}:\n{to_yaml(v, indent + 1)}"
            else:
                out += f"{pad}{key}: {_scalar(v)}\n"
        return out
    if isinstance(value, list):
        if not value:
            return pad + "[]\n"
        out = ""
        for item in value:
            body = to_yaml(item, indent + 1) if isinstance(item, (dict, list)) and item else f"{pad}  {_scalar(item)}\n"
            out += f"{pad}- {body[len(pad) + 2:]}"
        return out
    return pad + _scalar(value) + "\n"


def _scalar(v: Any) -> str:
    """JSON's spelling is YAML's for these (true, null, numbers, quoted strings, flow collections)."""
    return json.dumps(v if v is None or isinstance(v, (bool, int, float, dict, list)) else str(v))
