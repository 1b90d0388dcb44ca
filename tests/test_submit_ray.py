"""launch/submit.sh's input errors, the plugin module registering the losses where the entry point is not installed,
and the helpers that start a real Ray cluster on 127.0.0.1 (with its dashboard, which serves the job API). Jobs
submitted through the script to such a cluster -- a dry run, and real training on two nodes with a rank killed and
a resume -- are tests/test_two_nodes_ray.py."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

import pytest

from tests.helpers import free_port

ROOT = Path(__file__).resolve().parents[1]
SUBMIT = ROOT / "launch" / "submit.sh"

# A cluster on loopback, every port it binds chosen free (`ray start` would replace 127.0.0.1 by the routable
# address; `ray.init` binds the dashboard agent to Ray's default 52365, taken by any other Ray on the machine, and the
# job API then has no agent). Its arguments: its temp_dir, the GCS's, the dashboard's (the job API) and its agent's
# ports, and a JSON list of each node's `Cluster` arguments, the head's first. Once every node is up it prints their
# ids (a JSON list); closing stdin shuts it down. Its whole process group is killed afterwards in any case.
CLUSTER = """
import json, sys, ray
from ray.cluster_utils import Cluster

temp_dir, (gcs_port, dashboard_port, agent_port), (head, *others) = (
    sys.argv[1], map(int, sys.argv[2:5]), json.loads(sys.argv[5]))
cluster = Cluster(initialize_head=True, head_node_args=dict(
    node_ip_address="127.0.0.1", gcs_server_port=gcs_port, include_dashboard=True, dashboard_host="127.0.0.1",
    dashboard_port=dashboard_port, dashboard_agent_listen_port=agent_port, temp_dir=temp_dir, **head))
nodes = [cluster.head_node, *(cluster.add_node(node_ip_address="127.0.0.1", **node) for node in others)]
cluster.wait_for_nodes()
# where a job's supervisor looks up its cluster (temp_dir/ray_current_cluster; Cluster writes it under RAY_TMPDIR/ray
# instead): without it, with another Ray on the machine, a job's driver may join that one
ray._private.utils.write_ray_address(cluster.head_node.gcs_address, temp_dir)
print(json.dumps([node.node_id for node in nodes]), flush=True)
sys.stdin.read()
cluster.shutdown()
"""


#: How long a cluster (head, dashboard, nodes) may take to start: minutes on a machine running two suites
START_WITHIN_S = 600


def start_cluster(temp_dir: str, nodes: list[dict[str, Any]], stderr: Any) -> tuple[subprocess.Popen, str, list[str]]:
    """:data:`CLUSTER` with ``nodes`` (the head's arguments first), in a session of its own, started until it prints
    its nodes' ids: the process, the address of its job API and the ids. Ray gives each raylet a fixed 30 s to
    register with the GCS, which a machine running two suites exceeded; a start that fails so is ended (its process
    group) and tried again on new ports until :data:`START_WITHIN_S` has passed."""
    deadline = time.monotonic() + START_WITHIN_S
    while True:
        ports = free_port(), free_port(), free_port()
        process = subprocess.Popen(
            [sys.executable, "-c", CLUSTER, temp_dir, *map(str, ports), json.dumps(nodes)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env=loopback_env(temp_dir),
            start_new_session=True,
        )
        ready, _, _ = select.select([process.stdout], [], [], max(deadline - time.monotonic(), 0))
        line = process.stdout.readline() if ready else ""
        if line.startswith("["):
            return process, f"http://127.0.0.1:{ports[1]}", json.loads(line)
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait(timeout=30)
        if not ready or time.monotonic() >= deadline:
            log = Path(stderr.name).read_text()[-3000:] if hasattr(stderr, "name") else ""
            raise AssertionError(f"the Ray cluster did not start within {START_WITHIN_S} s: {line!r} {log}")


def _ray_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    # no token auth (a ~/.ray/auth_token would otherwise switch it on), no usage stats
    env.update(RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0")
    return env


def loopback_env(temp_dir: Optional[str] = None) -> dict[str, str]:
    """Ray's environment for a cluster on one host: Ray turns a "127.0.0.1" bootstrap address into the host's
    routable IP unless its cluster mode is off, which keeps every node, agent and job on loopback. Given the
    cluster's ``temp_dir`` (for the process that starts it): Ray's ``Cluster`` writes its address file into
    ``RAY_TMPDIR/ray`` (by default /tmp/ray, read by any bare ``ray.init`` on the machine), here the cluster's own
    folder, which this creates."""
    # Ray gives its dashboard (the job API) 60 s to start; with two suites on 2 cores it took longer (the two-node
    # cluster failed to start so): start_cluster's own wait bounds the start instead
    env = {**_ray_env(), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    env["RAY_DASHBOARD_STARTUP_TIMEOUT_S"] = str(START_WITHIN_S)
    if temp_dir is not None:
        (Path(temp_dir) / "ray").mkdir(exist_ok=True)
        env["RAY_TMPDIR"] = temp_dir
    return env


def _wait_for_job_agent(address: str, timeout_s: float = 600) -> None:
    """The dashboard answers before its node's job agent registers (on a busy machine, minutes later): probe with a
    no-op job until one is accepted and has run. Connection errors and "No available agent" are retried until
    ``timeout_s``; any other error is raised at once."""
    from ray.job_submission import JobStatus, JobSubmissionClient

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            client = JobSubmissionClient(address)
            job = client.submit_job(entrypoint="true")
            break
        except (RuntimeError, OSError) as error:  # OSError: requests' and the builtin ConnectionError
            waiting = isinstance(error, OSError) or "No available agent" in str(error)
            if not waiting or time.monotonic() > deadline:
                raise
            time.sleep(2)
    while client.get_job_status(job) not in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED):
        assert time.monotonic() < deadline, "the probe job did not finish"
        time.sleep(0.5)


def test_plugin_module_alone_registers_the_losses():
    """What the job's runtime env relies on where the entry point is not installed."""
    code = (
        "import verl; from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY as R; "
        "assert {'kl3', 'clip', 'gppo', 'is_kl3'} <= set(R), sorted(R)"
    )
    env = {**os.environ, "VERL_USE_EXTERNAL_PLUGINS": "none", "VERL_USE_EXTERNAL_MODULES": "verl_ext.plugin"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    env["VERL_USE_EXTERNAL_MODULES"] = ""
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode != 0  # the control: without either mechanism the modes are missing


@pytest.mark.parametrize(
    "args, env, message",
    [
        ([], {"RAY_ADDRESS": "http://127.0.0.1:1"}, "usage: RAY_ADDRESS="),
        (["run_nope.sh"], {"RAY_ADDRESS": "http://127.0.0.1:1"}, "unknown script 'run_nope.sh'"),
        (["common.sh"], {"RAY_ADDRESS": "http://127.0.0.1:1"}, "not a training launch script"),
        (["run_dapo_7b.sh"], {}, "RAY_ADDRESS is not set"),
        (["run_dapo_7b"], {"RAY_ADDRESS": "http://127.0.0.1:1", "SUBMIT_ENV": "A-B"}, "'A-B' is not a variable name"),
    ],
)
def test_submit_input_errors(args, env, message):
    base = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "SUBMIT_ENV")}
    proc = subprocess.run(["bash", str(SUBMIT), *args], capture_output=True, text=True, env={**base, **env}, timeout=60)
    assert proc.returncode == 2 and message in proc.stderr
