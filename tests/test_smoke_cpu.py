"""The CPU end-to-end smoke, shortened for CI: verl's real v1 trainer through `python -m recipe.main`
(local Ray, FSDP2 on the cpu platform, hf_cpu rollouts, our reward, validation, a checkpoint) for a
few steps, validating two benchmarks at their own response lengths and sample counts
(recipe/validation/length.py). Resuming from a checkpoint is tested on two Ray nodes, through a killed
rank (tests/test_two_nodes_ray.py). No learning margin here: the full run is
`bash launch/run_smoke_cpu.sh` (docs/cpu_end_to_end.md has its figures).

The runs here train as GPU users configure verl (:data:`GPU_PACKING`): bf16 parameters, dynamic batching
with the old-log-prob pass at twice the update's token budget (small enough that the two passes' micro-
batches differ), shuffled mini-batches, two a step, and a model whose output head is scaled so that its
logits are large enough for bf16's rounding to show the kernels' batch-size dependence. The on-policy gauge
is exactly 0 on every step of every run (the trainer hands the update's split to the old-log-prob pass,
and the update checked that it ran that packing). The main run trains ERC-DAPO through the vocabulary pass
with the KL3-vs-trust-region diagnostic over pi_old's stored top-k (``kl_full`` itself runs through the actor
worker in tests/test_full_kl_engine.py and tests/test_onpolicy.py; kl3 with the diagnostic from verl's logits
through the trainer in tests/test_sft_chain_cpu.py), with the released scripts' training mechanics: dynamic
sampling on the reward's ``acc`` (``algorithm.filter_groups``), the +1 / -1 reward, and the micro-batch-normalised
NLL on correct responses with dual-clip 10 (the smoke's tiny model writes no ``</think>``, so the think rule stays
off: every response would score -0.5 and no group would ever be kept). The gauge's control -- verl's own packing
of the old pass (``pack_old_log_prob_as_update=false``) shows the kernels' noise, the gauge > 0 -- runs through
verl's actor worker at the configs' packings in tests/test_onpolicy.py
(``test_verls_own_packing_shows_the_noise_the_alignment_removes``), with LoRA and the fused kernels in
tests/test_verl_features_engine.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import Optional

import pytest

from recipe.smoke.report import margin_test, merge_attempts

ROOT = Path(__file__).resolve().parents[1]


#: How GPU users run verl, for the smoke (launch/run_smoke_cpu.sh): verl's default bf16, dynamic batching at
#: 128 update / 256 old-pass tokens per micro-batch (each mini-batch of 64 sequences of 5-30 tokens spans several
#: micro-batches, packed differently by the two budgets), shuffled mini-batches (two a step: ppo_mini_batch_size
#: = BATCH / 2), and the head scaled by 30 (logits of tens, where one bf16 ulp is 0.06-0.125).
GPU_PACKING = {"PRECISION": "bf16", "DYNAMIC_BSZ": "128", "HEAD_SCALE": "30"}


#: A training run's limit in the suite: three times its longest time alone on 2 cores (the separate_async smoke,
#: ~15 min), so that it holds on a machine running a second suite beside this one (it ran past 900 s there).
SMOKE_TIMEOUT_S = 2700


def run_smoke(out: Path, loss: str, steps: int, *overrides: str, **env: str) -> subprocess.CompletedProcess:
    full_env = {
        **os.environ,
        "PYTHON": sys.executable,
        "SMOKE_OUT": str(out),
        "LOSS": loss,
        "STEPS": str(steps),
        **GPU_PACKING,
        **env,
    }
    full_env.pop("RAY_ADDRESS", None)
    proc = run_in_own_session(["bash", str(ROOT / "launch/run_smoke_cpu.sh"), *overrides], full_env, SMOKE_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def proc_stat(pid: int) -> Optional[tuple[int, int, int, str]]:
    """(ppid, session id, start time, state) from /proc/<pid>/stat, or None once the process is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[1]), int(fields[3]), int(fields[19]), fields[0]


def session_members(session: int) -> list[int]:
    """The pids of every process in ``session``."""
    pids = [int(path.name) for path in Path("/proc").iterdir() if path.name.isdigit()]
    return [pid for pid in pids if (stat := proc_stat(pid)) is not None and stat[1] == session]


def run_in_own_session(args: list[str], env: dict[str, str], timeout_s: float) -> subprocess.CompletedProcess:
    """``args`` in a session of its own; past ``timeout_s`` every process of that session -- the script, the
    training driver and the Ray session it started, whose workers keep the session -- is killed, so that a run
    that hangs fails its test without running on beside the rest of the suite (a timed-out smoke once left its
    whole Ray session busy for the rest of a suite)."""
    proc = subprocess.Popen(
        args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        for pid in session_members(proc.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            stdout, stderr = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:  # a process that left the session holds the pipes
            stdout, stderr = "", ""
        raise AssertionError(
            f"{' '.join(args[:2])} ran past {timeout_s} s; its session was killed\n{stdout[-3000:]}{stderr[-3000:]}"
        ) from None
    return subprocess.CompletedProcess(args, proc.returncode, stdout, stderr)


def assert_on_policy_exact(data: dict, erc: bool, vocab_pass: bool = False) -> None:
    """The step's on-policy gauge reads exactly 0 (every mode packs its old-log-prob pass as the update) and
    the workers' path record says how each micro-batch was computed (a measurement, not the driver's claim:
    ``pack_old_log_prob_as_update`` is 1 only where the update found its micro-batches packed as the old pass
    recorded)."""
    gauge = "actor/divclip/onpolicy/"
    assert data[gauge + "log_ratio_abs_max"] == 0.0 and data[gauge + "ratio_clipfrac"] == 0.0, data
    assert (gauge + "erc_masked_frac" in data) == erc
    if erc:
        assert data[gauge + "erc_masked_frac"] == 0.0 and data[gauge + "erc_ratio_dev_max"] == 0.0
    path = "actor/divclip/path/"
    assert data[path + "seam"] == 1.0 and data[path + "pack_old_log_prob_as_update"] == 1.0
    assert data[path + "vocab_pass"] == float(vocab_pass) and data[path + "entropy_fp32"] == float(erc or vocab_pass)


def step_metrics(out: Path) -> dict[int, dict]:
    """Each logged step's metrics (step 0: validation before training; one line per step)."""
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    metrics = {line["step"]: line["data"] for line in lines}
    assert len(metrics) == len(lines), "a step logged twice"
    return metrics


def assert_coarsened_kl_from_stored_top_k(data: dict, *more_diagnostic_keys: str) -> None:
    """The coarsened KL and its tails were computed from pi_old's stored top-k (the second mini-batch is
    off-policy), and the KL3-vs-trust-region diagnostic logged its figures."""
    assert data["actor/divclip/kl_full_mean"] >= 0 and 0 < data["actor/divclip/kl_full_tail_old"] < 1
    for key in ("mode_only_frac", "full_only_frac", "kl_clipped_mean", "kl_unclipped_mean", *more_diagnostic_keys):
        assert f"actor/divclip/kl_full_diag/{key}" in data


#: Per-benchmark validation (recipe.validation.length) on the same run: training responses stop at
#: 4 tokens (RESPONSE_LEN), validation answers the echo set at 12 tokens x val_kwargs.n = 1 and a
#: second set (the same prompts, data_source smoke_echo_long) at 16 tokens x 3. ignore_eos makes
#: every response exactly its limit. Validation is greedy (run_smoke_cpu.sh), which draws nothing
#: from the rollout server's sampling stream (test_cpu_rollout.py), so the training samples are
#: the ones a run validating at the training length would draw.
VAL_LENGTHS = {"smoke_echo": (12, 1), "smoke_echo_long": (16, 3)}  # data_source -> (length, n)
TRAIN_LENGTH = 4


def validation_length_args(out: Path) -> list[str]:
    from recipe.smoke.task import build_smoke_assets

    assets = out / "assets"
    if not (assets / "data" / "val_long.parquet").exists():
        build_smoke_assets(assets, head_scale=float(GPU_PACKING["HEAD_SCALE"]))
        write_with_data_source(assets / "data" / "val.parquet", assets / "data" / "val_long.parquet", "smoke_echo_long")
    (default_length, _), (long_length, long_n) = VAL_LENGTHS["smoke_echo"], VAL_LENGTHS["smoke_echo_long"]
    validation = "actor_rollout_ref.rollout.custom.validation"
    return [
        "actor_rollout_ref.rollout.ignore_eos=True",
        f"data.val_files=[{assets}/data/val.parquet,{assets}/data/val_long.parquet]",
        f"{validation}.response_length={default_length}",
        f"+{validation}.benchmarks.smoke_echo_long.response_length={long_length}",
        f"+{validation}.benchmarks.smoke_echo_long.n={long_n}",
        f"trainer.validation_data_dir={out}/validation",
    ]


def write_with_data_source(source: Path, target: Path, data_source: str) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pq.read_table(source)
    index = table.schema.get_field_index("data_source")
    kind = table.schema.field(index).type
    pq.write_table(
        table.set_column(index, pa.field("data_source", kind), pa.array([data_source] * table.num_rows, kind)), target
    )


@pytest.fixture(scope="module")
def erc_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """ERC-DAPO through the vocabulary pass (VOCAB_PASS=1: both passes' log-probs and entropies from the LM
    head's input in slices, no logits tensor), with the KL3-vs-trust-region diagnostic: pi_old's top-8 taken by
    the pass and stored by verl's old-log-prob pass through TransferQueue. Also records, in every process of the
    run, which of verl's classes and globals it has patched (:mod:`tests.process_probe`, imported by each
    process's ``import verl``). Trained with the released scripts' mechanics (:data:`RELEASED_PROFILE`), its
    rollouts dumped (``trainer.rollout_data_dir``)."""
    out = tmp_path_factory.mktemp("smoke_erc")
    args = validation_length_args(out)
    run_smoke(
        out,
        "erc_dapo",
        2,
        *args,
        *TOP_K_DIAGNOSTIC,
        *RELEASED_PROFILE,
        f"trainer.rollout_data_dir={out / 'rollouts'}",
        SAVE_FREQ="2",
        TEST_FREQ="2",
        RESPONSE_LEN=str(TRAIN_LENGTH),
        # lr 2e-4, as tests/test_trainer_modes_cpu.py: at the smoke's 5e-3 one update can make nearly every group's
        # 8 answers alike, and verl's dynamic sampling, which has no cap in its v1 trainer, then draws groups until
        # the timeout (seen once: step 2 found 2 usable groups in 40 minutes; a passing run evicted 87 samples at
        # step 1 and 447 at step 2)
        LR="2e-4",
        VOCAB_PASS="1",
        **probe_env(out / "probe"),
    )
    return out


#: the diagnostic over pi_old's top-8 of the 33-token vocabulary (the tail is one more bucket)
TOP_K_DIAGNOSTIC = (
    "actor_rollout_ref.actor.policy_loss.kl_full_diagnostic=True",
    "actor_rollout_ref.actor.policy_loss.kl_full_top_k=8",
)
#: the released scripts' training mechanics: dynamic sampling on ``acc``, the +1 / -1 reward, the correct-response
#: NLL normalised per micro-batch, dual-clip 10
RELEASED_PROFILE = (
    "algorithm.filter_groups.enable=true",
    "algorithm.filter_groups.metric=acc",
    "algorithm.filter_groups.max_inflight_gen_batches=2",
    "+reward.custom_reward_function.reward_kwargs.wrong_score=-1.0",
    "actor_rollout_ref.actor.policy_loss.dual_clip_c=10.0",
    "actor_rollout_ref.actor.policy_loss.correct_nll_coef=0.1",
    "actor_rollout_ref.actor.policy_loss.correct_nll_norm=micro_batch",
)
BATCH, ROLLOUT_N = 16, 8  # run_smoke_cpu.sh's defaults: prompts per step, responses per prompt


def probe_env(folder: Path) -> dict[str, str]:
    """The environment under which every process of a run imports :mod:`tests.process_probe` (``import verl``
    imports ``VERL_USE_EXTERNAL_MODULES``; local Ray's processes inherit the driver's environment)."""
    python_path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {
        "VERL_USE_EXTERNAL_MODULES": "tests.process_probe",
        "DIVCLIP_PROBE_DIR": str(folder),
        "PYTHONPATH": python_path,
    }


def test_verl_is_patched_only_in_the_processes_that_build_the_patched_classes(erc_run: Path) -> None:
    """Each process of the run, as its last record saw it: the actor workers (the only ones that build verl's engine)
    have the engine seam's wrappers and its two dispatchers and verl's trainer registry; the TaskRunner (the only
    one that builds a trainer) has the divclip trainers in that registry and verl's engine classes and globals;
    every other process -- driver, rollout servers, agent-loop and reward workers, TransferQueue -- keeps all of
    verl's as verl defines them and imported neither the actor loss, nor the seam, nor the trainer module."""
    from tests.process_probe import ORIGINAL_ATTR
    from verl_ext.engine.swap import ORIGINAL_ATTR as SEAM_ORIGINAL_ATTR

    assert ORIGINAL_ATTR == SEAM_ORIGINAL_ATTR  # the probe looks for the seam's own mark
    records = [json.loads(path.read_text()) for path in sorted((erc_run / "probe").glob("*.json"))]
    verl_trainers = {
        "sync": "PPOTrainerSync",
        "colocate_async": "PPOTrainerColocateAsync",
        "separate_async": "PPOTrainerSeparateAsync",
    }
    divclip_trainers = {mode: f"DivClip{name}" for mode, name in verl_trainers.items()}
    assert records
    kinds: Counter = Counter()
    for found in records:
        title, wrapped, trainers = found["title"], found["wrapped"], found["trainers"]
        kind = next((kind for kind, name in PROCESS_KINDS.items() if name in title), title.split()[0])
        kinds[kind] += 1
        if kind == "actor worker":
            assert all(wrapped.values()) and trainers in (None, verl_trainers), found
            assert "recipe.trainer" not in found["modules"], found
            continue
        assert not any(wrapped.values()), found
        if kind == "TaskRunner":
            assert trainers == divclip_trainers, found
        else:
            assert trainers in (None, verl_trainers), found
            if kind != "driver":  # the driver imports recipe.trainer to hand Ray the TaskRunner's class
                assert found["modules"] == [], found
    assert kinds["driver"] == kinds["TaskRunner"] == 1 and kinds["actor worker"] >= 1, kinds
    for kind in ("agent-loop worker", "reward worker", "rollout server"):  # verl's rollout, agent loop and reward
        assert kinds[kind] >= 1, kinds


#: A substring of each kind's process title (Ray: ``ray::<actor class>``) in the smoke run.
PROCESS_KINDS = {
    "driver": "recipe.main",
    "TaskRunner": "ray::DivClipTaskRunner",
    "actor worker": "ray::WorkerDict",
    "agent-loop worker": "ray::AgentLoopWorker",
    "reward worker": "ray::RewardLoopWorker",
    "rollout server": "ray::HFCpuServer",
}


def test_trainer_runs_erc_dapo_end_to_end(erc_run: Path) -> None:
    metrics = step_metrics(erc_run)
    assert {1, 2} <= set(metrics)
    for step in (1, 2):
        data = metrics[step]
        assert -1.0 <= data["critic/score/mean"] <= 1.0  # the +1 / -1 reward
        # our actor loss ran, with ERC on and both entropies available
        assert "actor/divclip/erc/ratio_mean" in data and data["actor/divclip/erc/ratio_mean"] > 0
        assert "actor/divclip/kl3_mean" in data
        # the on-policy gauge (first mini-batch, before the optimizer step) on every step:
        # the old-log-prob pass is packed as the update, so ERC measures the policy, not the kernels;
        # the workers computed both passes through the vocabulary pass
        assert_on_policy_exact(data, erc=True, vocab_pass=True)
        assert_coarsened_kl_from_stored_top_k(data)
    assert any(k.startswith("val-core/") for k in metrics[0])  # validation before training
    assert (erc_run / "curves.png").stat().st_size > 10_000
    report = json.loads((erc_run / "report.json").read_text())
    assert report["steps"] == [1, 2] and "too few" in report["verdict"]


def test_validation_runs_each_benchmark_at_its_own_length_and_n(erc_run: Path) -> None:
    metrics = step_metrics(erc_run)
    validated = [step for step in sorted(metrics) if any(k.startswith("val-core/") for k in metrics[step])]
    assert validated == [0, 2]
    for step in validated:
        data = metrics[step]
        for source, (length, n) in VAL_LENGTHS.items():
            prefix = f"val-aux/{source}/response_length"
            # every validation response is its benchmark's length, longer than any training response
            assert (data[f"{prefix}/min"], data[f"{prefix}/max"], data[f"{prefix}/limit"]) == (length, length, length)
            assert data[f"{prefix}/clip_ratio"] == 1.0 and length > TRAIN_LENGTH
            # n samples per prompt: verl names the accuracy mean@n
            assert f"val-core/{source}/acc/mean@{n}" in data, sorted(k for k in data if k.startswith("val-core/"))
    for step in (1, 2):  # training rollouts: still capped at the training length
        data = metrics[step]
        assert (data["response_length/min"], data["response_length/max"]) == (TRAIN_LENGTH, TRAIN_LENGTH)
    # the dumped validation generations: 20 prompts answered once, the same 20 prompts 3 times
    rows = [json.loads(line) for line in (erc_run / "validation" / "0.jsonl").read_text().splitlines()]
    per_prompt = Counter(row["uid"].rsplit("_", 2)[0] for row in rows)
    assert Counter(per_prompt.values()) == {1: 20, 3: 20} and len(rows) == 80


def test_every_trained_group_has_mixed_results(erc_run: Path) -> None:
    """Dynamic sampling: every group the update trained has both rewards (+1 and -1), never all alike."""
    for step in (1, 2):
        rows = [json.loads(line) for line in (erc_run / "rollouts" / f"{step}.jsonl").read_text().splitlines()]
        groups: dict[str, list[float]] = defaultdict(list)
        for row in rows:
            groups[row["uid"].split("_")[0]].append(row["score"])
        assert len(groups) == BATCH and all(len(scores) == ROLLOUT_N for scores in groups.values()), step
        for scores in groups.values():
            assert set(scores) == {1.0, -1.0}, (step, scores)


def test_filtering_dropped_groups_and_the_nll_ran(erc_run: Path) -> None:
    metrics = step_metrics(erc_run)
    for step in (1, 2):
        data = metrics[step]
        assert data["training/filter_groups/evicted_samples"] > 0  # uniform groups occurred and were replaced
        assert data["actor/divclip/correct_nll"] > 0 and 0 < data["actor/divclip/correct_fraction"] < 1
    # with the batch refilled by dynamic sampling, ERC stays exactly on-policy on every step: assert_on_policy_exact
    # in test_trainer_runs_erc_dapo_end_to_end, on this run


def test_margin_test_arithmetic() -> None:
    result = margin_test([0.1, 0.1, 0.2, 0.1, 0.0, 0.3, 0.4, 0.3, 0.5, 0.5])
    assert result["margin"] == pytest.approx(0.4 - 0.1)
    se = ((0.005 / 5) + (0.01 / 5)) ** 0.5  # sample variances 0.005 and 0.01
    assert result["stderr"] == pytest.approx(se)
    assert result["t"] == pytest.approx(0.3 / se)
    with pytest.raises(ValueError, match="at least 10"):
        margin_test([0.1] * 9)


def test_merge_attempts_prefers_the_later_attempt(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "a.jsonl").write_text('{"step": 1, "data": {"x": 1}}\n{"step": 2, "data": {"x": 2}}\n')
    os.utime(logs / "a.jsonl", (1, 1))
    (logs / "b.jsonl").write_text('{"step": 2, "data": {"x": 20, "y": 1}}\n')
    assert merge_attempts(tmp_path) == {1: {"x": 1}, 2: {"x": 20, "y": 1}}
    (logs / "c.jsonl").write_text("not json\n")
    with pytest.raises(ValueError, match=r"c\.jsonl:1"):
        merge_attempts(tmp_path)
