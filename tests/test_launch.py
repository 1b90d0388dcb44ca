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
from unittest import mock

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
LAUNCH = ROOT / "launch"
ENV_KEYS = (
    "MODEL_PATH",
    "TRAIN_FILES",
    "VAL_FILES",
    "NNODES",
    "GPUS_PER_NODE",
    "CKPT_DIR",
    "PROJECT_NAME",
    "EXPERIMENT_NAME",
    "DATA_DIR",
    "DIVCLIP_DATA_DIR",
    "ATR_MODEL",
    "SWEEP_JOBS",
    "STRATEGY",
    "VOCAB_PASS",
    "MODE",
    "ROLLOUT_GPUS_PER_NODE",
    "ROLLOUT_NNODES",
    "CKPT_ENGINE",
    "PYTHON",
)

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
ERC_VALIDATION = {  # data_source -> ERC section 4.1's length and samples per problem
    "aime24": {"response_length": 32768, "n": 32},
    "aime25": {"response_length": 32768, "n": 32},
    "hmmt25": {"response_length": 16384, "n": 32},
    "amc23": {"response_length": 16384, "n": 32},
    "math500": {"response_length": 16384, "n": 4},
    "olympiadbench": {"response_length": 16384, "n": 4},
}
# ATR Appendix B: every run starts from the OpenMathReasoning SFT checkpoint (launch/run_sft_openmath_qwen3_*.sh)
ATR_SCRIPTS = {
    "run_atr_grpo_qwen3_1.7b.sh": "checkpoints/divclip-sft/sft_openmath_qwen3_1.7b/merged_hf",
    "run_atr_grpo_qwen3_8b.sh": "checkpoints/divclip-sft/sft_openmath_qwen3_8b/merged_hf",
}

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
    "kl_full": {"loss_mode": "kl_full", "delta": 0.07, "kl_full_top_k": 32},
    "atr_delta0.01": {"loss_mode": "kl3", "delta": 0.01},
    "atr_delta0.03": {"loss_mode": "kl3", "delta": 0.03},
    "atr_delta0.05": {"loss_mode": "kl3", "delta": 0.05},
    "atr_delta0.1": {"loss_mode": "kl3", "delta": 0.1},
    "atr_delta0.15": {"loss_mode": "kl3", "delta": 0.15},
    "seq_kl3": {"loss_mode": "seq_kl3", "delta": 0.07},
}

# rows the test dry-runs through the script itself; every row is composed and validated in-process
# from the overrides the script lists (test_sweep_rows), which is what each row's dry run does
SWEEP_DRY_RUN = ("clip_cov", "kl_full")  # two rows in parallel, in order; every row: test_sweep_rows

OVERRIDE_ENV = {
    "MODEL_PATH": "/models/my model",
    "TRAIN_FILES": "/d/train.parquet",
    "VAL_FILES": "/d/a.parquet, /d/b=c.parquet",
    "NNODES": "2",
    "GPUS_PER_NODE": "4",
    "CKPT_DIR": "/ckpt/run 1",
    "PROJECT_NAME": "proj",
    "EXPERIMENT_NAME": "exp,1",
    "STRATEGY": "fsdp",
}


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ENV_KEYS}
    return {**env, **(extra or {})}


def run_script(
    script: str, *args: str, env: dict[str, str] | None = None, timeout: int = 600
) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(LAUNCH / script), *args], cwd="/", capture_output=True, text=True, env=_env(env), timeout=timeout
    )


def _load(proc: subprocess.CompletedProcess) -> Any:
    assert proc.returncode == 0, proc.stderr[-3000:]
    return yaml.safe_load(proc.stdout)


#: A stand-in interpreter for the scripts (``PYTHON=<it>``): prints the data folder the script exported and the
#: command line it would run, NUL-separated, instead of running Python.
PRINTER = '#!/bin/sh\nprintf \'%s\\0\' "$DIVCLIP_DATA_DIR" "$@"\n'


def write_printer(folder: Path) -> str:
    """:data:`PRINTER` as an executable in ``folder``; its path."""
    path = folder / "print_argv"
    path.write_text(PRINTER)
    path.chmod(0o755)
    return str(path)


@pytest.fixture(scope="module")
def printer(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_printer(tmp_path_factory.mktemp("printer"))


def script_config(printer: str, script: str, *args: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    """The resolved config a script's dry run prints, composed and validated by ``recipe.main`` in this process
    from the command line the script builds (read with :data:`PRINTER`): the script's own environment mapping,
    argument handling and checks run as they are; only the Python start per script is saved. A few scripts
    still dry-run for real (:func:`dry_runs`), which covers ``recipe.main --dry-run`` itself."""
    proc = run_script(script, *args, env={**(env or {}), "PYTHON": printer})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return composed(proc.stdout)


def composed(printed: str) -> dict[str, Any]:
    """The resolved config of one command line :data:`PRINTER` printed, composed and validated in this process."""
    from omegaconf import OmegaConf

    from recipe.main import validate
    from tests.test_recipe_main import compose_config

    data_dir, *argv = printed.split("\0")[:-1]
    assert argv[:2] == ["-m", "recipe.main"], argv
    flags = [arg for arg in argv[2:] if arg.startswith("-")]
    assert flags in ([], ["--dry-run"]), flags  # Hydra's own flags: the real dry runs
    with mock.patch.dict(os.environ, {"DIVCLIP_DATA_DIR": data_dir}):  # what the script exported for its interpreter
        config = compose_config(*[arg for arg in argv[2:] if arg not in flags])
        validate(config)
        return OmegaConf.to_container(config, resolve=True)


@pytest.fixture(scope="module")
def dry_runs(printer: str) -> dict[str, Any]:
    """Every script's resolved config: real dry runs (two at a time) where ``recipe.main --dry-run`` itself is
    under test -- Hydra's flags passed through, the sweep, the quickstart -- and the paper rows
    through :func:`script_config`."""
    jobs = {"run_quickstart_1gpu.sh": ("run_quickstart_1gpu.sh", ("--dry-run",), None)}
    # Hydra's flags pass through, wherever they are given
    jobs["env"] = (
        "run_erc_dapo_7b.sh",
        ("actor_rollout_ref.actor.optim.lr=2e-6", "--dry-run", "--config-name", "divclip_trainer", "trainer.nnodes=3"),
        OVERRIDE_ENV,
    )
    jobs["sweep"] = (
        "sweep_atr_baselines.sh",
        ("--dry-run", "--only", ",".join(SWEEP_DRY_RUN), "trainer.save_freq=7"),
        {"SWEEP_JOBS": "2"},
    )
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {
            key: pool.submit(run_script, script, *args, env=env)
            for key, (script, args, env) in sorted(jobs.items(), key=lambda kv: kv[0] != "sweep")
        }
        results: dict[str, Any] = {key: future.result() for key, future in futures.items()}
    for script in [*ERC_SCRIPTS, *ATR_SCRIPTS]:
        env = {"DATA_DIR": "/srv/divclip data"} if script == "run_atr_grpo_qwen3_8b.sh" else None
        results[script] = script_config(printer, script, "--dry-run", env=env)
    return results


def _config(dry_runs: dict[str, Any], key: str) -> Any:
    """One script's resolved config (each test fails on its own run only): composed in-process, or the parsed
    YAML of a real dry run."""
    result = dry_runs[key]
    if isinstance(result, dict):
        return result
    assert result.returncode == 0, f"{key}: {result.stderr[-3000:]}"
    if key != "sweep":
        return yaml.safe_load(result.stdout)
    names = re.findall(r"^--- # (\S+)$", result.stdout, flags=re.M)
    return dict(zip(names, yaml.safe_load_all(result.stdout), strict=True))


def _actor(config: Any) -> Any:
    return config["actor_rollout_ref"]["actor"]


@pytest.mark.parametrize("script", sorted(ERC_SCRIPTS))
def test_erc_rows(dry_runs, script):
    model, mode, eps_low, eps_high, erc = ERC_SCRIPTS[script]
    config = _config(dry_runs, script)
    actor, rollout, data = _actor(config), config["actor_rollout_ref"]["rollout"], config["data"]
    policy = actor["policy_loss"]
    assert config["actor_rollout_ref"]["model"]["path"] == f"deepseek-ai/{model}"
    assert config["trainer"]["v1"]["trainer_mode"] == "sync"  # what the paper ran; MODE switches it
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
        "aime24.parquet",
        "aime25.parquet",
        "hmmt25.parquet",
        "amc23.parquet",
        "math500.parquet",
        "olympiadbench.parquet",
    ]
    val = rollout["val_kwargs"]
    assert (val["n"], val["temperature"], val["top_p"], val["do_sample"]) == (32, 0.6, 0.95, True)
    # ERC section 4.1 per benchmark: avg@32 at 32k (AIME), avg@32 at 16k, avg@4 at 16k; within the
    # model's 131,072 positions (recipe/validation/length.py checks prompt + length against it)
    assert rollout["custom"]["validation"] == {"response_length": None, "benchmarks": ERC_VALIDATION}
    assert rollout["max_model_len"] == 131072
    assert rollout["name"] == "vllm"
    assert config["reward"]["custom_reward_function"] == {
        "path": "recipe/reward/score.py",
        "name": "compute_score",
        "reward_kwargs": {
            "think": "required",
            "correct_score": 1.0,
            "wrong_score": 0.0,
            "unparseable_score": 0.0,
            "truncated_score": -0.5,
        },
    }  # the ERC runs' scores, stated (tests/test_reward_scores.py scores rows)
    assert config["trainer"]["experiment_name"] == script[len("run_") : -len(".sh")]
    assert config["trainer"]["project_name"] == "divclip-erc"


@pytest.mark.parametrize("script", sorted(ATR_SCRIPTS))
def test_atr_rows(dry_runs, script):
    config = _config(dry_runs, script)
    actor, rollout, data, model = (
        _actor(config),
        config["actor_rollout_ref"]["rollout"],
        config["data"],
        config["actor_rollout_ref"]["model"],
    )
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
    # ATR Appendix B / Table 4: one A100, TRL 8 completions x 4 accumulation = 32 completions = 4 prompts
    # x group 8 per update, two updates per rollout (mu = 2): 500 rollouts = 1,000 optimizer steps,
    # validation every 50 of them
    assert (config["trainer"]["nnodes"], config["trainer"]["n_gpus_per_node"]) == (1, 1)
    assert data["train_batch_size"] == 4 and actor["ppo_mini_batch_size"] == 4 and actor["ppo_epochs"] == 2
    assert actor["ppo_mini_batch_size"] * rollout["n"] == 32
    assert config["trainer"]["total_training_steps"] * actor["ppo_epochs"] == 1000
    assert config["trainer"]["test_freq"] * actor["ppo_epochs"] == 50
    # ATR Table 2's AMC is the 83-problem AI-MO set (AMC 2022 + 2023)
    assert [Path(f).name for f in data["val_files"]] == ["aimo_amc.parquet", "aime24.parquet", "aime25.parquet"]
    val = rollout["val_kwargs"]
    assert (val["n"], val["temperature"], val["top_p"], val["do_sample"]) == (8, 0.3, 0.95, True)
    # one validation setting for every set: the training length (1,536) and val_kwargs.n
    assert rollout["custom"]["validation"] == {"response_length": None, "benchmarks": {}}
    assert data["apply_chat_template_kwargs"] == {"enable_thinking": False}


def test_data_dir_feeds_the_default_files(dry_runs):
    data = _config(dry_runs, "run_atr_grpo_qwen3_8b.sh")["data"]
    assert data["train_files"] == "/srv/divclip data/dapo-math-17k.parquet"
    assert data["val_files"][0] == "/srv/divclip data/aimo_amc.parquet"


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
    assert _actor(config)["strategy"] == "fsdp" and config["actor_rollout_ref"]["ref"]["strategy"] == "fsdp"  # STRATEGY


def test_every_launch_script_resolves_fsdp2_with_the_aligned_packing(dry_runs):
    """FSDP2 is what every CPU test and the GPU probe run; FSDP1 stays selectable (STRATEGY=fsdp, above)."""
    for key in dry_runs:
        if key == "env":
            continue
        configs = _config(dry_runs, key).values() if key == "sweep" else [_config(dry_runs, key)]
        for config in configs:
            actor = _actor(config)
            assert actor["strategy"] == "fsdp2" and config["actor_rollout_ref"]["ref"]["strategy"] == "fsdp2", key
            assert actor["policy_loss"]["pack_old_log_prob_as_update"] is True, key


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
    for key in ("dual_clip_c", "dcpo_cap", "clip_cov_ratio", "kl_full_top_k"):
        if key in want:
            assert policy[key] == want[key], name
    if "dual_clip_c" not in want:
        assert policy["dual_clip_c"] is None, name
    # every row keeps the ATR backbone
    assert config["actor_rollout_ref"]["model"]["path"] == ATR_SCRIPTS["run_atr_grpo_qwen3_1.7b.sh"]
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
            config = compose(
                config_name="divclip_trainer",
                overrides=[
                    "+experiments=atr_grpo_qwen3_1.7b",
                    *overrides.split(),
                    f"trainer.experiment_name=atr_1.7b_{name}",
                ],
            )
            validate(config)
            _check_sweep_row(name, OmegaConf.to_container(config, resolve=True))


def test_sweep_bad_rows():
    proc = run_script("sweep_atr_baselines.sh", "--list", "--only", "atr,nope")
    assert proc.returncode == 2 and "unknown row 'nope'" in proc.stderr
    proc = run_script("sweep_atr_baselines.sh", "--list", env={"ATR_MODEL": "3b"})
    assert proc.returncode == 2 and "ATR_MODEL must be 1.7b or 8b" in proc.stderr


#: The trainer modes on a cluster (docs/experiments.md, "Trainer modes"): two 8-GPU training nodes, and for
#: separate_async a standalone rollout pool of one 8-GPU node with NCCL weight transfer.
ASYNC_ENV = {
    "colocate_async": {"MODE": "colocate_async", "NNODES": "2"},
    "separate_async": {"MODE": "separate_async", "NNODES": "2", "ROLLOUT_GPUS_PER_NODE": "8"},
}
ERC_7B_SCRIPTS = sorted(path.name for path in LAUNCH.glob("run_*_7b.sh"))  # the paper's rows and those beyond it


def check_mode(config: dict[str, Any], mode: str) -> None:
    """The resolved config runs ``mode`` on the cluster's layout."""
    v1, rollout = config["trainer"]["v1"], config["actor_rollout_ref"]["rollout"]
    assert v1["trainer_mode"] == mode and config["trainer"]["nnodes"] == 2 and config["trainer"]["n_gpus_per_node"] == 8
    assert rollout["calculate_log_probs"] is True  # the staleness figures and rollout correction need mu
    if mode == "separate_async":
        assert (rollout["nnodes"], rollout["n_gpus_per_node"], rollout["checkpoint_engine"]["backend"]) == (
            1,
            8,
            "nccl",
        )
        sync_step = v1["separate_async"]["parameter_sync_step"]
        assert (
            config["data"]["train_batch_size"]
            == sync_step * config["actor_rollout_ref"]["actor"]["ppo_mini_batch_size"]
        )


def test_erc_7b_scripts_validate_in_each_async_mode(printer: str) -> None:
    """Every ERC 7B script, with MODE set as a cluster user sets it, composed and validated as its dry run does
    (:func:`script_config`; a real dry run of the same script: :func:`dry_runs`' ``env``)."""
    assert {s for s in ERC_SCRIPTS if s.endswith("_7b.sh")} < set(ERC_7B_SCRIPTS)  # the paper's 7B rows, and more
    for script in ERC_7B_SCRIPTS:
        for mode, env in ASYNC_ENV.items():
            config = script_config(printer, script, "--dry-run", env=env)
            check_mode(config, mode)
            if script == "run_erc_dapo_7b.sh":
                assert config["actor_rollout_ref"]["actor"]["policy_loss"]["erc_beta_low"] == 0.05


@pytest.mark.parametrize(
    "env, message",
    [
        ({"NNODES": "two"}, "NNODES must be a positive integer"),
        ({"GPUS_PER_NODE": "0"}, "GPUS_PER_NODE must be a positive integer"),
        ({"MODEL_PATH": "/m/it's"}, "MODEL_PATH: a value with a single quote"),
        ({"STRATEGY": "fsdp 2"}, "STRATEGY must be a verl strategy name"),
        ({"MODE": "async"}, "MODE must be sync, colocate_async or separate_async, got 'async'"),
        (
            {"MODE": "separate_async"},
            "MODE=separate_async generates on a standalone rollout pool: set ROLLOUT_GPUS_PER_NODE",
        ),
        (
            {"MODE": "colocate_async", "ROLLOUT_GPUS_PER_NODE": "8"},
            "configure MODE=separate_async, not MODE=colocate_async",
        ),
        ({"ROLLOUT_GPUS_PER_NODE": "8"}, "configure MODE=separate_async; MODE is unset"),
        (
            {"MODE": "separate_async", "ROLLOUT_GPUS_PER_NODE": "8", "CKPT_ENGINE": "nc cl"},
            "CKPT_ENGINE must be a checkpoint engine name",
        ),
    ],
)
def test_bad_environment_is_a_clear_error(env, message):
    proc = run_script("run_dapo_7b.sh", "--dry-run", env=env)
    assert proc.returncode == 2 and message in proc.stderr and proc.stdout == ""


def test_every_experiment_config_has_its_script_and_doc_row():
    configs = {p.stem for p in (ROOT / "configs" / "experiments").glob("*.yaml")}
    scripts = {
        p.name[len("run_") : -len(".sh")]
        for p in LAUNCH.glob("run_*.sh")
        if not p.name.startswith(("run_smoke_cpu", "run_sft_"))
    }  # SFT: test_sft_scripts_and_configs
    assert configs == scripts
    doc = (ROOT / "docs" / "experiments.md").read_text()
    for name in scripts:
        assert f"launch/run_{name}.sh" in doc, name
    for name in SWEEP:
        assert f"`{name}`" in doc, name


# ---------------------------------------------------------------- ERC: paper-text vs released-script profile (issue 10)

RELEASED = {  # key path in the resolved YAML -> the released ERC scripts' value (recipe/dapo/*erc*.sh)
    "algorithm.filter_groups.enable": True,  # dynamic sampling ...
    "algorithm.filter_groups.metric": "acc",  # ... on the accuracy
    "algorithm.filter_groups.max_inflight_gen_batches": 2,  # 2 x 128 = 256 prompts in flight ...
    "algorithm.filter_groups.max_num_gen_batches": 0,  # (verl v1 ignores it; validation refuses > 0)
    "data.train_batch_size": 128,  # ... to fill 128 groups
    "actor_rollout_ref.actor.policy_loss.dual_clip_c": 10.0,
    "actor_rollout_ref.actor.clip_ratio_c": 10.0,
    "actor_rollout_ref.actor.policy_loss.correct_nll_coef": 0.1,
    "actor_rollout_ref.actor.policy_loss.correct_nll_norm": "micro_batch",
    "actor_rollout_ref.actor.policy_loss.correct_reward": 1.0,
    "actor_rollout_ref.actor.optim.weight_decay": 0.1,
    "actor_rollout_ref.actor.optim.lr_warmup_steps": 10,
    "actor_rollout_ref.actor.optim.clip_grad": 1.0,
    "actor_rollout_ref.actor.grad_clip": 1.0,
    "data.max_prompt_length": 4096,
    "data.truncation": "left",
    "data.filter_overlong_prompts": False,
    "actor_rollout_ref.rollout.val_kwargs.n": 32,
    "actor_rollout_ref.rollout.val_kwargs.temperature": 0.6,
    "actor_rollout_ref.rollout.val_kwargs.top_p": 0.95,
    "trainer.val_before_train": False,
    "trainer.test_freq": 10,
    "trainer.save_freq": 10,
    "reward.custom_reward_function.reward_kwargs": {
        "think": "required",
        "correct_score": 1.0,
        "wrong_score": -1.0,
        "unparseable_score": -1.0,
        "truncated_score": -0.5,
    },
    "divclip.profile": "released",
}
PAPER_TEXT = {  # the same keys in the default (paper-text) profile
    "algorithm.filter_groups.enable": False,
    "actor_rollout_ref.actor.policy_loss.dual_clip_c": None,
    "actor_rollout_ref.actor.policy_loss.correct_nll_coef": 0.0,
    "actor_rollout_ref.actor.policy_loss.correct_nll_norm": "global",
    "actor_rollout_ref.actor.optim.weight_decay": 0.01,
    "actor_rollout_ref.actor.optim.lr_warmup_steps": -1,
    "data.max_prompt_length": 2048,
    "data.truncation": "error",
    "data.filter_overlong_prompts": True,
    "trainer.val_before_train": True,
    "trainer.test_freq": 25,
    "trainer.save_freq": 25,
    "reward.custom_reward_function.reward_kwargs": {
        "think": "required",
        "correct_score": 1.0,
        "wrong_score": 0.0,
        "unparseable_score": 0.0,
        "truncated_score": -0.5,
    },
    "divclip.profile": "paper",
}


def _at(config: Any, dotted: str) -> Any:
    for key in dotted.split("."):
        config = config[key]
    return config


@pytest.fixture(scope="module")
def released_dry_runs(printer: str) -> dict[str, dict[str, Any]]:
    """`bash launch/<script> --dry-run +profile=released` for every ERC script (:func:`script_config`)."""
    return {script: script_config(printer, script, "+profile=released", "--dry-run") for script in sorted(ERC_SCRIPTS)}


@pytest.mark.parametrize("script", sorted(ERC_SCRIPTS))
def test_erc_released_profile(released_dry_runs, script):
    config = released_dry_runs[script]
    for key, value in RELEASED.items():
        assert _at(config, key) == value, key
    # what the profile leaves alone: the row's model and clip rule, the shared backbone
    model, mode, eps_low, eps_high, erc = ERC_SCRIPTS[script]
    actor, rollout = _actor(config), config["actor_rollout_ref"]["rollout"]
    assert config["actor_rollout_ref"]["model"]["path"] == f"deepseek-ai/{model}"
    assert actor["policy_loss"]["loss_mode"] == mode and (actor["clip_ratio_low"], actor["clip_ratio_high"]) == (
        eps_low,
        eps_high,
    )
    assert (actor["policy_loss"]["erc_beta_low"] == 0.05) is erc
    assert actor["ppo_mini_batch_size"] == 16 and rollout["n"] == 8 and actor["optim"]["lr"] == 1e-6
    assert config["trainer"]["experiment_name"] == script[len("run_") : -len(".sh")]
    # the released scripts validate on AIME24/AIME25 with 32 samples of up to 32k tokens, training at 16k
    assert [Path(f).name for f in config["data"]["val_files"]] == ["aime24.parquet", "aime25.parquet"]
    assert config["data"]["max_response_length"] == 16384 and rollout["response_length"] == 16384
    assert rollout["custom"]["validation"] == {
        "response_length": None,
        "benchmarks": {
            "aime24": {"response_length": 32768, "n": 32},
            "aime25": {"response_length": 32768, "n": 32},
            "hmmt25": None,
            "amc23": None,
            "math500": None,
            "olympiadbench": None,
        },
    }  # null: not validated
    assert rollout["prompt_length"] == 4096 and rollout["max_model_len"] == 131072  # 4k + 32k fits


@pytest.mark.parametrize("script", sorted(ERC_SCRIPTS))
def test_erc_paper_text_profile_is_the_default(dry_runs, script):
    config = _config(dry_runs, script)
    for key, value in PAPER_TEXT.items():
        assert _at(config, key) == value, key


def test_unknown_profile_is_a_clear_error_and_writes_nothing(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "kept.txt").write_text("earlier run")
    proc = run_script("run_erc_gppo_7b.sh", "--dry-run", "+profile=relased", env={"CKPT_DIR": str(ckpt)})
    assert proc.returncode == 2 and proc.stdout == ""
    assert "+profile=relased: no configs/profile/relased.yaml; profiles: released" in proc.stderr
    assert [p.name for p in ckpt.iterdir()] == ["kept.txt"] and (ckpt / "kept.txt").read_text() == "earlier run"


def test_profile_validation_names_the_key():
    """Without the launcher: Hydra names the missing option, recipe.main's validation the rest."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import MissingConfigException

    from recipe.config_checks import ConfigError
    from recipe.main import CONFIG_DIR, validate

    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        with pytest.raises(MissingConfigException, match=r"profile/nope"):
            compose(config_name="divclip_trainer", overrides=["+experiments=erc_dapo_7b", "+profile=nope"])
        atr = compose(
            config_name="divclip_trainer", overrides=["+experiments=atr_grpo_qwen3_1.7b", "+profile=released"]
        )
        with pytest.raises(ConfigError) as refused:
            validate(atr)
        assert str(refused.value) == (
            "+profile=released (configs/profile/released.yaml) is for the ERC experiments "
            "(configs/experiments/base/erc.yaml), but this config has divclip.paper=None"
        )
        forged = compose(
            config_name="divclip_trainer", overrides=["+experiments=erc_dapo_7b", "divclip.profile=released2"]
        )
        with pytest.raises(ConfigError) as refused:
            validate(forged)
        assert str(refused.value) == (
            "divclip.profile='released2' is not a profile; known: ['paper', 'released'] (select one with "
            "+profile=<name>, which also applies its settings)"
        )
        ignored = compose(
            config_name="divclip_trainer",
            overrides=[
                "+experiments=erc_dapo_7b",
                "+profile=released",
                "algorithm.filter_groups.max_num_gen_batches=1",
            ],
        )
        with pytest.raises(ConfigError, match=r"algorithm.filter_groups.max_num_gen_batches is ignored"):
            validate(ignored)
        validate(compose(config_name="divclip_trainer", overrides=["+experiments=erc_gppo_7b", "+profile=released"]))


# ------------------------------------------------------------------ issue 10, ATR half (items 1, 3, 6)

# one 80 GB GPU: tokens per micro-batch, parameter offload, vLLM's share of the GPU
ATR_ONE_GPU = {"run_atr_grpo_qwen3_1.7b.sh": (16384, False, 0.5), "run_atr_grpo_qwen3_8b.sh": (8192, True, 0.5)}


@pytest.mark.parametrize("script", sorted(ATR_SCRIPTS))
def test_atr_one_gpu_memory_and_seed(dry_runs, script):
    config = _config(dry_runs, script)
    actor, rollout = _actor(config), config["actor_rollout_ref"]["rollout"]
    tokens, offload, vllm_share = ATR_ONE_GPU[script]
    assert actor["ppo_max_token_len_per_gpu"] == tokens and actor["use_dynamic_bsz"] is True
    assert actor["fsdp_config"]["param_offload"] is offload
    assert rollout["gpu_memory_utilization"] == vllm_share and rollout["tensor_model_parallel_size"] == 1
    assert config["actor_rollout_ref"]["model"]["enable_gradient_checkpointing"] is True
    # one seed drives data order, the LoRA init and vLLM sampling
    assert config["data"]["seed"] == actor["fsdp_config"]["seed"] == rollout["seed"] == 42


@pytest.mark.parametrize("script", sorted(ATR_SCRIPTS))
def test_atr_reward_is_one_or_zero(dry_runs, script):
    """ATR section 6.1: +1 for a correct final answer, 0 otherwise (tests/test_reward_scores.py scores rows)."""
    kwargs = _config(dry_runs, script)["reward"]["custom_reward_function"]["reward_kwargs"]
    assert kwargs == {
        "think": "auto",
        "correct_score": 1.0,
        "wrong_score": 0.0,
        "unparseable_score": 0.0,
        "truncated_score": 0.0,
    }


def test_atr_gpus_per_node_is_the_one_scaling_knob(printer: str):
    """GPUS_PER_NODE=D spreads the paper's 32-completion optimizer step over D GPUs; the step is unchanged."""
    config = script_config(printer, "run_atr_grpo_qwen3_1.7b.sh", "--dry-run", env={"GPUS_PER_NODE": "8"})
    actor = _actor(config)
    assert config["trainer"]["n_gpus_per_node"] == 8
    assert config["data"]["train_batch_size"] == 4 and actor["ppo_mini_batch_size"] == 4 and actor["ppo_epochs"] == 2


def test_sweep_seeds(printer: str):
    """--seeds runs every row once per seed, each named <row>_seed<S> with data.seed=S (each run's command line
    composed as :func:`script_config` composes it; the sweep's real dry run: :func:`dry_runs`)."""
    env = {"SWEEP_JOBS": "2", "PYTHON": printer}
    proc = run_script("sweep_atr_baselines.sh", "--dry-run", "--only", "atr", "--seeds", "1,2", env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _, *labelled = re.split(r"--- # (\S+)\n", proc.stdout)  # each run's printed command line follows its label
    configs = {name: composed(printed) for name, printed in zip(labelled[::2], labelled[1::2], strict=True)}
    assert list(configs) == ["atr_seed1", "atr_seed2"]
    for seed in (1, 2):
        config = configs[f"atr_seed{seed}"]
        assert config["trainer"]["experiment_name"] == f"atr_1.7b_atr_seed{seed}"
        assert config["data"]["seed"] == seed and config["actor_rollout_ref"]["rollout"]["seed"] == seed
        assert _actor(config)["fsdp_config"]["seed"] == seed
        _check_sweep_row("atr", {**config, "trainer": {**config["trainer"], "experiment_name": "atr_1.7b_atr"}})


@pytest.mark.parametrize(
    "seeds, message", [("1,x", "'x' is not a non-negative integer"), ("1,1", "seed 1 given twice")]
)
def test_sweep_bad_seeds(seeds, message):
    proc = run_script("sweep_atr_baselines.sh", "--list", "--seeds", seeds)
    assert proc.returncode == 2 and message in proc.stderr


# ------------------------------------------------------------------ issue 10, ATR half (item 2: SFT stage)

SFT_SCRIPTS = {
    "run_sft_openmath_qwen3_1.7b.sh": ("Qwen/Qwen3-1.7B", 16384, False),
    "run_sft_openmath_qwen3_8b.sh": ("Qwen/Qwen3-8B", 8192, True),
}


@pytest.fixture(scope="module")
def sft_dry_runs() -> dict[str, subprocess.CompletedProcess]:
    jobs = {script: (script, ("--dry-run",), None) for script in SFT_SCRIPTS}
    jobs["env"] = ("run_sft_openmath_qwen3_1.7b.sh", ("--dry-run", "optim.lr=2e-5"),
                   {"MODEL_PATH": "/m/qwen3 1.7b", "TRAIN_FILES": "/d/sft.parquet", "MERGED_DIR": "/out/merged",
                    "CKPT_DIR": "/ckpt/sft", "GPUS_PER_NODE": "2"})  # fmt: skip
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {key: pool.submit(run_script, script, *args, env=env) for key, (script, args, env) in jobs.items()}
        return {key: future.result() for key, future in futures.items()}


@pytest.mark.parametrize("script", sorted(SFT_SCRIPTS))
def test_sft_rows(sft_dry_runs, script):
    """ATR Appendix B: SFT on OpenMathReasoning before RL, LoRA r32/a64, one GPU, rows of <= 2,048 tokens
    in the RL prompt format, merged into the folder the ATR script starts from."""
    base, tokens, offload = SFT_SCRIPTS[script]
    config = _load(sft_dry_runs[script])
    model, data, trainer = config["model"], config["data"], config["trainer"]
    assert model["path"] == base
    assert (model["lora_rank"], model["lora_alpha"], model["target_modules"]) == (32, 64, "all-linear")
    assert (trainer["nnodes"], trainer["n_gpus_per_node"]) == (1, 1)
    assert data["train_files"].endswith("/openmathreasoning_sft.parquet")
    assert data["max_length"] == 2048 and data["truncation"] == "error"
    assert data["apply_chat_template_kwargs"] == {"enable_thinking": False}
    assert data["custom_cls"] == {"path": "recipe/sft_dataset.py", "name": "RLPromptSFTDataset"}
    assert data["max_token_len_per_gpu"] == tokens and config["engine"]["param_offload"] is offload
    # the merged model is where the matching ATR config starts
    name = script[len("run_sft_") : -len(".sh")]
    atr = "run_atr_grpo_qwen3_" + name.rsplit("_", 1)[1] + ".sh"
    assert config["divclip"]["merged_dir"] == ATR_SCRIPTS[atr]
    assert (
        trainer["experiment_name"] == f"sft_{name}"
        and trainer["default_local_dir"] == f"checkpoints/divclip-sft/sft_{name}"
    )


def test_sft_environment_overrides(sft_dry_runs):
    config = _load(sft_dry_runs["env"])
    assert config["model"]["path"] == "/m/qwen3 1.7b" and config["data"]["train_files"] == "/d/sft.parquet"
    assert config["divclip"]["merged_dir"] == "/out/merged" and config["trainer"]["default_local_dir"] == "/ckpt/sft"
    assert config["trainer"]["n_gpus_per_node"] == 2 and config["optim"]["lr"] == 2e-5


def test_sft_scripts_and_configs():
    configs = {p.stem for p in (ROOT / "configs" / "sft").glob("*.yaml")}
    scripts = {p.name[len("run_sft_") : -len(".sh")] for p in LAUNCH.glob("run_sft_*.sh")}
    assert configs == scripts == {"openmath_qwen3_1.7b", "openmath_qwen3_8b"}
    doc = (ROOT / "docs" / "experiments.md").read_text()
    for name in scripts:
        assert f"launch/run_sft_{name}.sh" in doc, name


def test_sft_bad_config_is_a_clear_error():
    proc = run_script("run_sft_openmath_qwen3_1.7b.sh", "--dry-run", "data.max_length=0")
    assert proc.returncode == 2 and "data.max_length must be a positive integer" in proc.stderr and proc.stdout == ""
    proc = run_script("run_sft_openmath_qwen3_1.7b.sh", "--dry-run", env={"GPUS_PER_NODE": "x"})
    assert proc.returncode == 2 and "GPUS_PER_NODE must be a positive integer" in proc.stderr


def test_vllm_venv_setup_refuses_a_full_disk_before_installing(tmp_path: Path) -> None:
    """launch/setup_vllm_venv.sh checks free space before pip: a disk with less than a build's peak is refused
    up front, naming the folder and the numbers, instead of pip's "[Errno 28] No space left on device" minutes
    in. A `df` shim on PATH reports 8191 MB (one under the need) for the TMPDIR folder and plenty elsewhere."""
    root = tmp_path / "repo"
    (root / "launch").mkdir(parents=True)
    (root / "launch" / "setup_vllm_venv.sh").write_text((LAUNCH / "setup_vllm_venv.sh").read_text())
    (root / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    shims = tmp_path / "bin"
    shims.mkdir()
    (shims / "df").write_text(
        "#!/usr/bin/env bash\n"
        f'case "${{@: -1}}" in {scratch}*) free=8191 ;; *) free=999999 ;; esac\n'
        'printf "Filesystem 1M-blocks Used Available Capacity Mounted on\\nfake 999999 0 %s 0%% /\\n" "$free"\n'
    )
    (shims / "df").chmod(0o755)
    env = {**os.environ, "PATH": f"{shims}:{os.environ['PATH']}", "TMPDIR": str(scratch)}
    done = subprocess.run(
        ["bash", str(root / "launch" / "setup_vllm_venv.sh")], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 1, done.stderr
    assert done.stderr.strip() == (
        f"setup_vllm_venv.sh: building {root}/.venv-vllm needs 8192 MB free on the disk of {scratch}; it has 8191 MB"
    )
    venv = root / ".venv-vllm"
    assert not (venv / "divclip-vllm-constraints.txt").exists() and not (venv / ".divclip-vllm-installed").exists()
    assert not list((venv / "lib").glob("python3*/site-packages/torch"))
