"""Only complete checkpoints stay where a resume looks (:mod:`recipe.checkpoints`), and the data trace
records each step's prompts (:mod:`recipe.data_trace`); the two-node crash test (test_two_nodes_ray.py)
runs both for real."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from recipe.checkpoints import INCOMPLETE, TRACKER, set_aside_incomplete_checkpoints, step_folders, tracked_step
from recipe.data_trace import DataTrace, prompt_id
from tests.helpers import read_trace


def make_step(
    ckpt: Path, step: int, files: tuple[str, ...] = ("actor/model_world_size_2_rank_0.pt", "data.pt")
) -> Path:
    folder = ckpt / f"global_step_{step}"
    for name in files:
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(b"x")
    return folder


def test_folders_after_the_tracker_are_set_aside_and_nothing_is_deleted(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    for step in (1, 2):
        make_step(ckpt, step)
    half_written = make_step(ckpt, 3, files=("actor/model_world_size_2_rank_0.pt",))  # a node died mid-save
    (ckpt / TRACKER).write_text("2")
    moved = set_aside_incomplete_checkpoints(ckpt)
    assert sorted(step_folders(ckpt)) == [1, 2] and tracked_step(ckpt) == 2
    assert len(moved) == 1 and moved[0].parent == ckpt / INCOMPLETE and moved[0].name.startswith("global_step_3.")
    assert (moved[0] / "actor" / "model_world_size_2_rank_0.pt").read_bytes() == b"x" and not half_written.exists()
    assert set_aside_incomplete_checkpoints(ckpt) == []  # idempotent


def test_without_a_tracker_nothing_is_moved(tmp_path: Path) -> None:
    """No tracker: verl trains from scratch (and an async save writes its tracker later), so no folder is
    judged."""
    ckpt = tmp_path / "ckpt"
    make_step(ckpt, 1, files=("actor/model_world_size_2_rank_0.pt",))
    assert tracked_step(ckpt) is None
    assert set_aside_incomplete_checkpoints(ckpt) == [] and sorted(step_folders(ckpt)) == [1]
    assert set_aside_incomplete_checkpoints(tmp_path / "never_written") == []


def test_the_trace_records_each_steps_prompts_once(tmp_path: Path) -> None:
    path = str(tmp_path / "trace.jsonl")
    trace = DataTrace(path)
    trace.fetched(1, ["u1", "u2"], [7, 3], [[{"role": "user", "content": "a"}], [{"role": "user", "content": "b"}]])
    padding = {"is_padding": True}  # verl's samples that make a batch divisible: no prompt, not counted
    trace.trained(1, ["u1_0_0", "u1_1_0", "u2_0_0", "u2_1_0", "pad9f_0_0", "pad9f_1_0"], [{}] * 4 + [padding] * 2)
    trace.fetched(2, ["u3"], [7], [[{"role": "user", "content": "a"}]])  # the same prompt fetched again
    trace.trained(2, ["u3_0_0"], [{}])
    lines = read_trace(path)
    assert [line["step"] for line in lines] == [1, 2] and lines[0]["samples"] == 4
    a, b = prompt_id(7, [{"role": "user", "content": "a"}]), prompt_id(3, [{"role": "user", "content": "b"}])
    assert lines[0]["prompts"] == sorted([a, b]) and lines[1]["prompts"] == [a]
    assert len({line["attempt"] for line in lines}) == 1
    assert [line["prompts"] for line in read_trace(path, "fetched")] == [[a, b], [a]]  # in fetch order
    resumed = DataTrace(path)  # another attempt takes a group back from TransferQueue
    resumed.restored(3, ["u4"], [3], [[{"role": "user", "content": "b"}]], ["running"])
    resumed.trained(3, ["u4_0_0"], [{}])
    (restored,) = read_trace(path, "restored")
    assert restored["prompts"] == [b] and restored["step"] == 3 and restored["attempt"] == resumed.attempt
    assert restored["status"] == ["running"]
    with pytest.raises(KeyError, match="never fetched"):
        trace.trained(3, ["u9_0_0"], [{}])
    with pytest.raises(ValueError, match="divclip.data_trace='trace.jsonl' must be an absolute path"):
        DataTrace("trace.jsonl")
    assert json.loads((tmp_path / "trace.jsonl").read_text().splitlines()[0])["prompts"][1][0] == 3


def test_a_relative_trace_path_is_refused_before_ray() -> None:
    from hydra import compose, initialize_config_dir

    from recipe.config_checks import ConfigError, validate_divclip_config
    from recipe.main import CONFIG_DIR

    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        config = compose(config_name="divclip_trainer", overrides=["divclip.data_trace=out/trace.jsonl"])
    with pytest.raises(ConfigError) as error:
        validate_divclip_config(config)
    assert str(error.value) == (
        "divclip.data_trace='out/trace.jsonl' must be an absolute path (the trainer writes it on a Ray node)"
    )
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        absolute = compose(config_name="divclip_trainer", overrides=["divclip.data_trace=/tmp/run/trace.jsonl"])
        number = compose(config_name="divclip_trainer", overrides=["divclip.data_trace=5"])
    validate_divclip_config(absolute)  # the same file on every node: accepted
    with pytest.raises(ConfigError, match=r"divclip\.data_trace=5 must be an absolute path"):
        validate_divclip_config(number)
