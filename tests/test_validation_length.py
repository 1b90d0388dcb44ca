"""Per-benchmark validation lengths (recipe/validation/length.py) without Ray: the plan a config
resolves to, every refusal before Ray starts (each naming its key), the per-row columns the
validation batches get and the length metrics. The run itself -- verl's trainer with the hf_cpu
rollout validating two benchmarks at 12 x 1 and 16 x 3 while training at 4 tokens -- is
tests/test_smoke_cpu.py (erc_run); the ERC scripts' resolved values are tests/test_launch.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hydra import compose, initialize_config_dir

from recipe.config_checks import ConfigError
from recipe.main import CONFIG_DIR, validate
from recipe.validation.length import (
    LENGTH_COLUMN,
    ROLLOUT_N_COLUMN,
    VALIDATION_AGENT_LOOP,
    BenchmarkValidation,
    PerBenchmarkValidationLoader,
    ValidationLengthProbe,
    ValidationPlan,
)

KEY = "actor_rollout_ref.rollout.custom.validation"
ERC = "+experiments=erc_dapo_7b"


@pytest.fixture(scope="module")
def hydra_configs() -> Iterator[None]:
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        yield


def _compose(*overrides: str) -> Any:
    return compose(config_name="divclip_trainer", overrides=list(overrides))


def test_nothing_set_is_verls_validation(hydra_configs: None) -> None:
    config = _compose()
    assert ValidationPlan.from_config(config) is None
    atr = _compose("+experiments=atr_grpo_qwen3_1.7b")  # the ATR runs keep one setting
    assert ValidationPlan.from_config(atr) is None


def test_erc_plan_is_the_papers_section_4_1(hydra_configs: None) -> None:
    plan = ValidationPlan.from_config(_compose(ERC))
    assert plan is not None
    assert plan.benchmarks == {
        "aime24": BenchmarkValidation(32768, 32),
        "aime25": BenchmarkValidation(32768, 32),
        "hmmt25": BenchmarkValidation(16384, 32),
        "amc23": BenchmarkValidation(16384, 32),
        "math500": BenchmarkValidation(16384, 4),
        "olympiadbench": BenchmarkValidation(16384, 4),
    }
    assert plan.default == BenchmarkValidation(16384, 32)  # a set outside the map: training length, val_kwargs.n
    assert plan.max_response_length == 32768
    released = ValidationPlan.from_config(_compose(ERC, "+profile=released"))
    assert released is not None and released.benchmarks == {
        "aime24": BenchmarkValidation(32768, 32),
        "aime25": BenchmarkValidation(32768, 32),
    }


def test_fields_left_out_take_the_defaults(hydra_configs: None) -> None:
    config = _compose(
        f"{KEY}.response_length=1000",
        f"+{KEY}.benchmarks.a.n=3",
        f"+{KEY}.benchmarks.b.response_length=7",
        "actor_rollout_ref.rollout.val_kwargs.n=2",
    )
    plan = ValidationPlan.from_config(config)
    assert plan == ValidationPlan(
        BenchmarkValidation(1000, 2), {"a": BenchmarkValidation(1000, 3), "b": BenchmarkValidation(7, 2)}
    )
    assert plan.settings("a").n == 3 and plan.settings("elsewhere") == BenchmarkValidation(1000, 2)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["trainer.use_v1=false"], r"need verl's v1 trainer.*trainer.use_v1=true"),
        (
            ["actor_rollout_ref.rollout.multi_turn.enable=true"],
            r"actor_rollout_ref.rollout.multi_turn.enable=true is not supported",
        ),
        (
            ["actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent"],
            r"actor_rollout_ref.rollout.agent.default_agent_loop='tool_agent' is not supported",
        ),
        (
            ["+actor_rollout_ref.rollout.agent.agent_loop_manager_class=my.pkg.Manager"],
            r"actor_rollout_ref.rollout.agent.agent_loop_manager_class='my.pkg.Manager' cannot be combined",
        ),
        (["actor_rollout_ref.rollout.name=trtllm"], r"actor_rollout_ref.rollout.name='trtllm' is not supported"),
        # 2,048-token prompts + 32k AIME responses = 34,816 tokens
        (
            ["actor_rollout_ref.rollout.max_model_len=34815"],
            r"max_model_len=34815 is smaller than actor_rollout_ref.rollout.prompt_length \(2048\) \+ "
            r"actor_rollout_ref.rollout.custom.validation.benchmarks.aime24.response_length \(32768\) = 34816",
        ),
        (
            ["actor_rollout_ref.rollout.max_model_len=34816", "actor_rollout_ref.rollout.name=sglang"],
            r"\+ 1 \(SGLang\) = 34817",
        ),
        (
            [f"{KEY}.response_length=40000", "actor_rollout_ref.rollout.max_model_len=40000"],
            r"actor_rollout_ref.rollout.custom.validation.response_length \(40000\) = 42048",
        ),
        (
            ["actor_rollout_ref.rollout.max_model_len=null"],
            r"max_model_len is null and the context length of "
            r"actor_rollout_ref.model.path='deepseek-ai/DeepSeek-R1-Distill-Qwen-7B' cannot be read here",
        ),
        ([f"{KEY}.response_length=0"], rf"{KEY}.response_length must be a positive integer, got 0"),
        ([f"{KEY}.response_length=-5"], rf"{KEY}.response_length must be a positive integer, got -5"),
        ([f"{KEY}.response_length=true"], rf"{KEY}.response_length must be a positive integer or null, got True"),
        ([f"{KEY}.benchmarks.math500.n=0"], rf"{KEY}.benchmarks.math500.n must be a positive integer, got 0"),
        (
            [f"{KEY}.benchmarks.aime24.response_length=-1"],
            rf"{KEY}.benchmarks.aime24.response_length must be a positive",
        ),
        ([f"+{KEY}.benchmarks.math500.length=4"], rf"{KEY}.benchmarks.math500.length is not a benchmark setting"),
        ([f"+{KEY}.max_tokens=4"], rf"{KEY}.max_tokens is not a validation setting"),
        (
            [f"{KEY}.benchmarks.math500=4"],
            rf"{KEY}.benchmarks.math500 must be \{{response_length: int, n: int\}} or null",
        ),
    ],
)
def test_refused_before_ray_naming_the_key(hydra_configs: None, overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        validate(_compose(ERC, *overrides))


def test_the_erc_configs_validate(hydra_configs: None) -> None:
    validate(_compose(ERC))
    validate(_compose(ERC, "+profile=released"))
    validate(_compose(ERC, "actor_rollout_ref.rollout.max_model_len=34816"))  # exactly prompt + 32k


def _val_file(path: Path, sources: list[str], **columns: list[Any]) -> str:
    pq.write_table(pa.table({"data_source": sources, "prompt": ["p"] * len(sources), **columns}), path)
    return str(path)


def test_a_benchmark_no_validation_file_holds_is_refused(hydra_configs: None, tmp_path: Path) -> None:
    aime = _val_file(tmp_path / "aime.parquet", ["aime24", "aime25"])
    math = _val_file(tmp_path / "math.parquet", ["math500"] * 3)
    files = f"data.val_files=[{aime},{math}]"
    with pytest.raises(
        ConfigError,
        match=rf"{KEY}.benchmarks.amc23: no validation file holds data_source 'amc23' "
        r"\(data.val_files hold \['aime24', 'aime25', 'math500'\]\); remove the entry or set it to null",
    ):
        validate(_compose(ERC, files))
    validate(
        _compose(
            ERC,
            files,
            f"{KEY}.benchmarks.amc23=null",
            f"{KEY}.benchmarks.hmmt25=null",
            f"{KEY}.benchmarks.olympiadbench=null",
        )
    )
    tools = _val_file(tmp_path / "tools.parquet", ["aime24"], agent_name=["tool_agent"])
    with pytest.raises(ConfigError, match=r"data.val_files: .*tools.parquet has an agent_name column"):
        validate(_compose(ERC, f"data.val_files=[{tools}]"))


def test_validation_batches_get_their_rows_settings() -> None:
    plan = ValidationPlan(BenchmarkValidation(12, 1), {"long": BenchmarkValidation(16, 3)})
    batch = {
        "raw_prompt": np.array([[1], [2], [3]], dtype=object),
        "data_source": np.array(["echo", "long", "echo"], dtype=object),
    }
    loader = PerBenchmarkValidationLoader([batch], plan)
    [annotated] = list(loader)
    assert len(loader) == 1
    assert annotated[ROLLOUT_N_COLUMN].tolist() == [1, 3, 1] and annotated[ROLLOUT_N_COLUMN].dtype == object
    assert annotated[LENGTH_COLUMN].tolist() == [12, 16, 12]
    assert annotated["agent_name"].tolist() == [VALIDATION_AGENT_LOOP] * 3
    unlabelled = PerBenchmarkValidationLoader([], plan).annotate({"raw_prompt": np.array([[1]], dtype=object)})
    assert unlabelled[ROLLOUT_N_COLUMN].tolist() == [1]  # verl labels such rows "unknown": the default


def test_length_metrics() -> None:
    plan = ValidationPlan(BenchmarkValidation(12, 1), {"long": BenchmarkValidation(16, 3)})
    probe = ValidationLengthProbe(SimpleNamespace(partition="kept"))
    assert probe.partition == "kept"  # everything but sample() is the replay buffer's
    probe.lengths["echo"] += [12, 6]
    probe.lengths["long"] += [16, 16, 16, 3]
    assert probe.metrics(plan) == {
        "val-aux/echo/response_length/mean": 9.0,
        "val-aux/echo/response_length/max": 12.0,
        "val-aux/echo/response_length/min": 6.0,
        "val-aux/echo/response_length/clip_ratio": 0.5,
        "val-aux/echo/response_length/limit": 12.0,
        "val-aux/long/response_length/mean": 12.75,
        "val-aux/long/response_length/max": 16.0,
        "val-aux/long/response_length/min": 3.0,
        "val-aux/long/response_length/clip_ratio": 0.75,
        "val-aux/long/response_length/limit": 16.0,
    }
