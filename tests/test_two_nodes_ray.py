"""Real training submitted to a two-node Ray cluster, a rank killed mid-run, nothing lost on resume; and a dry run
submitted to the same cluster (:func:`test_submit_runs_a_dry_run_job`: its output and runtime env).

The test starts its own cluster on loopback (``ray.cluster_utils.Cluster`` in a child process of its own
session: a head with its dashboard -- the job API -- and a second node, each offering one device slot of
the cpu platform, ``cpu_device``, and the CPUs its bundle and helpers need; every port chosen free) and
submits ``launch/submit.sh run_smoke_cpu.sh`` with ``NNODES=2`` and one rank per node: ERC on ATR's kl3
with the adaptive delta, FSDP2 on gloo across the two raylets, ``hf_cpu`` rollouts, a checkpoint every
step, validation at the end, and the data trace (each step's prompts).

1. **A rank killed**: the job is submitted; Ray's own state API places the actor's two ranks on different
   nodes; once its first checkpoint is complete, the rank on the second node is SIGKILLed by the pid Ray
   reports for it. The job ends FAILED within :data:`FAIL_WITHIN_S`, and its logs report the death of that very
   actor (its actor id and pid, as Ray's state API gave them); the checkpoint directory holds only complete
   checkpoints.
2. **Resumed**: the same submission again continues from the last complete checkpoint and SUCCEEDS. Both
   ranks' optimizer state continues the saved one by value: the resumed run's next checkpoint (its AdamW
   moments, step counters and parameters) is, element by element and to float32 rounding, what two AdamW
   updates from the saved moments and parameters produce (:func:`adam_misfits`); a fresh optimizer, or
   other moments of the same run, do not fit (the run's reward scores a response without an answer below a wrong
   one, so its updates carry a gradient: zero moments would fit any prior state). The step counter and the
   adaptive delta continue.
3. **Every step, whichever attempt ran it**: the on-policy gauge reads 0 with the seam's path recorded, the
   loss is finite, the adaptive delta follows its rule, validation ran at the last step, the checkpoints hold
   both ranks' shards and the controller's state.
4. **Nothing lost, nothing repeated**: the prompts of the steps kept from the crashed attempt (up to its
   checkpoint) and of the resumed attempt are, step by step, the next ones of verl's sampler order (its own
   ``create_rl_sampler`` over the run's train file).

Processes (:class:`ClusterProcesses`): a background sampler finds the cluster's processes by what they
are -- the launcher's process tree and sessions (GCS, raylets, dashboard, agents, Ray workers, each job's
supervisor, driver and workers) and anything whose command line, working directory or open files lie in
the test's Ray folder -- each named by pid and start time, so a reused pid is never taken for a survivor.
No process of a job outlives that job's end by more than :data:`JOB_EXIT_GRACE_S` (idle pool workers
Ray keeps for later jobs excepted); and no process found before the cluster's own shutdown
(``cluster.shutdown()``, run by closing the launcher's stdin) survives it by more than
:data:`CLUSTER_EXIT_GRACE_S`. Survivors are killed by pid only after that verdict, and every process
the test starts is ended by its own id also when the test fails.
"""

from __future__ import annotations

import base64
import json
import logging
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import pytest

from tests.test_smoke_cpu import SMOKE_TIMEOUT_S, assert_on_policy_exact, proc_stat
from tests.test_submit_ray import SUBMIT, _ray_env, _wait_for_job_agent, loopback_env, start_cluster
from tests.test_trainer_modes_cpu import epoch_order
from verl_ext.config import DivClipPolicyLossConfig

ROOT = Path(__file__).resolve().parents[1]

STEPS = 2
FAIL_WITHIN_S = 240
"""How long a job may take to end FAILED after one of its ranks was killed (it must not hang)."""
JOB_EXIT_GRACE_S = 30
"""How long a job's driver and workers may outlive the job's terminal status."""
CLUSTER_EXIT_GRACE_S = 30
"""How long the cluster's processes may outlive the launcher's return from ``cluster.shutdown()``."""
BATCH = 8
"""Prompts per training step (4 samples each)."""
UPDATES_PER_STEP = 2
"""Optimizer steps per training step: two PPO mini-batches (BATCH / 2 prompts each), one epoch."""

# Each node (test_submit_ray's CLUSTER): one device slot (its bundle holds 3 CPUs for the colocated workers) and the
# CPUs the helpers there need; Ray's CPU count is logical (2 physical cores serve both nodes).
_NODE = {"resources": {"cpu_device": 1}, "object_store_memory": 300 * 1024**2}
NODES = [{**_NODE, "num_cpus": 10}, {**_NODE, "num_cpus": 6}]

# A target no update's mean KL3 reaches (KL3 >= 0 stays below target / tolerance): the controller widens
# delta by ``rate`` after every update, whatever the rollouts. (A target below every KL3 would not do: a
# step whose first mini-batch has all-zero advantages does not move the policy, its KL3 is exactly 0, and
# the direction then depends on which samples the machine's kernels drew.)
ADAPTIVE = {"target": 1.0, "tolerance": 1.5, "rate": 1.5, "delta": 0.07}
UNPARSEABLE_SCORE = -0.2
"""What a response without an answer scores in this run (wrong ones score 0): see ``RUN_ARGS``."""
RUN_ARGS = [
    "trainer.val_before_train=False",
    # 8 prompts x 4 samples = 32 a step, two PPO mini-batches of 16: 8 samples per rank and mini-batch
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
    # ERC on ATR's kl3, with the adaptive delta: delta widens on every update (ADAPTIVE), so a resume that
    # lost the controller's state would show in the logged delta
    "actor_rollout_ref.actor.policy_loss.erc_beta_low=0.05",
    "actor_rollout_ref.actor.policy_loss.erc_beta_high=0.05",
    "actor_rollout_ref.actor.calculate_entropy=True",
    f"actor_rollout_ref.actor.policy_loss.adaptive_delta_target={ADAPTIVE['target']}",
    f"actor_rollout_ref.actor.policy_loss.adaptive_delta_tolerance={ADAPTIVE['tolerance']}",
    f"actor_rollout_ref.actor.policy_loss.adaptive_delta_rate={ADAPTIVE['rate']}",
    # A response without an answer scores below a wrong one, so a group of 4 ties less often: on the generated model
    # (7 % correct, 66 % wrong, 26 % unparseable; 64 samples of each of the 512 prompts) from 74 % to 21 % of groups,
    # and a step whose 8 groups all tie (no gradient: were it step 1 and 2, zero moments that every prior state fits,
    # the twentieth session's red run) from 8.8 % to 4e-6.
    f"+reward.custom_reward_function.reward_kwargs.unparseable_score={UNPARSEABLE_SCORE}",
]


# -- the cluster's processes ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ProcKey:
    """One process: its pid and its start time (clock ticks after boot), so a reused pid is another key."""

    pid: int
    start: int


@dataclass
class ProcRecord:
    """What the sampler saw of one process: each command line (Ray workers retitle themselves, e.g.
    ``ray::IDLE`` -> ``ray::WorkerDict``) with the time it was first seen."""

    titles: dict[str, float] = field(default_factory=dict)


def _refers_to(pid: int, folder: str) -> bool:
    """Whether the process's working directory or one of its open files lies in ``folder``."""
    base = Path(f"/proc/{pid}")
    try:
        if os.readlink(base / "cwd").startswith(folder):
            return True
        for fd in os.scandir(base / "fd"):
            try:
                if os.readlink(fd.path).startswith(folder):
                    return True
            except OSError:
                continue
    except OSError:
        return False
    return False


def _is_pool_title(title: str) -> bool:
    """An idle Ray worker, or one still starting: Ray's worker pool, bound to no job."""
    return title == "ray::IDLE" or "default_worker.py" in title


class ClusterProcesses:
    """The test cluster's processes, found by what they are rather than by a marker the test put there.

    Seeds: every process whose command line, working directory or open files lie in the test's own Ray folder:
    each launcher (whose ``Cluster`` starts the GCS, raylets, dashboard and monitors; the folder is its first
    argument, so the launchers of failed starts are found too) and Ray's (its session folder with its logs,
    sockets and runtime envs is inside it). Closure: the children of a member
    (a raylet's workers, a job supervisor's entrypoint shell and driver) and the processes of a member's
    session (Ray's job entrypoints run in sessions of their own; a child re-parented to init keeps its
    session). The test process, its ancestors and its own session are never members. A background thread
    samples every :attr:`interval_s` so that each job's processes are seen while the job runs.
    """

    def __init__(self, temp_dir: str, interval_s: float = 1.0) -> None:
        self.temp_dir = temp_dir
        self.interval_s = interval_s
        self.records: dict[ProcKey, ProcRecord] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._own_sid = os.getsid(0)
        self._excluded = {os.getpid()}
        pid = os.getppid()
        while pid > 1:  # the test's ancestors (pytest, its xdist parent, the shell)
            self._excluded.add(pid)
            stat = proc_stat(pid)
            pid = stat[0] if stat else 0

    def scan(self) -> dict[ProcKey, str]:
        """The cluster's live processes now, with their command lines (zombies count as ended)."""
        table: dict[int, tuple[int, int, int, str]] = {}
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit() or int(entry.name) in self._excluded:
                continue
            pid = int(entry.name)
            stat = proc_stat(pid)
            if stat is None or stat[3] == "Z":
                continue
            try:
                cmdline = (
                    (Path(entry.path) / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
                )
            except OSError:
                continue
            table[pid] = (stat[0], stat[1], stat[2], cmdline)
        members = {
            pid
            for pid, (_, _, _, cmdline) in table.items()
            if self.temp_dir in cmdline or _refers_to(pid, self.temp_dir)
        }
        while True:
            sessions = {table[pid][1] for pid in members} - {self._own_sid, 0, 1}
            more = {
                pid
                for pid, (ppid, sid, _, _) in table.items()
                if pid not in members and (ppid in members or sid in sessions)
            }
            if not more:
                break
            members |= more
        return {ProcKey(pid, table[pid][2]): table[pid][3] for pid in members}

    def sample(self) -> dict[ProcKey, str]:
        """Scan and record each process's command lines with the time each was first seen."""
        now = time.time()
        found = self.scan()
        with self._lock:
            for key, title in found.items():
                self.records.setdefault(key, ProcRecord()).titles.setdefault(title, now)
        return found

    def start(self) -> None:
        def loop() -> None:
            while not self._stop.wait(self.interval_s):
                self.sample()

        self._thread = threading.Thread(target=loop, name="cluster-processes", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    @staticmethod
    def alive(key: ProcKey) -> bool:
        stat = proc_stat(key.pid)
        return stat is not None and stat[2] == key.start and stat[3] != "Z"

    def describe(self, key: ProcKey) -> str:
        with self._lock:
            titles = list(self.records.get(key, ProcRecord()).titles)
        return f"pid {key.pid}: {' -> '.join(t[:100] for t in titles)}"

    def took_a_role_between(self, since: float, until: float) -> list[ProcKey]:
        """The processes that took a role other than an idle pool worker's in [since, until]: started
        then, or an idle pool worker given a job's task or actor then (a driver, its workers, the job's
        supervisor). Processes that were only ever idle pool workers belong to no job."""
        with self._lock:
            return [
                key
                for key, record in self.records.items()
                if any(since <= seen <= until and not _is_pool_title(title) for title, seen in record.titles.items())
            ]

    def wait_gone(self, keys: list[ProcKey], grace_s: float) -> tuple[list[ProcKey], float]:
        """Wait up to ``grace_s`` for every process in ``keys`` to end: (those still alive, seconds waited)."""
        start = time.monotonic()
        while any(self.alive(k) for k in keys) and time.monotonic() - start < grace_s:
            time.sleep(0.5)
        return [k for k in keys if self.alive(k)], time.monotonic() - start


def _end(pids: list[int]) -> None:
    """SIGTERM, then SIGKILL, each process by its pid."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        if pids:
            time.sleep(2)


def job_leftovers(watch: ClusterProcesses, submitted_at: float) -> dict[str, Any]:
    """After a job's terminal status: the processes that worked for it (its supervisor, entrypoint shell,
    driver and Ray workers: every process that took a role since its submission) and those of them still
    alive :data:`JOB_EXIT_GRACE_S` later."""
    watch.sample()
    mine = watch.took_a_role_between(submitted_at, time.time())
    left, waited = watch.wait_gone(mine, JOB_EXIT_GRACE_S)
    return {"processes": len(mine), "left": [watch.describe(k) for k in left], "seconds": waited}


@pytest.fixture(scope="module")
def two_nodes() -> Iterator[dict[str, Any]]:
    temp_dir = tempfile.mkdtemp(prefix="r2n", dir="/tmp")  # short: Ray's socket paths are length-limited
    launcher_log = Path(temp_dir) / "launcher.err"
    # watched from before the first start: the processes of a start that failed (start_cluster ends its process
    # group and tries again) are the cluster's too, and the shutdown check below covers them
    watch = ClusterProcesses(temp_dir)
    watch.start()
    try:
        with launcher_log.open("w") as launcher_err:
            launcher, address, ids = start_cluster(temp_dir, NODES, launcher_err)
    except BaseException:
        watch.stop()
        _end([k.pid for k in watch.scan()])
        raise
    verdict: list[str] = []
    try:
        nodes = dict(zip(("head", "second"), ids, strict=True))
        _wait_for_job_agent(address)
        yield {"address": address, "nodes": nodes, "temp_dir": temp_dir, "processes": watch}
    finally:
        # 1. Before any cleanup: every cluster process alive now, whether seen now or earlier.
        watch.stop()
        watch.sample()
        found = {k for k in watch.records if watch.alive(k)}
        # 2. The cluster's own shutdown: the launcher reads stdin to its end, then calls cluster.shutdown().
        try:
            launcher.stdin.close()
            launcher.wait(timeout=90)
        except (subprocess.TimeoutExpired, OSError):
            pass
        survivors, waited = watch.wait_gone(sorted(found, key=lambda k: k.pid), CLUSTER_EXIT_GRACE_S)
        if launcher.poll() is None:
            verdict.append(f"the launcher (pid {launcher.pid}) did not return from cluster.shutdown() within 90 s")
        if survivors:
            verdict.append(
                f"{len(survivors)} of the cluster's {len(found)} processes outlived its shutdown by "
                f"{waited:.0f} s: " + "; ".join(watch.describe(k) for k in survivors)
            )
        print(
            f"two-node test: {len(found)} cluster processes before shutdown, all gone {waited:.1f} s after it"
            if not survivors
            else verdict[-1]
        )
        # 3. Only now, cleanup: the survivors by pid, the launcher's process group (its id is the launcher's
        #    pid), then anything still found.
        _end([k.pid for k in survivors if watch.alive(k)])
        try:
            os.killpg(launcher.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if launcher.poll() is None:
            launcher.wait(timeout=30)
        _end([k.pid for k in watch.scan()])
        shutil.rmtree(temp_dir, ignore_errors=True)
    assert not verdict, "\n".join(verdict)


def submit(cluster: dict[str, Any], out: Path, submission_id: str, wait: bool) -> subprocess.CompletedProcess:
    """``launch/submit.sh run_smoke_cpu.sh`` in a session of its own, ended by its process group's id (the
    script's pid) if it outlives its timeout or the test fails meanwhile."""
    env = {
        **loopback_env(),
        "RAY_ADDRESS": cluster["address"],
        "PYTHON": sys.executable,
        "SMOKE_OUT": str(out),
        "LOSS": "kl3",
        "STEPS": str(STEPS),
        "NNODES": "2",
        "N_DEVICES": "1",
        "BATCH": str(BATCH),
        "ROLLOUT_N": "4",
        "SAVE_FREQ": "1",
        "TEST_FREQ": str(STEPS),
        "SUBMIT_ID": submission_id,
        "SUBMIT_NO_WAIT": "0" if wait else "1",
    }
    env["DATA_TRACE"] = str(out / "trace.jsonl")
    args = ["bash", str(SUBMIT), "run_smoke_cpu.sh", *RUN_ARGS]
    proc = subprocess.Popen(
        args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=SMOKE_TIMEOUT_S * 4 // 3)  # two nodes: 1200 s where one took 900
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the ray CLI it started, should bash have left it behind
        except ProcessLookupError:
            pass
        if proc.poll() is None:
            proc.wait(timeout=30)
    return subprocess.CompletedProcess(args, proc.returncode, stdout, stderr)


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

    return [
        a
        for a in list_actors(address=cluster["address"], filters=[("state", "=", "ALIVE")], limit=1000)
        if a.class_name.endswith("WorkerDict")
    ]


_SEP = r"(?:\s|\\[nt])+"  # a line break and tab, or their escapes where the error is shown by repr
DEATH_REPORT = re.compile(
    r"The actor died unexpectedly before finishing this task\."
    + _SEP
    + r"class_name: (?P<class_name>[^\s\\]+)"
    + _SEP
    + r"actor_id: (?P<actor_id>[0-9a-f]+)(?:"
    + _SEP
    + r"pid: (?P<pid>\d+))?"
)


def death_reports(logs: str) -> list[dict[str, str]]:
    """Ray's reports of an actor's death in a job's logs (``ActorDiedError``: the dead actor's class name,
    actor id and pid), each as its fields."""
    return [m.groupdict() for m in DEATH_REPORT.finditer(logs)]


def expected_delta(step: int) -> float:
    """The delta step ``step`` trains with: the initial one widened once per earlier update (ADAPTIVE)."""
    return min(ADAPTIVE["delta"] * ADAPTIVE["rate"] ** (step - 1), DivClipPolicyLossConfig.adaptive_delta_max)


def logged_steps(out: Path) -> set[int]:
    """The training steps the run's attempts have logged so far (verl's file logger, one file per attempt, read as
    the smoke's report reads them); none before the first log line is whole."""
    from recipe.smoke.report import merge_attempts

    try:
        return {step for step, data in merge_attempts(out).items() if "actor/pg_loss" in data}
    except (FileNotFoundError, ValueError):  # no log yet, or a line being written
        return set()


def step_metrics(out: Path) -> dict[int, dict[str, Any]]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {r["step"]: r["data"] for r in rows if "actor/pg_loss" in r["data"]}


def complete(step_folder: Path) -> bool:
    """Both ranks' model, optimizer and extra-state shards, the dataloader's state, the controller's state."""
    actor = step_folder / "actor"
    shards = [f"{kind}_world_size_2_rank_{rank}.pt" for kind in ("model", "optim", "extra_state") for rank in (0, 1)]
    return (
        all((actor / name).is_file() for name in shards)
        and (step_folder / "data.pt").is_file()
        and (step_folder / "divclip_adaptive_delta.json").is_file()
    )


def assert_only_complete_checkpoints(ckpt: Path) -> int:
    latest = int((ckpt / "latest_checkpointed_iteration.txt").read_text())
    folders = {int(p.name.split("_")[-1]): p for p in ckpt.glob("global_step_*")}
    assert latest in folders and all(complete(p) for p in folders.values()), sorted(folders)
    assert max(folders) == latest, (sorted(folders), latest)  # nothing newer than the last complete one
    return latest


# -- optimizer continuity by value ---------------------------------------------------------------------------

F32_EPS = 2.0**-23
ROUNDING_UNITS = 8.0
"""Float32 ulps allowed per quantity in :func:`adam_misfits` (each of m, v and a parameter goes through a
few rounded operations per update). Measured on four resumed and uninterrupted step-1 -> step-2 transitions
(313,344 elements): 1 ulp leaves 6 misfits, 1.5 none; a fresh or a foreign prior state misfits 99 % of
the elements from 1.5 to 16 ulps alike."""


def load_shards(step_folder: Path, rank: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """One rank's (optimizer, model) shards of a checkpoint, as verl's FSDP checkpoint manager saved them."""
    import torch

    actor = step_folder / "actor"
    # Unpickling a DTensor outside a process group warns once per tensor; only local values are read here.
    mesh_log = logging.getLogger("torch.distributed.device_mesh")
    level = mesh_log.level
    mesh_log.setLevel(logging.ERROR)
    try:
        return (
            torch.load(actor / f"optim_world_size_2_rank_{rank}.pt", weights_only=False, map_location="cpu"),
            torch.load(actor / f"model_world_size_2_rank_{rank}.pt", weights_only=False, map_location="cpu"),
        )
    finally:
        mesh_log.setLevel(level)


def with_moments_of(
    state: tuple[dict[str, Any], dict[str, Any]], donor: tuple[dict[str, Any], dict[str, Any]]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``state`` (a rank's optimizer and model shards) with the AdamW moments of ``donor`` in place of its own:
    the step counters and parameters stay ``state``'s."""
    optim, model = state
    donated = donor[0]["state"]
    moments = {
        index: {**saved, "exp_avg": donated[index]["exp_avg"], "exp_avg_sq": donated[index]["exp_avg_sq"]}
        for index, saved in optim["state"].items()
    }
    return {**optim, "state": moments}, model


def _f64(value: Any) -> Any:
    """A shard's local values (FSDP2 saves DTensors) in float64."""
    return (value.to_local() if hasattr(value, "to_local") else value).double()


def adam_misfits(
    before: tuple[dict[str, Any], dict[str, Any]], after: tuple[dict[str, Any], dict[str, Any]], prior: str = "saved"
) -> tuple[int, int]:
    """How many parameter elements of ``after`` (a rank's optimizer and model shards one training step
    later, i.e. two AdamW updates) do not follow from ``before`` -- (misfits, elements).

    ``prior="saved"`` starts the two updates from ``before``'s moments m1, v1 and step counter t;
    ``prior="fresh"`` from a new optimizer (zeros, t = 0), what a resume that did not restore the
    optimizer would train from. The unknown gradients g3, g4 of the two updates are eliminated: by AdamW,
        m4 = b1^2 m1 + (1 - b1)(b1 g3 + g4),   v4 = b2^2 v1 + (1 - b2)(b2 g3^2 + g4^2),
    so g3 is a root of a quadratic fixed by (m1, v1, m4, v4); the last update's direction
    d4 = m4^/(sqrt(v4^) + eps) is known from the saved m4, v4, which gives the parameter p3 between the
    updates from the saved p4, and with the saved p1 the first update's direction d3. That d3 must be the
    one AdamW computes from (m1, v1, g3): one more equation than unknowns, for every element. Inputs
    carry float32 rounding (:data:`ROUNDING_UNITS` ulps of the quantities involved): g3 is bracketed over
    the corners of that box and d3 evaluated over the bracket, and the observed d3 must fall in that range
    widened by the parameters' rounding over lr.
    """
    import torch

    (optim1, model1), (optim4, model4) = before, after
    group = optim1["param_groups"][0]
    lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
    names = list(model1)
    assert len(names) == len(optim1["state"]) == len(optim4["state"]), (len(names), len(optim1["state"]))
    k = ROUNDING_UNITS * F32_EPS

    def direction(m: Any, v: Any, step: int) -> Any:  # AdamW's bias-corrected m^ / (sqrt(v^) + eps)
        return (m / (1 - b1**step)) / (v.sqrt() / math.sqrt(1 - b2**step) + eps)

    misfits = elements = 0
    for index, name in enumerate(names):
        p1, p4 = _f64(model1[name]), _f64(model4[name])
        saved, later = optim1["state"][index], optim4["state"][index]
        m4, v4 = _f64(later["exp_avg"]), _f64(later["exp_avg_sq"])
        assert p1.shape == m4.shape == p4.shape, (name, p1.shape, m4.shape)
        if prior == "fresh":
            t, m1, v1 = 0, torch.zeros_like(p1), torch.zeros_like(p1)
        else:
            t, m1, v1 = int(saved["step"]), _f64(saved["exp_avg"]), _f64(saved["exp_avg_sq"])
        d4 = direction(m4, v4, t + 2)
        p3 = (p4 + lr * d4) / (1 - lr * wd)
        d3_seen = (p1 * (1 - lr * wd) - p3) / lr
        slack = k * ((p1.abs() + p4.abs()) / lr + d4.abs() + d3_seen.abs())
        a0, b0 = (m4 - b1**2 * m1) / (1 - b1), (v4 - b2**2 * v1) / (1 - b2)  # b1 g3 + g4, b2 g3^2 + g4^2
        da, db = k * (m4.abs() + m1.abs()) / (1 - b1), k * (v4 + v1) / (1 - b2)
        fits = torch.zeros_like(p1, dtype=torch.bool)
        for branch in (1.0, -1.0):
            roots = []
            for a in (a0 - da, a0 + da):
                for b in (b0 - db, b0 + db):
                    disc = ((b2 + b1**2) * b - b2 * a**2).clamp(min=0)
                    roots.append((a * b1 + branch * disc.sqrt()) / (b2 + b1**2))
            low, high = torch.stack(roots).min(0).values, torch.stack(roots).max(0).values
            grid = torch.linspace(0, 1, 17, dtype=torch.float64).view(-1, *[1] * p1.dim())
            g3 = low + grid * (high - low)
            d3 = direction(b1 * m1 + (1 - b1) * g3, b2 * v1 + (1 - b2) * g3**2, t + 1)
            fits |= (d3_seen >= d3.min(0).values - slack) & (d3_seen <= d3.max(0).values + slack)
        misfits += int((~fits).sum())
        elements += fits.numel()
    return misfits, elements


def test_submit_runs_a_dry_run_job(two_nodes: dict[str, Any]) -> None:
    """A dry run submitted through the script: its output is the resolved config, its runtime env carries the
    checkout, the plugin module and the launcher's variables encoded."""
    from ray.job_submission import JobStatus, JobSubmissionClient

    ray_head = two_nodes["address"]

    submission_id = f"divclip-test-{os.getpid()}"
    env = {
        **_ray_env(),
        "RAY_ADDRESS": ray_head,
        "PYTHON": sys.executable,
        "SUBMIT_ID": submission_id,
        "EXPERIMENT_NAME": "erc dapo $HOME",
        "NNODES": "2",
    }
    proc = subprocess.run(
        [
            "bash",
            str(SUBMIT),
            "run_erc_dapo_7b.sh",
            "--dry-run",
            "trainer.project_name='p q'",
            "actor_rollout_ref.actor.optim.lr=3e-6",
        ],
        cwd="/",
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    out = proc.stdout
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # the job's output is the dry run's YAML: the script's config, the env and the overrides
    assert "experiment_name: erc dapo $HOME" in out  # travelled unexpanded
    assert "project_name: p q" in out and "lr: 3.0e-06" in out and "nnodes: 2" in out
    assert "erc_beta_low: 0.05" in out and "_target_: verl_ext.config.DivClipPolicyLossConfig" in out

    client = JobSubmissionClient(ray_head)
    info = client.get_job_info(submission_id)
    assert info.status == JobStatus.SUCCEEDED
    assert info.entrypoint == "bash launch/submit.sh --job-entry run_erc_dapo_7b.sh"
    runtime_env = info.runtime_env
    assert runtime_env["working_dir"].startswith("gcs://")  # this checkout, uploaded to the cluster
    assert ".venv" in runtime_env["excludes"] and ".git" in runtime_env["excludes"]
    assert runtime_env["env_vars"]["VERL_USE_EXTERNAL_MODULES"] == "verl_ext.plugin"
    # launcher variables and arguments travel encoded (Ray would expand $VAR in env_vars)
    job_script = base64.b64decode(runtime_env["env_vars"]["DIVCLIP_JOB_B64"]).decode()
    assert "export NNODES=2" in job_script and "HOME" in job_script


@pytest.fixture(scope="module")
def runs(two_nodes: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from ray.job_submission import JobStatus, JobSubmissionClient

    client = JobSubmissionClient(two_nodes["address"])
    watch: ClusterProcesses = two_nodes["processes"]
    started = time.monotonic()
    result: dict[str, Any] = {}

    # 1. the run, a rank killed after its first complete checkpoint; where Ray put the ranks while it ran
    crashed = tmp_path_factory.mktemp("crashed")
    submitted_at = time.time()
    proc = submit(two_nodes, crashed, "divclip-two-nodes-crash", wait=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    tracker = crashed / "ckpt" / "latest_checkpointed_iteration.txt"
    deadline = time.monotonic() + 900
    # killed once its first checkpoint is complete and its first step's metrics are logged (verl logs a step after
    # saving its checkpoint: a kill between the two lost step 1's metrics once)
    while not (tracker.exists() and tracker.read_text().strip() and 1 in logged_steps(crashed)):
        assert time.monotonic() < deadline and job_status(two_nodes, "divclip-two-nodes-crash") in (
            JobStatus.PENDING,
            JobStatus.RUNNING,
        ), client.get_job_logs("divclip-two-nodes-crash")[-4000:]
        time.sleep(0.5)
    ranks = actor_ranks(two_nodes)
    victim = next((a for a in ranks if a.node_id == two_nodes["nodes"]["second"]), None)
    assert victim is not None, ranks  # no rank on the second node
    os.kill(victim.pid, signal.SIGKILL)
    status, seconds = wait_for_status(two_nodes, "divclip-two-nodes-crash", FAIL_WITHIN_S)
    result["crashed"] = {
        "out": crashed,
        "status": status,
        "seconds_to_fail": seconds,
        "placements": ranks,
        "victim": victim,
        "survivor": next(a for a in ranks if a.actor_id != victim.actor_id),
        "logs": client.get_job_logs("divclip-two-nodes-crash"),
    }
    result["crashed"]["leftovers"] = job_leftovers(watch, submitted_at)
    (crashed / "job-crashed.log").write_text(result["crashed"]["logs"])

    # 2. resumed: the same submission again
    submitted_at = time.time()
    proc = submit(two_nodes, crashed, "divclip-two-nodes-resume", wait=True)
    result["resumed"] = {
        "status": wait_for_status(two_nodes, "divclip-two-nodes-resume", 900)[0],
        "logs": client.get_job_logs("divclip-two-nodes-resume"),
        "submit": proc,
        "submitted_at": submitted_at,
    }
    result["resumed"]["leftovers"] = job_leftovers(watch, submitted_at)
    (crashed / "job-resumed.log").write_text(result["resumed"]["logs"])
    result["seconds"] = time.monotonic() - started
    return result


def assert_no_leftovers(job: dict[str, Any]) -> None:
    leftovers = job["leftovers"]
    assert leftovers["processes"] > 0  # the job's driver and workers were seen while it ran
    assert leftovers["left"] == [], (
        f"{len(leftovers['left'])} of the job's {leftovers['processes']} processes "
        f"outlived it by {leftovers['seconds']:.0f} s: {leftovers['left']}"
    )


def test_training_runs_on_two_nodes_with_the_rules_on_every_step(
    runs: dict[str, Any], two_nodes: dict[str, Any]
) -> None:
    """The run's steps -- the first from the attempt that was killed after it, the rest from the resumed one --
    with one rank on each node: every step on-policy exact with ERC's ratio and a finite loss, the adaptive delta
    following its rule, validation at the last step, and every step's checkpoint holding the delta the controller
    set next."""
    from ray.job_submission import JobStatus

    crashed, resumed = runs["crashed"], runs["resumed"]
    assert resumed["status"] == JobStatus.SUCCEEDED, resumed["logs"][-4000:]
    assert sorted(a.node_id for a in crashed["placements"]) == sorted(two_nodes["nodes"].values())  # one rank per node
    metrics = step_metrics(crashed["out"])
    assert sorted(metrics) == list(range(1, STEPS + 1))
    for step, data in sorted(metrics.items()):
        assert_on_policy_exact(data, erc=True)
        assert math.isfinite(data["actor/pg_loss"]) and "actor/divclip/erc/ratio_mean" in data
        assert data["actor/divclip/delta"] == pytest.approx(expected_delta(step), rel=1e-12), step
        assert 0 <= data["actor/divclip/kl3_mean"] < ADAPTIVE["target"] / ADAPTIVE["tolerance"], step  # the premise
    assert any(k.startswith("val-core/") for k in metrics[STEPS])  # validated at the last step
    lowest = min(data["critic/score/min"] for data in metrics.values())  # verl keeps scores in float32
    assert lowest == pytest.approx(UNPARSEABLE_SCORE, rel=2**-24, abs=0)  # the run's reward_kwargs reached the reward
    assert assert_only_complete_checkpoints(crashed["out"] / "ckpt") == STEPS
    for step in range(1, STEPS + 1):  # the controller's state saved with each checkpoint is the delta it set next
        state = json.loads(
            (crashed["out"] / "ckpt" / f"global_step_{step}" / "divclip_adaptive_delta.json").read_text()
        )
        assert state["delta"] == pytest.approx(metrics[step]["actor/divclip/delta_next"], rel=1e-12)
        assert state["metric"] == "actor/divclip/kl3_mean"


def test_a_killed_rank_fails_the_job_in_bounded_time_leaving_complete_checkpoints(runs: dict[str, Any]) -> None:
    from ray.job_submission import JobStatus

    crashed = runs["crashed"]
    assert crashed["status"] == JobStatus.FAILED and crashed["seconds_to_fail"] < FAIL_WITHIN_S
    logs, victim, survivor = crashed["logs"], crashed["victim"], crashed["survivor"]
    # The cause names the killed actor itself: Ray's report of its death carries the actor id (and the pid)
    # the state API gave for the rank on the second node; the other rank, alive when the job failed, is not
    # reported dead.
    reports = death_reports(logs)
    assert {"actor_id": victim.actor_id, "pid": str(victim.pid)} in [
        {"actor_id": r["actor_id"], "pid": r["pid"]} for r in reports
    ], (victim.actor_id, victim.pid, reports, logs[-4000:])
    assert all(r["class_name"].endswith("WorkerDict") for r in reports if r["actor_id"] == victim.actor_id)
    assert survivor.actor_id not in {r["actor_id"] for r in reports}, reports
    assert_no_leftovers(crashed)


def test_resume_continues_from_the_last_complete_checkpoint_and_repeats_no_prompt(runs: dict[str, Any]) -> None:
    from ray.job_submission import JobStatus

    from tests.helpers import read_trace

    resumed, crashed_out = runs["resumed"], runs["crashed"]["out"]
    assert resumed["status"] == JobStatus.SUCCEEDED, resumed["logs"][-4000:]
    assert assert_only_complete_checkpoints(crashed_out / "ckpt") == STEPS
    trace = read_trace(str(crashed_out / "trace.jsonl"))
    attempts = list(dict.fromkeys(line["attempt"] for line in trace))
    assert len(attempts) == 2, attempts
    first = [line for line in trace if line["attempt"] == attempts[0]]
    second = [line for line in trace if line["attempt"] == attempts[1]]
    resumed_from = second[0]["step"] - 1  # the step counter continues after the checkpoint it loaded
    assert resumed_from >= 1 and [line["step"] for line in second] == list(range(resumed_from + 1, STEPS + 1))

    # Both ranks' optimizer state continues the saved one, by value. The resumed run's first checkpoint
    # after the resume (written by it: newer than its submission) holds the moments, step counters and
    # parameters after two AdamW updates from whatever the ranks loaded. Two runs of one seed do not draw
    # the same rollouts (measured: an uninterrupted and a crashed run's step-1 checkpoints already differ
    # by as much as the moments' own size), so no other run's checkpoint is a reference for the moments;
    # instead adam_misfits eliminates the unknown gradients and requires every element to follow
    # from the saved moments and parameters to float32 rounding. Had the
    # optimizer not been restored (a fresh AdamW: zero moments, step 0), or restored from other values,
    # the step counters would read 2 fewer and the moments and parameters would not fit: the controls below
    # show that on this very data a fresh or a foreign prior state misfits nearly every element.
    saved, written = (
        crashed_out / "ckpt" / f"global_step_{resumed_from}",
        crashed_out / "ckpt" / f"global_step_{resumed_from + 1}",
    )
    for rank in (0, 1):
        assert (written / "actor" / f"optim_world_size_2_rank_{rank}.pt").stat().st_mtime >= resumed["submitted_at"]
        before, after = load_shards(saved, rank), load_shards(written, rank)
        # the premise: an update before the checkpoint had a gradient (zero saved moments and no gradient after
        # them fit a fresh optimizer too: the checks below could not fail)
        assert any(_f64(s["exp_avg_sq"]).max() > 0 for s in before[0]["state"].values()), (rank, "zero moments")
        misfits, elements = adam_misfits(before, after)
        assert misfits == 0, f"rank {rank}: {misfits} of {elements} elements do not continue the saved optimizer state"
        steps = {int(s["step"]) for s in after[0]["state"].values()}
        assert (
            steps
            == {int(s["step"]) + UPDATES_PER_STEP for s in before[0]["state"].values()}
            == {UPDATES_PER_STEP * (resumed_from + 1)}
        ), rank
        hyper = [
            {k: v for k, v in g.items() if k != "params"}
            for g in (before[0]["param_groups"][0], after[0]["param_groups"][0])
        ]
        assert hyper[0] == hyper[1], rank  # the same lr (constant schedule), betas, eps and weight decay
        # the check's controls: a fresh optimizer, and other moments of this very run (the ones the resumed
        # run wrote two updates later: a real AdamW state, not the one loaded) under the saved step counter
        # and parameters, fail it nearly everywhere
        fresh = adam_misfits(before, after, prior="fresh")[0]
        foreign = adam_misfits(with_moments_of(before, after), after)[0]
        assert min(fresh, foreign) > elements / 2, (rank, fresh, foreign, elements)
        print(
            f"two-node test: rank {rank}: 0 of {elements} elements misfit the saved optimizer state; "
            f"{fresh} misfit a fresh one, {foreign} another one of the run"
        )
        # and each rank loaded its own shard of that checkpoint (one rank on each node)
        assert (
            f"[Rank {rank}] Loaded optimizer from {saved}/actor/optim_world_size_2_rank_{rank}.pt" in resumed["logs"]
        ), rank
    # the prompts kept (the crashed attempt up to the checkpoint, then the resumed one) are, step by step,
    # the next BATCH of verl's sampler order for the epoch: none skipped, none seen twice
    kept = {line["step"]: line["prompts"] for line in first if line["step"] <= resumed_from}
    kept.update({line["step"]: line["prompts"] for line in second})
    assert sorted(kept) == list(range(1, STEPS + 1))
    order = epoch_order(crashed_out / "assets" / "data" / "train.parquet")
    for step, prompts in kept.items():
        assert [index for index, _ in prompts] == sorted(order[(step - 1) * BATCH : step * BATCH]), step
    # the adaptive delta continued from the checkpoint's controller state, not from its initial value
    metrics = step_metrics(crashed_out)
    assert metrics[resumed_from + 1]["actor/divclip/delta"] == pytest.approx(
        expected_delta(resumed_from + 1), rel=1e-12
    )
    assert expected_delta(resumed_from + 1) != ADAPTIVE["delta"]
    for data in metrics.values():
        assert_on_policy_exact(data, erc=True)
    assert_no_leftovers(resumed)
    jobs = {name: runs[name]["leftovers"] for name in ("crashed", "resumed")}
    print(
        f"two-node test: {runs['seconds']:.0f} s for the two jobs; failed {runs['crashed']['seconds_to_fail']:.0f} s "
        f"after the kill; processes per job (all ended, seconds after the job's end): "
        + ", ".join(f"{n} {j['processes']} ({j['seconds']:.1f} s)" for n, j in jobs.items())
    )
