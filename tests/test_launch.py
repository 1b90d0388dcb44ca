"""Every launch script dry-runs (through `python -m recipe.main`, on CPU, without model, data or
Ray) and its resolved YAML carries the paper row's hyperparameters; the environment overrides,
the sweep's rows and the scripts' errors behave as documented in docs/experiments.md."""

from __future__ import annotations

import os
import re
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
LAUNCH = ROOT / "launch"
ENV_KEYS = ("MODEL_PATH", "TRAIN_FILES", "VAL_FILES", "NNODES", "GPUS_PER_NODE", "CKPT_DIR", "PROJECT_NAME",
            "EXPERIMENT_NAME", "DATA_DIR", "DIVCLIP_DATA_DIR", "ATR_MODEL", "SWEEP_JOBS")

ERC_SCRIPTS = {  # script -> (model, loss_mode, eps_low, eps_high, ERC on)
    "run_grpo_1.5b.sh": ("DeepSeek-R1-Distill-Qwen-1.5B", "clip", 0.2, 0.2, False),
    "run_grpo_7b.sh": ("DeepSeek-R1-Distill-Qwen-7B", "clip", 0.2, 0.2, False),
    "run_dapo_1.5b.sh": ("DeepSeek-R1-Distill-Qwen-1.5B", "clip", 0.2, 0.28, False),
    "run_dapo_7b.sh": ("DeepSeek-R1-Distill-Qwen-7B", "clip", 0.2, 0.28, False),
    "run_erc_dapo_1.5b.sh": ("DeepSeek-R1-Distill-Qwen-1.5B", "clip", 0.2, 0.28, True),
    "run_erc_dapo_7b.sh": ("DeepSeek-R1-Distill-Qwen-7B", "clip", 0.2, 0.28, True),
    "run_gppo_7b.sh": ("DeepSeek-R1-Distill-Qwen-7B", "gppo", 0.2, 0.2, False),
    "run_erc_gppo_7b.sh": ("DeepSeek-R1-Distill-Qwen-7B", "gppo", 0.2, 0.2, True),
}
ATR_SCRIPTS = {"run_atr_grpo_qwen3_1.7b.sh": "Qwen/Qwen3-1.7B", "run_atr_grpo_qwen3_8b.sh": "Qwen/Qwen3-8B"}

# sweep row -> the policy-loss settings it must resolve to (ATR Table 2, Table 3, delta ablation)
SWEEP = {
    "clip": {"loss_mode": "clip", "eps": (0.2, 0.2)},
    "clip_higher": {"loss_mode": "clip", "eps": (0.2, 0.28)},
    "dual_clip": {"loss_mode": "clip", "eps": (0.2, 0.2), "dual_clip_c": 3.0},
    "dynamic_clip": {"loss_mode": "dcpo", "eps": (0.2, 0.2), "dcpo_cap": 10.0},
    "clip_cov": {"loss_mode": "clip_cov", "eps": (0.2, 0.2), "clip_cov_ratio": 0.0002},
    "soft_gate": {"loss_mode": "sapo", "tau": (1.0, 1.05)},
    "atr": {"loss_mode": "kl3", "delta": 0.07},
    "clip_eps0.1": {"loss_mode": "clip", "eps": (0.1, 0.1)},
    "clip_eps0.3": {"loss_mode": "clip", "eps": (0.3, 0.3)},
    "clip_eps0.4": {"loss_mode": "clip", "eps": (0.4, 0.4)},
    "clip_eps0.5": {"loss_mode": "clip", "eps": (0.5, 0.5)},
    "clip_eps0.329": {"loss_mode": "clip", "eps": (0.329, 0.329)},
    "clip_eps0.422": {"loss_mode": "clip", "eps": (0.422, 0.422)},
    "clip_higher_0.329_0.5": {"loss_mode": "clip", "eps": (0.329, 0.5)},
    "clip_higher_0.329_0.6": {"loss_mode": "clip", "eps": (0.329, 0.6)},
    "kl1": {"loss_mode": "kl1", "delta": 0.07},
    "kl2": {"loss_mode": "kl2", "delta": 0.07},
    "full_kl_guided": {"loss_mode": "trgppo", "delta": 0.07, "eps": (0.2, 0.2)},
    "is_kl3": {"loss_mode": "is_kl3", "delta": 0.07},
    "atr_delta0.01": {"loss_mode": "kl3", "delta": 0.01},
    "atr_delta0.03": {"loss_mode": "kl3", "delta": 0.03},
    "atr_delta0.05": {"loss_mode": "kl3", "delta": 0.05},
    "atr_delta0.1": {"loss_mode": "kl3", "delta": 0.1},
    "atr_delta0.15": {"loss_mode": "kl3", "delta": 0.15},
    "seq_kl3": {"loss_mode": "seq_kl3", "delta": 0.07},
}

# rows the test dry-runs through the script itself; every row is composed and validated in-process
# from the overrides the script lists (test_sweep_rows), which is what each row's dry run does
SWEEP_DRY_RUN = ("clip_cov", "soft_gate", "atr")

OVERRIDE_ENV = {
    "MODEL_PATH": "/models/my model",
    "TRAIN_FILES": "/d/train.parquet",
    "VAL_FILES": "/d/a.parquet, /d/b=c.parquet",
    "NNODES": "2",
    "GPUS_PER_NODE": "4",
    "CKPT_DIR": "/ckpt/run 1",
    "PROJECT_NAME": "proj",
    "EXPERIMENT_NAME": "exp,1",
}


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ENV_KEYS}
    return {**env, **(extra or {})}


def run_script(script: str, *args: str, env: dict[str, str] | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(LAUNCH / script), *args], cwd="/", capture_output=True, text=True,
                          env=_env(env), timeout=timeout)


def _load(proc: subprocess.CompletedProcess) -> Any:
    assert proc.returncode == 0, proc.stderr[-3000:]
    return yaml.safe_load(proc.stdout)


@pytest.fixture(scope="module")
def dry_runs() -> dict[str, subprocess.CompletedProcess]:
    """All dry runs, two at a time (the sweep's own rows two at a time as well)."""
    jobs = {script: (script, ("--dry-run",), None) for script in [*ERC_SCRIPTS, *ATR_SCRIPTS, "run_quickstart_1gpu.sh"]}
    jobs["run_atr_grpo_qwen3_8b.sh"] = ("run_atr_grpo_qwen3_8b.sh", ("--dry-run",), {"DATA_DIR": "/srv/divclip data"})
    # Hydra's flags pass through, wherever they are given
    jobs["env"] = ("run_erc_dapo_7b.sh", ("actor_rollout_ref.actor.optim.lr=2e-6", "--dry-run", "--config-name",
                                          "divclip_trainer", "trainer.nnodes=3"),
                   OVERRIDE_ENV)
    jobs["sweep"] = ("sweep_atr_baselines.sh", ("--dry-run", "--only", ",".join(SWEEP_DRY_RUN), "trainer.save_freq=7"),
                     {"SWEEP_JOBS": "2"})
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {key: pool.submit(run_script, script, *args, env=env)
                   for key, (script, args, env) in sorted(jobs.items(), key=lambda kv: kv[0] != "sweep")}
        procs = {key: future.result() for key, future in futures.items()}
    return procs


def _config(dry_runs: dict[str, subprocess.CompletedProcess], key: str) -> Any:
    """The parsed YAML of one dry run (each test fails on its own run only)."""
    proc = dry_runs[key]
    assert proc.returncode == 0, f"{key}: {proc.stderr[-3000:]}"
    if key != "sweep":
        return yaml.safe_load(proc.stdout)
    names = re.findall(r"^--- # (\S+)$", proc.stdout, flags=re.M)
    return dict(zip(names, yaml.safe_load_all(proc.stdout), strict=True))


def _actor(config: Any) -> Any:
    return config["actor_rollout_ref"]["actor"]


@pytest.mark.parametrize("script", sorted(ERC_SCRIPTS))
def test_erc_rows(dry_runs, script):
    model, mode, eps_low, eps_high, erc = ERC_SCRIPTS[script]
    config = _config(dry_runs, script)
    actor, rollout, data = _actor(config), config["actor_rollout_ref"]["rollout"], config["data"]
    policy = actor["policy_loss"]
    assert config["actor_rollout_ref"]["model"]["path"] == f"deepseek-ai/{model}"
    assert policy["_target_"] == "verl_ext.config.DivClipPolicyLossConfig"
    assert policy["loss_mode"] == mode and policy["dual_clip_c"] is None
    assert (actor["clip_ratio_low"], actor["clip_ratio_high"]) == (eps_low, eps_high)
    if mode == "gppo":
        assert (policy["gppo_beta_low"], policy["gppo_beta_high"]) == (1.0, 1.0)
    if erc:
        assert (policy["erc_beta_low"], policy["erc_beta_high"]) == (0.05, 0.05) and actor["calculate_entropy"] is True
    else:
        assert policy["erc_beta_low"] is None and policy["erc_beta_high"] is None
    # data and batch: KlearReasoner-MathSub-30K, 128 prompts x n=8, mini-batch 16 -> 8 updates a step
    assert data["train_files"].endswith("/klear-math-30k.parquet")
    assert data["train_batch_size"] == 128 and rollout["n"] == 8 and actor["rollout_n"] == 8
    assert actor["ppo_mini_batch_size"] == 16 and actor["ppo_epochs"] == 1
    assert data["max_response_length"] == 16384 and rollout["response_length"] == 16384
    assert actor["optim"]["lr"] == 1e-6 and actor["loss_agg_mode"] == "token-mean"
    assert actor["use_kl_loss"] is False and config["algorithm"]["use_kl_in_reward"] is False
    assert config["algorithm"]["adv_estimator"] == "grpo" and config["algorithm"]["norm_adv_by_std_in_grpo"] is True
    # validation: six benchmarks, 32 samples (max across sets), T 0.6, top-p 0.95
    assert [Path(f).name for f in data["val_files"]] == [
        "aime24.parquet", "aime25.parquet", "hmmt25.parquet", "amc23.parquet", "math500.parquet", "olympiadbench.parquet"]
    val = rollout["val_kwargs"]
    assert (val["n"], val["temperature"], val["top_p"], val["do_sample"]) == (32, 0.6, 0.95, True)
    assert rollout["name"] == "vllm"
    assert config["reward"]["custom_reward_function"] == {
        "path": "recipe/reward.py", "name": "compute_score", "reward_kwargs": {"think": "required"}}
    assert config["trainer"]["experiment_name"] == script[len("run_"):-len(".sh")]
    assert config["trainer"]["project_name"] == "divclip-erc"


@pytest.mark.parametrize("script", sorted(ATR_SCRIPTS))
def test_atr_rows(dry_runs, script):
    config = _config(dry_runs, script)
    actor, rollout, data, model = (_actor(config), config["actor_rollout_ref"]["rollout"], config["data"],
                                   config["actor_rollout_ref"]["model"])
    assert model["path"] == ATR_SCRIPTS[script]
    assert (model["lora_rank"], model["lora_alpha"], model["target_modules"]) == (32, 64, "all-linear")
    assert actor["policy_loss"]["loss_mode"] == "kl3" and actor["policy_loss"]["delta"] == 0.07
    # Dr.GRPO backbone, beta = 0
    assert config["algorithm"]["adv_estimator"] == "grpo" and config["algorithm"]["norm_adv_by_std_in_grpo"] is False
    assert actor["loss_agg_mode"] == "seq-mean-token-sum-norm" and actor["loss_scale_factor"] == 1536
    assert actor["use_kl_loss"] is False and config["algorithm"]["use_kl_in_reward"] is False
    assert data["max_prompt_length"] + data["max_response_length"] == 2048
    assert rollout["n"] == 8 and (rollout["temperature"], rollout["top_p"]) == (1.0, 1.0)
    optim = actor["optim"]
    assert (optim["optimizer"], optim["lr"], optim["weight_decay"]) == ("AdamW", 5e-6, 1e-3)
    # TRL 8 completions/device x 4 accumulation x 8 devices = 256 completions = 32 prompts per update,
    # two updates per rollout (mu = 2): 500 rollouts = 1,000 optimizer steps, validation every 50 of them
    assert data["train_batch_size"] == 32 and actor["ppo_mini_batch_size"] == 32 and actor["ppo_epochs"] == 2
    assert config["trainer"]["total_training_steps"] * actor["ppo_epochs"] == 1000
    assert config["trainer"]["test_freq"] * actor["ppo_epochs"] == 50
    assert [Path(f).name for f in data["val_files"]] == ["amc23.parquet", "aime24.parquet", "aime25.parquet"]
    val = rollout["val_kwargs"]
    assert (val["n"], val["temperature"], val["top_p"], val["do_sample"]) == (8, 0.3, 0.95, True)
    assert data["apply_chat_template_kwargs"] == {"enable_thinking": False}


def test_data_dir_feeds_the_default_files(dry_runs):
    data = _config(dry_runs, "run_atr_grpo_qwen3_8b.sh")["data"]
    assert data["train_files"] == "/srv/divclip data/dapo-math-17k.parquet"
    assert data["val_files"][0] == "/srv/divclip data/amc23.parquet"


def test_quickstart(dry_runs):
    config = _config(dry_runs, "run_quickstart_1gpu.sh")
    actor, trainer = _actor(config), config["trainer"]
    assert config["actor_rollout_ref"]["model"]["path"] == "Qwen/Qwen3-0.6B"
    assert (trainer["nnodes"], trainer["n_gpus_per_node"], trainer["total_training_steps"]) == (1, 1, 5)
    assert config["actor_rollout_ref"]["rollout"]["tensor_model_parallel_size"] == 1
    assert 1024 <= config["data"]["max_response_length"] <= 2048
    assert actor["policy_loss"]["loss_mode"] == "clip" and actor["policy_loss"]["erc_beta_low"] == 0.05
    assert (actor["clip_ratio_low"], actor["clip_ratio_high"]) == (0.2, 0.28) and actor["calculate_entropy"] is True


def test_environment_overrides_and_extra_hydra_overrides(dry_runs):
    config = _config(dry_runs, "env")
    trainer, data = config["trainer"], config["data"]
    assert config["actor_rollout_ref"]["model"]["path"] == "/models/my model"
    assert data["train_files"] == "/d/train.parquet" and data["val_files"] == ["/d/a.parquet", "/d/b=c.parquet"]
    assert trainer["n_gpus_per_node"] == 4 and trainer["nnodes"] == 3  # explicit override beats NNODES=2
    assert trainer["default_local_dir"] == "/ckpt/run 1"
    assert (trainer["project_name"], trainer["experiment_name"]) == ("proj", "exp,1")
    assert _actor(config)["optim"]["lr"] == 2e-6


def _check_sweep_row(name: str, config: Any) -> None:
    want = SWEEP[name]
    actor = _actor(config)
    policy = actor["policy_loss"]
    assert policy["loss_mode"] == want["loss_mode"], name
    if "eps" in want:
        assert (actor["clip_ratio_low"], actor["clip_ratio_high"]) == want["eps"], name
    if "delta" in want:
        assert policy["delta"] == want["delta"], name
    if "tau" in want:
        assert (actor["tau_pos"], actor["tau_neg"]) == want["tau"], name
    for key in ("dual_clip_c", "dcpo_cap", "clip_cov_ratio"):
        if key in want:
            assert policy[key] == want[key], name
    if "dual_clip_c" not in want:
        assert policy["dual_clip_c"] is None, name
    # every row keeps the ATR backbone
    assert config["actor_rollout_ref"]["model"]["path"] == "Qwen/Qwen3-1.7B"
    assert config["actor_rollout_ref"]["model"]["lora_rank"] == 32
    assert config["algorithm"]["norm_adv_by_std_in_grpo"] is False
    assert config["trainer"]["experiment_name"] == f"atr_1.7b_{name}"


def test_sweep_dry_run(dry_runs):
    rows = _config(dry_runs, "sweep")
    assert list(rows) == list(SWEEP_DRY_RUN)
    for name, config in rows.items():
        _check_sweep_row(name, config)
        assert config["trainer"]["save_freq"] == 7  # extra overrides reach every row


def test_sweep_rows():
    """Each row the script lists, composed as its dry run composes it and validated by recipe.main."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from recipe.main import CONFIG_DIR, validate

    proc = run_script("sweep_atr_baselines.sh", "--list")
    assert proc.returncode == 0, proc.stderr
    listed = dict(line.split("\t") for line in proc.stdout.splitlines())
    assert list(listed) == list(SWEEP)
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        for name, overrides in listed.items():
            config = compose(config_name="divclip_trainer", overrides=[
                "+experiments=atr_grpo_qwen3_1.7b", *overrides.split(), f"trainer.experiment_name=atr_1.7b_{name}"])
            validate(config)
            _check_sweep_row(name, OmegaConf.to_container(config, resolve=True))


def test_sweep_bad_rows():
    proc = run_script("sweep_atr_baselines.sh", "--list", "--only", "atr,nope")
    assert proc.returncode == 2 and "unknown row 'nope'" in proc.stderr
    proc = run_script("sweep_atr_baselines.sh", "--list", env={"ATR_MODEL": "3b"})
    assert proc.returncode == 2 and "ATR_MODEL must be 1.7b or 8b" in proc.stderr


@pytest.mark.parametrize("env, message", [
    ({"NNODES": "two"}, "NNODES must be a positive integer"),
    ({"GPUS_PER_NODE": "0"}, "GPUS_PER_NODE must be a positive integer"),
    ({"MODEL_PATH": "/m/it's"}, "MODEL_PATH: a value with a single quote"),
])
def test_bad_environment_is_a_clear_error(env, message):
    proc = run_script("run_dapo_7b.sh", "--dry-run", env=env)
    assert proc.returncode == 2 and message in proc.stderr and proc.stdout == ""


def test_every_experiment_config_has_its_script_and_doc_row():
    configs = {p.stem for p in (ROOT / "configs" / "experiments").glob("*.yaml")}
    scripts = {p.name[len("run_"):-len(".sh")] for p in LAUNCH.glob("run_*.sh") if not p.name.startswith("run_smoke_cpu")}
    assert configs == scripts
    doc = (ROOT / "docs" / "experiments.md").read_text()
    for name in scripts:
        assert f"launch/run_{name}.sh" in doc, name
    for name in SWEEP:
        assert f"`{name}`" in doc, name
