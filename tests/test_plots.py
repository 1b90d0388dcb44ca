"""recipe.plots (every figure from fixture logs in verl's exact format) and verl_ext.token_dump."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from recipe import plots
from verl_ext.core.divergences import kl3_ratio_bounds
from verl_ext.token_dump import DUMP_KEYS, TokenDumpWriter

LOGS = Path(__file__).parent / "fixtures" / "plots_logs"
RUNS = [LOGS / "atr_kl3.jsonl", LOGS / "erc.jsonl"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 10_000, (path, len(data))


def test_fixture_logs_are_verl_file_logger_output(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Replaying the fixture through verl 0.9.1's FileLogger reproduces it byte for byte."""
    from verl.utils.tracking import FileLogger

    for source in RUNS:
        target = tmp_path / source.name
        monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(target))
        logger = FileLogger("divclip", source.stem)
        for line in source.read_text().splitlines():
            row = json.loads(line)
            logger.log(data=row["data"], step=row["step"])
        logger.finish()
        assert target.read_bytes() == source.read_bytes()


def test_read_file_logger_merges_steps_and_drops_null() -> None:
    log = plots.read_file_logger(LOGS / "erc.jsonl")
    assert sorted(log) == list(range(31))
    assert log[0]["val-core/aime24/acc/mean@4"] == pytest.approx(0.2211)  # step 0: validation only
    assert "actor/ppo_kl" not in log[5]  # NaN is written as null by orjson
    assert "critic/rewards/mean" in log[10] and "val-core/math500/acc/mean@4" in log[10]
    steps, values = plots.series(log, "val-core/aime24/acc/mean@4")
    assert steps == [0, 10, 20, 30] and len(values) == 4


def test_moving_average() -> None:
    assert plots.moving_average([1.0, 2.0, 3.0, 4.0], 2) == [1.0, 1.5, 2.5, 3.5]
    assert plots.moving_average([1.0, 5.0], 1) == [1.0, 5.0]
    with pytest.raises(ValueError, match="--smooth"):
        plots.moving_average([1.0], 0)


def test_curves_png(tmp_path: Path) -> None:
    assert plots.main(["curves", *map(str, RUNS), "--out", str(tmp_path / "c.png"), "--smooth", "5"]) == 0
    _assert_png(tmp_path / "c.png")
    assert plots.main(["curves", str(RUNS[1]), "--out", str(tmp_path / "one.png")]) == 0
    _assert_png(tmp_path / "one.png")


def test_clipfrac_png(tmp_path: Path) -> None:
    assert plots.main(["clipfrac", *map(str, RUNS), "--out", str(tmp_path / "f.png"), "--labels", "KL3,ERC"]) == 0
    _assert_png(tmp_path / "f.png")


def test_kl3_png_and_bounds_drawn(tmp_path: Path) -> None:
    path = plots.plot_kl3(tmp_path / "k.png", delta=0.07, eps=0.2)
    _assert_png(path)
    low, high = kl3_ratio_bounds(0.07)
    assert 1 - low < high - 1  # the skew the figure shows
    assert plots.main(["kl3", "--out", str(tmp_path / "x.png"), "--delta", "-1"]) == 2


def test_scatter_png_from_token_dump_writer(tmp_path: Path) -> None:
    writer = TokenDumpWriter(tmp_path / "tokens_{rank}.jsonl", every_n_steps=1, max_tokens_per_step=400)
    gen = torch.Generator().manual_seed(0)
    for step in (1, 2):
        old_log_prob = -torch.rand(8, 64, generator=gen) * 4
        ratio = 1 + 0.3 * torch.randn(8, 64, generator=gen)
        clipped = (ratio > 1.2) | (ratio < 0.8)
        writer.maybe_dump(step, old_log_prob, ratio, clipped, torch.ones(8, 64))
    dump = tmp_path / "tokens_0.jsonl"
    assert len(dump.read_text().splitlines()) == 800
    out = tmp_path / "s.png"
    assert plots.main(["scatter", str(dump), "--out", str(out), "--beta-low", "0.2", "--beta-high", "0.2"]) == 0
    _assert_png(out)
    assert plots.main(["scatter", str(dump), "--out", str(tmp_path / "s2.png"), "--step", "2"]) == 0
    assert plots.main(["scatter", str(dump), "--out", str(tmp_path / "s3.png"), "--step", "7"]) == 2


def test_plot_input_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"step": 1, "data": {"critic/rewards/mean": 0.1}}\n{"step": 2}\n')
    assert plots.main(["curves", str(bad), "--out", str(tmp_path / "a.png")]) == 2
    assert "bad.jsonl line 2: expected verl's file-logger row" in capsys.readouterr().err
    only_reward = tmp_path / "r.jsonl"
    only_reward.write_text('{"step": 1, "data": {"critic/rewards/mean": 0.1}}\n')
    assert plots.main(["curves", str(only_reward), "--out", str(tmp_path / "a.png")]) == 2
    assert "no 'actor/entropy' logged" in capsys.readouterr().err
    assert plots.main(["clipfrac", str(only_reward), "--out", str(tmp_path / "a.png")]) == 2
    assert "none of ['actor/divclip/clipfrac_upper'" in capsys.readouterr().err
    assert plots.main(["kl3", "--out", str(tmp_path / "a.pdf")]) == 2
    assert "use a .png name" in capsys.readouterr().err
    assert plots.main(["curves", str(RUNS[0]), "--out", str(tmp_path / "a.png"), "--labels", "a,b"]) == 2


# ---------------------------------------------------------------- token dump writer


def test_token_dump_rate_limits_and_format(tmp_path: Path) -> None:
    path = tmp_path / "dump.jsonl"
    writer = TokenDumpWriter(path, every_n_steps=5, max_tokens_per_step=6)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    old = torch.log(torch.tensor([[0.5, 0.25, 1.0, 0.9], [0.1, 0.2, 0.3, 0.4]]))
    rho = torch.tensor([[1.0, 1.5, 0.5, 9.0], [1.1, 0.7, 9.0, 9.0]])
    clip = rho > 1.2
    assert writer.maybe_dump(3, old, rho, clip, mask) == 0  # not a dump step
    assert not path.exists()
    assert writer.maybe_dump(5, old, rho, clip, mask) == 5  # all 5 valid tokens, in order
    assert writer.maybe_dump(5, old, rho, clip, mask) == 1  # the step's budget of 6 is shared
    assert writer.maybe_dump(5, old, rho, clip, mask) == 0
    assert not writer.wants(5) and writer.wants(10) and not writer.wants(11)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 6 and all(tuple(r) == DUMP_KEYS for r in rows)
    assert [(r["prob"], r["entropy_ratio"], r["clipped"]) for r in rows[:5]] == [
        pytest.approx((0.5, 1.0, False)),
        pytest.approx((0.25, 1.5, True)),
        pytest.approx((1.0, 0.5, False)),
        pytest.approx((0.1, 1.1, False)),
        pytest.approx((0.2, 0.7, False)),
    ]
    assert {r["step"] for r in rows} == {5}


def test_token_dump_samples_deterministically_and_skips_nonfinite(tmp_path: Path) -> None:
    old = -torch.rand(4, 100, generator=torch.Generator().manual_seed(1))
    rho = torch.ones(4, 100)
    rho[0, :50] = float("nan")
    mask = torch.ones(4, 100, dtype=torch.bool)
    outputs = []
    for name in ("a", "b"):
        writer = TokenDumpWriter(tmp_path / f"{name}.jsonl", every_n_steps=1, max_tokens_per_step=100)
        written = writer.maybe_dump(0, old, rho, rho > 2, mask)
        assert written + writer.skipped_nonfinite == 100 and writer.skipped_nonfinite > 0
        outputs.append((tmp_path / f"{name}.jsonl").read_text())
    assert outputs[0] == outputs[1]  # same seed and step: same tokens


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"every_n_steps": 0, "max_tokens_per_step": 1}, "every_n_steps"),
        ({"every_n_steps": 1, "max_tokens_per_step": 0}, "max_tokens_per_step"),
        ({"every_n_steps": 1.5, "max_tokens_per_step": 1}, "every_n_steps"),
    ],
)
def test_token_dump_config_errors(tmp_path: Path, kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        TokenDumpWriter(tmp_path / "x.jsonl", **kwargs)


def test_token_dump_shape_mismatch(tmp_path: Path) -> None:
    writer = TokenDumpWriter(tmp_path / "x.jsonl", every_n_steps=1, max_tokens_per_step=4)
    with pytest.raises(ValueError, match="share one shape"):
        writer.maybe_dump(0, torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 4))
