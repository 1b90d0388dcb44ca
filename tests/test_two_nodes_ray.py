"""Real training submitted to a two-node Ray cluster, a rank killed mid-run, nothing lost on resume.

The test starts its own cluster on loopback (``ray.cluster_utils.Cluster`` in a child process of its own
session: a head with its dashboard -- the job API -- and a second node, each offering one device slot of
the cpu platform, ``cpu_device``, and the CPUs its bundle and helpers need; every port chosen free) and
submits ``launch/submit.sh run_smoke_cpu.sh`` with ``NNODES=2`` and one rank per node: ERC on ATR's kl3
with the adaptive delta, FSDP2 on gloo across the two raylets, ``hf_cpu`` rollouts, a checkpoint every
step, validation at the end, and the data trace (each step's prompts).

1. **Uninterrupted**: the job SUCCEEDS through Ray's job API; Ray's own state API places the actor's two
   ranks on different nodes; every step's on-policy gauge reads 0 with the seam's path recorded, the loss
   is finite, the adaptive delta follows its rule, validation ran, the checkpoints hold both ranks' shards.
2. **A rank killed**: a second run of the same seed is submitted; once its first checkpoint is complete,
   the rank on the second node is SIGKILLed by the pid Ray reports for it. The job ends FAILED within
   :data:`FAIL_WITHIN_S` with the cause in its logs; the checkpoint directory holds only complete
   checkpoints.
3. **Resumed**: the same submission again continues from the last complete checkpoint (both ranks load its
   model and optimizer shards; the step counter and the adaptive delta continue) and SUCCEEDS.
4. **Nothing lost, nothing repeated**: the prompts of the steps kept from the crashed attempt (up to its
   checkpoint) and of the resumed attempt are, step by step, those of the uninterrupted run.

Afterwards no process started for the cluster survives (each is found by the cluster's session folder
and ended by its pid, also when the test fails).
"""

from __future__ import annotations

import json
import math
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from tests.test_smoke_cpu import assert_on_policy_exact
from tests.test_submit_ray import _free_port, _ray_env, _wait_for_job_agent
from verl_ext.config import DivClipPolicyLossConfig

ROOT = Path(__file__).resolve().parents[1]
SUBMIT = ROOT / "launch" / "submit.sh"

STEPS = 2
FAIL_WITHIN_S = 240
"""How long a job may take to end FAILED after one of its ranks was killed (it must not hang)."""

# Each node: one device slot (its bundle holds 3 CPUs for the colocated workers) and the CPUs the
# helpers there need; Ray's CPU count is logical (2 physical cores serve both nodes).
CLUSTER = """
import json, sys
from ray.cluster_utils import Cluster

gcs_port, dashboard_port, temp_dir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
common = dict(node_ip_address="127.0.0.1", resources={"cpu_device": 1}, object_store_memory=300 * 1024**2)
cluster = Cluster(initialize_head=True, head_node_args=dict(
    num_cpus=10, gcs_server_port=gcs_port, include_dashboard=True, dashboard_host="127.0.0.1", dashboard_port=dashboard_port,
    temp_dir=temp_dir, **common))
second = cluster.add_node(num_cpus=6, **common)
cluster.wait_for_nodes()
print(json.dumps({"head": cluster.head_node.node_id, "second": second.node_id}), flush=True)
sys.stdin.read()
cluster.shutdown()
"""

# A target no update's mean KL3 reaches (KL3 >= 0 stays below target / tolerance): the controller widens
# delta by ``rate`` after every update, whatever the rollouts. (A target below every KL3 would not do: a
# step whose first mini-batch has all-zero advantages does not move the policy, its KL3 is exactly 0, and
# the direction then depends on which samples the machine's kernels drew.)
ADAPTIVE = {"target": 1.0, "tolerance": 1.5, "rate": 1.5, "delta": 0.07}
RUN_ARGS = [
    "trainer.val_before_train=False",
    # 8 prompts x 4 samples = 32 a step, two PPO mini-batches of 16: 8 samples per rank and mini-batch
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16",
    # ERC on ATR's kl3, with the adaptive delta: delta widens on every update (ADAPTIVE), so a resume that
    # lost the controller's state would show in the logged delta
    "actor_rollout_ref.actor.policy_loss.erc_beta_low=0.05",
    "actor_rollout_ref.actor.policy_loss.erc_beta_high=0.05",
    "actor_rollout_ref.actor.calculate_entropy=True",
    f"actor_rollout_ref.actor.policy_loss.adaptive_delta_target={ADAPTIVE['target']}",
    f"actor_rollout_ref.actor.policy_loss.adaptive_delta_tolerance={ADAPTIVE['tolerance']}",
    f"actor_rollout_ref.actor.policy_loss.adaptive_delta_rate={ADAPTIVE['rate']}",
]


def loopback_env() -> dict[str, str]:
    """Ray's environment for a cluster on one host: Ray turns a "127.0.0.1" bootstrap address into the
    host's routable IP unless its cluster mode is off, which keeps every node, agent and job on loopback."""
    return {**_ray_env(), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def _session_processes(marker: str) -> list[int]:
    """Pids of the processes whose command line names the cluster's session folder (raylets, GCS,
    dashboard, workers, job drivers), or whose process group is the cluster's launcher's."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmdline:
            pids.append(int(entry.name))
    return pids


def _end(pids: list[int]) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        time.sleep(2)


@pytest.fixture(scope="module")
def two_nodes() -> Iterator[dict[str, Any]]:
    temp_dir = tempfile.mkdtemp(prefix="r2n", dir="/tmp")  # short: Ray's socket paths are length-limited
    gcs_port, dashboard_port = _free_port(), _free_port()
    launcher_log = Path(temp_dir) / "launcher.err"
    # Ray's Cluster writes its address file into the default Ray folder, /tmp/ray: absent on a fresh machine,
    # and read by any bare ray.init there. RAY_TMPDIR moves that folder into the test's own.
    (Path(temp_dir) / "ray").mkdir()
    with launcher_log.open("w") as launcher_err:
        launcher = subprocess.Popen([sys.executable, "-c", CLUSTER, str(gcs_port), str(dashboard_port), temp_dir],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=launcher_err, text=True,
                                    env={**loopback_env(), "RAY_TMPDIR": temp_dir}, start_new_session=True)
    try:
        ready, _, _ = select.select([launcher.stdout], [], [], 240)
        line = launcher.stdout.readline() if ready else ""
        assert line.startswith("{"), (f"the two-node cluster did not start within 240 s (exit {launcher.poll()}): "
                                      + launcher_log.read_text()[-3000:])
        nodes = json.loads(line)
        address = f"http://127.0.0.1:{dashboard_port}"
        _wait_for_job_agent(address)
        yield {"address": address, "nodes": nodes, "temp_dir": temp_dir}
    finally:
        try:
            launcher.stdin.close()
            launcher.wait(timeout=90)
        except (subprocess.TimeoutExpired, OSError):
            pass
        try:
            os.killpg(launcher.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        _end(_session_processes(temp_dir))  # anything Ray started outside the launcher's group
        survivors = _session_processes(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)
        assert survivors == [], f"processes of the test's cluster outlived it: {survivors}"


def submit(cluster: dict[str, Any], out: Path, submission_id: str, wait: bool) -> subprocess.CompletedProcess:
    env = {**loopback_env(), "RAY_ADDRESS": cluster["address"], "PYTHON": sys.executable, "SMOKE_OUT": str(out),
           "LOSS": "kl3", "STEPS": str(STEPS), "NNODES": "2", "N_DEVICES": "1", "BATCH": "8", "ROLLOUT_N": "4",
           "SAVE_FREQ": "1", "TEST_FREQ": str(STEPS), "SUBMIT_ID": submission_id, "SUBMIT_NO_WAIT": "0" if wait else "1"}
    env["DATA_TRACE"] = str(out / "trace.jsonl")
    return subprocess.run(["bash", str(SUBMIT), "run_smoke_cpu.sh", *RUN_ARGS], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1200)


def job_status(cluster: dict[str, Any], submission_id: str) -> Any:
    from ray.job_submission import JobSubmissionClient

    return JobSubmissionClient(cluster["address"]).get_job_status(submission_id)


def wait_for_status(cluster: dict[str, Any], submission_id: str, timeout_s: float) -> tuple[Any, float]:
    from ray.job_submission import JobStatus

    start = time.monotonic()
    while True:
        status = job_status(cluster, submission_id)
        if status in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED):
            return status, time.monotonic() - start
        assert time.monotonic() - start < timeout_s, f"{submission_id} still {status} after {timeout_s} s"
        time.sleep(1)


def actor_ranks(cluster: dict[str, Any]) -> list[Any]:
    """verl's actor worker group (``WorkerDict`` actors) as Ray's state API reports them: pid and node."""
    from ray.util.state import list_actors

    return [a for a in list_actors(address=cluster["address"], filters=[("state", "=", "ALIVE")], limit=1000)
            if a.class_name.endswith("WorkerDict")]


def expected_delta(step: int) -> float:
    """The delta step ``step`` trains with: the initial one widened once per earlier update (ADAPTIVE)."""
    return min(ADAPTIVE["delta"] * ADAPTIVE["rate"] ** (step - 1), DivClipPolicyLossConfig.adaptive_delta_max)


def step_metrics(out: Path) -> dict[int, dict[str, Any]]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {r["step"]: r["data"] for r in rows if "actor/pg_loss" in r["data"]}


def complete(step_folder: Path) -> bool:
    """Both ranks' model, optimizer and extra-state shards, the dataloader's state, the controller's state."""
    actor = step_folder / "actor"
    shards = [f"{kind}_world_size_2_rank_{rank}.pt" for kind in ("model", "optim", "extra_state") for rank in (0, 1)]
    return all((actor / name).is_file() for name in shards) and (step_folder / "data.pt").is_file() \
        and (step_folder / "divclip_adaptive_delta.json").is_file()


def assert_only_complete_checkpoints(ckpt: Path) -> int:
    latest = int((ckpt / "latest_checkpointed_iteration.txt").read_text())
    folders = {int(p.name.split("_")[-1]): p for p in ckpt.glob("global_step_*")}
    assert latest in folders and all(complete(p) for p in folders.values()), sorted(folders)
    assert max(folders) == latest, (sorted(folders), latest)  # nothing newer than the last complete one
    return latest


@pytest.fixture(scope="module")
def runs(two_nodes: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from ray.job_submission import JobStatus, JobSubmissionClient

    client = JobSubmissionClient(two_nodes["address"])
    started = time.monotonic()
    result: dict[str, Any] = {}

    # 1. uninterrupted, and where Ray put the ranks while it ran
    straight = tmp_path_factory.mktemp("uninterrupted")
    placements: list[Any] = []
    proc = submit(two_nodes, straight, "divclip-two-nodes-straight", wait=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    while not (straight / "ckpt" / "latest_checkpointed_iteration.txt").exists():
        assert job_status(two_nodes, "divclip-two-nodes-straight") not in (JobStatus.FAILED, JobStatus.STOPPED), \
            client.get_job_logs("divclip-two-nodes-straight")[-4000:]
        placements = actor_ranks(two_nodes) or placements
        time.sleep(1)
    placements = actor_ranks(two_nodes) or placements
    result["straight"] = {"out": straight, "placements": placements,
                          "status": wait_for_status(two_nodes, "divclip-two-nodes-straight", 900)[0],
                          "logs": client.get_job_logs("divclip-two-nodes-straight")}

    # 2. the same run, a rank killed after its first complete checkpoint
    crashed = tmp_path_factory.mktemp("crashed")
    proc = submit(two_nodes, crashed, "divclip-two-nodes-crash", wait=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    tracker = crashed / "ckpt" / "latest_checkpointed_iteration.txt"
    deadline = time.monotonic() + 900
    while not (tracker.exists() and tracker.read_text().strip()):
        assert time.monotonic() < deadline and job_status(two_nodes, "divclip-two-nodes-crash") in (
            JobStatus.PENDING, JobStatus.RUNNING), client.get_job_logs("divclip-two-nodes-crash")[-4000:]
        time.sleep(0.5)
    victim = next(a for a in actor_ranks(two_nodes) if a.node_id == two_nodes["nodes"]["second"])
    os.kill(victim.pid, signal.SIGKILL)
    status, seconds = wait_for_status(two_nodes, "divclip-two-nodes-crash", FAIL_WITHIN_S)
    result["crashed"] = {"out": crashed, "status": status, "seconds_to_fail": seconds, "victim": victim,
                         "logs": client.get_job_logs("divclip-two-nodes-crash")}

    # 3. resumed: the same submission again
    proc = submit(two_nodes, crashed, "divclip-two-nodes-resume", wait=True)
    result["resumed"] = {"status": wait_for_status(two_nodes, "divclip-two-nodes-resume", 900)[0],
                         "logs": client.get_job_logs("divclip-two-nodes-resume"), "submit": proc}
    result["seconds"] = time.monotonic() - started
    return result


def test_training_is_submitted_to_two_nodes_and_succeeds(runs: dict[str, Any], two_nodes: dict[str, Any]) -> None:
    from ray.job_submission import JobStatus

    straight = runs["straight"]
    assert straight["status"] == JobStatus.SUCCEEDED, straight["logs"][-4000:]
    assert sorted(a.node_id for a in straight["placements"]) == sorted(two_nodes["nodes"].values())  # one rank per node
    metrics = step_metrics(straight["out"])
    assert sorted(metrics) == list(range(1, STEPS + 1))
    for step, data in sorted(metrics.items()):
        assert_on_policy_exact(data, erc=True)
        assert math.isfinite(data["actor/pg_loss"]) and "actor/divclip/erc/ratio_mean" in data
        assert data["actor/divclip/delta"] == pytest.approx(expected_delta(step), rel=1e-12), step
        assert 0 <= data["actor/divclip/kl3_mean"] < ADAPTIVE["target"] / ADAPTIVE["tolerance"], step  # the premise
    assert any(k.startswith("val-core/") for k in metrics[STEPS])  # validated at the last step
    assert assert_only_complete_checkpoints(straight["out"] / "ckpt") == STEPS
    for step in range(1, STEPS + 1):  # the controller's state saved with each checkpoint is the delta it set next
        state = json.loads((straight["out"] / "ckpt" / f"global_step_{step}" / "divclip_adaptive_delta.json").read_text())
        assert state["delta"] == pytest.approx(metrics[step]["actor/divclip/delta_next"], rel=1e-12)
        assert state["metric"] == "actor/divclip/kl3_mean"


def test_a_killed_rank_fails_the_job_in_bounded_time_leaving_complete_checkpoints(runs: dict[str, Any]) -> None:
    from ray.job_submission import JobStatus

    crashed = runs["crashed"]
    assert crashed["status"] == JobStatus.FAILED and crashed["seconds_to_fail"] < FAIL_WITHIN_S
    logs = crashed["logs"]
    assert any(cause in logs for cause in ("ActorDiedError", "actor died", "SIGKILL", "Connection reset")), logs[-4000:]
    assert str(crashed["victim"].pid) in logs or "WorkerDict" in logs


def test_resume_continues_from_the_last_complete_checkpoint_and_repeats_no_prompt(runs: dict[str, Any]) -> None:
    from recipe.data_trace import read_trace
    from ray.job_submission import JobStatus

    resumed, crashed_out, straight_out = runs["resumed"], runs["crashed"]["out"], runs["straight"]["out"]
    assert resumed["status"] == JobStatus.SUCCEEDED, resumed["logs"][-4000:]
    assert assert_only_complete_checkpoints(crashed_out / "ckpt") == STEPS
    trace = read_trace(str(crashed_out / "trace.jsonl"))
    attempts = list(dict.fromkeys(line["attempt"] for line in trace))
    assert len(attempts) == 2, attempts
    first = [line for line in trace if line["attempt"] == attempts[0]]
    second = [line for line in trace if line["attempt"] == attempts[1]]
    resumed_from = second[0]["step"] - 1  # the step counter continues after the checkpoint it loaded
    assert resumed_from >= 1 and [line["step"] for line in second] == list(range(resumed_from + 1, STEPS + 1))
    # both ranks loaded that checkpoint's model and optimizer shards (one rank on each node)
    for rank in (0, 1):
        assert f"global_step_{resumed_from}/actor/optim_world_size_2_rank_{rank}.pt" in resumed["logs"], rank
    # the prompts kept (the crashed attempt up to the checkpoint, then the resumed one) are, step by step,
    # the uninterrupted run's: none skipped, none seen twice
    kept = {line["step"]: line["prompts"] for line in first if line["step"] <= resumed_from}
    kept.update({line["step"]: line["prompts"] for line in second})
    reference = {line["step"]: line["prompts"] for line in read_trace(str(straight_out / "trace.jsonl"))}
    assert sorted(kept) == sorted(reference) == list(range(1, STEPS + 1))
    assert kept == reference
    # the adaptive delta continued from the checkpoint's controller state, not from its initial value
    metrics = step_metrics(crashed_out)
    assert metrics[resumed_from + 1]["actor/divclip/delta"] == pytest.approx(expected_delta(resumed_from + 1), rel=1e-12)
    assert expected_delta(resumed_from + 1) != ADAPTIVE["delta"]
    for data in metrics.values():
        assert_on_policy_exact(data, erc=True)
    print(f"two-node test: {runs['seconds']:.0f} s for the three jobs; failed {runs['crashed']['seconds_to_fail']:.0f} s after the kill")
