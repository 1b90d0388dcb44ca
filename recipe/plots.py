"""Figures from training logs: ``python -m recipe.plots {curves,clipfrac,scatter,kl3} ...``.

``curves`` (ATR Figure 2) and ``clipfrac`` read verl's file logger, ``scatter`` (ERC Figure 3) the dump of
:mod:`verl_ext.token_dump`, ``kl3`` (ATR Figure 1) needs no input; PNG through matplotlib's Agg (docs/evaluation.md).
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from recipe.eval.readers import iter_jsonl  # noqa: E402
from verl_ext.token_dump import DUMP_KEYS  # noqa: E402

#: Training-curve panels: (metric key verl logs, panel title).
CURVE_PANELS = (
    ("critic/rewards/mean", "reward (mean)"),
    ("actor/entropy", "entropy"),
    ("response_length/mean", "response length (tokens)"),
)
#: ``val-core/<data_source>/<variable>/mean@<k>``: the accuracy verl logs per validation set.
VAL_MEAN = re.compile(r"^val-core/(?P<source>.+)/(?P<var>[^/]+)/mean@(?P<k>\d+)$")

#: Clip-fraction series: (metric key, legend label, panel index).
CLIPFRAC_SERIES = (
    ("actor/divclip/clipfrac_upper", "ratio clip, upper (w > 1)", 0),
    ("actor/divclip/clipfrac_lower", "ratio clip, lower (w < 1)", 0),
    ("actor/pg_clipfrac", "actor/pg_clipfrac (total)", 0),
    ("actor/divclip/erc/clipfrac_upper", "ERC, upper (rho >= 1 + beta_high)", 1),
    ("actor/divclip/erc/clipfrac_lower", "ERC, lower (rho <= 1 - beta_low)", 1),
)

Series = tuple[list[int], list[float]]


# -- reading -----------------------------------------------------------------------------


def read_file_logger(path: str | os.PathLike[str]) -> dict[int, dict[str, float]]:
    """step -> metrics from a verl file-logger JSONL; lines of one step are merged.

    A later line overrides an earlier value of the same key and step (verl never logs a key
    twice per step). Non-numeric values (verl logs none, but wandb-style tables could) and
    ``null`` (NaN) are dropped. A malformed line is an error naming the file and line.
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"log {str(path)!r} does not exist")
    steps: dict[int, dict[str, float]] = {}
    for lineno, row in iter_jsonl(path):
        if not isinstance(row.get("data"), dict) or "step" not in row:
            raise ValueError(f"{path} line {lineno}: expected verl's file-logger row {{'step': int, 'data': {{...}}}}")
        step = row["step"]
        if isinstance(step, bool) or not isinstance(step, int):
            raise ValueError(f"{path} line {lineno}: 'step' must be an integer, got {step!r}")
        metrics = steps.setdefault(step, {})
        for key, value in row["data"].items():
            if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
                metrics[key] = float(value)
    if not steps:
        raise ValueError(f"{path}: no logged steps")
    return steps


def series(log: dict[int, dict[str, float]], key: str) -> Series:
    """(steps, values) of one metric, in step order, over the steps that logged it."""
    points = sorted((step, metrics[key]) for step, metrics in log.items() if key in metrics)
    return [p[0] for p in points], [p[1] for p in points]


def moving_average(values: Sequence[float], window: int) -> list[float]:
    """Trailing mean over the last ``window`` points (fewer at the start); window 1 is identity."""
    if window < 1:
        raise ValueError(f"--smooth must be >= 1, got {window}")
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def read_token_dump(paths: Sequence[str | os.PathLike[str]]) -> list[dict[str, Any]]:
    """Rows of :mod:`verl_ext.token_dump` files (``{rank}`` files can be passed together)."""
    rows: list[dict[str, Any]] = []
    for path in map(Path, paths):
        if not path.is_file():
            raise ValueError(f"token dump {str(path)!r} does not exist")
        for lineno, row in iter_jsonl(path):
            bad = [k for k in DUMP_KEYS if k not in row]
            if bad:
                raise ValueError(f"{path} line {lineno}: missing key(s) {bad} of a token-dump row")
            rows.append(row)
    if not rows:
        raise ValueError(f"token dump(s) {[str(p) for p in paths]} hold no rows")
    return rows


# -- figures -----------------------------------------------------------------------------


def _read_logs(
    logs: Sequence[str | os.PathLike[str]], labels: str | None, smooth: int
) -> tuple[list[str], list[dict[int, dict[str, float]]]]:
    """The runs' names (``labels``, else the file stems) and logs, after checking ``smooth``."""
    names = [Path(p).stem for p in logs] if labels is None else [s.strip() for s in labels.split(",")]
    if len(names) != len(logs):
        raise ValueError(f"--labels has {len(names)} names for {len(logs)} logs")
    moving_average([], smooth)  # validates smooth
    return names, [read_file_logger(p) for p in logs]


def _plot_series(ax: Any, steps: list[int], values: list[float], label: str, color: Any, smooth: int) -> None:
    if smooth > 1:
        ax.plot(steps, values, color=color, alpha=0.25, linewidth=0.8)
        ax.plot(steps, moving_average(values, smooth), color=color, label=label, linewidth=1.6)
    else:
        ax.plot(steps, values, color=color, label=label, linewidth=1.4)


def plot_curves(
    logs: Sequence[str | os.PathLike[str]], out: str | os.PathLike[str], smooth: int = 1, labels: str | None = None
) -> Path:
    """ATR Figure 2 style: reward, entropy, response length and validation mean@k per run.

    The validation panel shows per run the mean over its sets of ``val-core/<set>/<acc|reward>/mean@k`` (each set
    when a single run is plotted); a run without validation is noted in the panel.
    """
    names, loaded = _read_logs(logs, labels, smooth)
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for (key, title), ax in zip(CURVE_PANELS, axes.flat, strict=False):
        for i, (path, name, log) in enumerate(zip(logs, names, loaded, strict=False)):
            steps, values = series(log, key)
            if not steps:
                raise ValueError(f"{path}: no '{key}' logged (is this a verl training log?)")
            _plot_series(ax, steps, values, name, colors[i % len(colors)], smooth)
        ax.set_title(title)
    val_ax = axes.flat[3]
    drew = False
    for i, (name, log) in enumerate(zip(names, loaded, strict=False)):
        by_source: dict[str, Series] = {}
        for key in sorted({k for metrics in log.values() for k in metrics}):
            match = VAL_MEAN.match(key)
            if match:
                by_source[f"{match['source']} mean@{match['k']}"] = series(log, key)
        if not by_source:
            continue
        drew = True
        if len(loaded) == 1:
            for j, (source, (steps, values)) in enumerate(by_source.items()):
                val_ax.plot(steps, values, marker="o", markersize=3, color=colors[j % len(colors)], label=source)
        else:
            common = sorted(set.intersection(*(set(s) for s, _ in by_source.values())))
            lookup = [dict(zip(s, v, strict=False)) for s, v in by_source.values()]
            avg = [sum(d[step] for d in lookup) / len(lookup) for step in common]
            val_ax.plot(
                common,
                avg,
                marker="o",
                markersize=3,
                color=colors[i % len(colors)],
                label=f"{name} (avg of {len(lookup)} sets)",
            )
    if not drew:
        val_ax.text(0.5, 0.5, "no val-core/*/mean@k logged", ha="center", va="center", transform=val_ax.transAxes)
    val_ax.set_title("validation accuracy (mean@k)")
    for ax in axes.flat:
        ax.set_xlabel("training step")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle("training curves" + (f" (moving average over {smooth} steps)" if smooth > 1 else ""))
    return _save(fig, out)


def plot_clipfrac(
    logs: Sequence[str | os.PathLike[str]], out: str | os.PathLike[str], smooth: int = 1, labels: str | None = None
) -> Path:
    """Clip fractions per step: ratio clipping (left) and ERC entropy-ratio clipping (right); a log
    without any clip-fraction metric is an error naming the keys looked for."""
    names, loaded = _read_logs(logs, labels, smooth)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    styles = ["-", "--", ":", "-."]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for r, (path, name, log) in enumerate(zip(logs, names, loaded, strict=False)):
        found = 0
        for s, (key, label, panel) in enumerate(CLIPFRAC_SERIES):
            steps, values = series(log, key)
            if not steps:
                continue
            found += 1
            full = label if len(loaded) == 1 else f"{name}: {label}"
            _plot_series(axes[panel], steps, values, full, colors[s % len(colors)], smooth)
            axes[panel].lines[-1].set_linestyle(styles[r % len(styles)])
        if not found:
            raise ValueError(f"{path}: none of {[k for k, _, _ in CLIPFRAC_SERIES]} is logged")
    titles = ("ratio clipping (fraction of response tokens)", "ERC entropy-ratio clipping")
    for ax, title in zip(axes, titles, strict=False):
        ax.set_title(title)
        ax.set_xlabel("training step")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, "not logged (ERC off?)", ha="center", va="center", transform=ax.transAxes)
    return _save(fig, out)


def plot_scatter(
    dumps: Sequence[str | os.PathLike[str]],
    out: str | os.PathLike[str],
    step: int | None = None,
    beta_low: float | None = None,
    beta_high: float | None = None,
) -> Path:
    """ERC Figure 3: probability of the sampled token (old policy) vs entropy ratio.

    Clipped tokens are red and drawn on top; with ``beta_low``/``beta_high`` the band edges
    1 - beta_low and 1 + beta_high are drawn. ``step`` keeps one dumped step only.
    """
    rows = read_token_dump(dumps)
    if step is not None:
        rows = [r for r in rows if r["step"] == step]
        if not rows:
            raise ValueError(f"no token-dump rows at step {step}")
    kept = [r for r in rows if not r["clipped"]]
    clipped = [r for r in rows if r["clipped"]]
    fig, ax = plt.subplots(figsize=(6.5, 5))
    ax.scatter([r["prob"] for r in kept], [r["entropy_ratio"] for r in kept], s=6, alpha=0.45, color="tab:blue",
               label=f"kept ({len(kept)})", linewidths=0)  # fmt: skip
    ax.scatter([r["prob"] for r in clipped], [r["entropy_ratio"] for r in clipped], s=8, alpha=0.8, color="tab:red",
               label=f"clipped ({len(clipped)})", linewidths=0)  # fmt: skip
    for edge, name in ((None if beta_low is None else 1.0 - beta_low, "1 - beta_low"),
                       (None if beta_high is None else 1.0 + beta_high, "1 + beta_high")):  # fmt: skip
        if edge is not None:
            ax.axhline(edge, color="gray", linestyle="--", linewidth=1)
            ax.annotate(name, (1.0, edge), xycoords=("axes fraction", "data"), ha="right", va="bottom", fontsize=8)
    ax.axhline(1.0, color="black", linewidth=0.6)
    ax.set_xlabel("probability of the sampled token under pi_old")
    ax.set_ylabel("entropy ratio H(pi_theta) / H(pi_old)")
    steps = sorted({r["step"] for r in rows})
    ax.set_title(f"ERC: token probability vs entropy ratio (steps {steps[0]}–{steps[-1]})" if len(steps) > 1
                 else f"ERC: token probability vs entropy ratio (step {steps[0]})")  # fmt: skip
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return _save(fig, out)


def plot_kl3(out: str | os.PathLike[str], delta: float = 0.07, eps: float = 0.2) -> Path:
    """ATR Figure 1: KL3(w) = w - 1 - log w with the Lambert-W trust region and PPO's clip.

    The KL3 region [l, u] (shaded) is wider above 1 than below, unlike the symmetric
    [1 - eps, 1 + eps] (dashed); the curve's value at the clip edges shows the divergence
    PPO's clip actually allows on each side.
    """
    from verl_ext.core.divergences import kl3_ratio_bounds

    if not (math.isfinite(eps) and 0.0 < eps < 1.0):
        raise ValueError(f"--eps must lie in (0, 1), got {eps}")
    lower, upper = kl3_ratio_bounds(delta)  # validates delta
    hi = max(upper, 1.0 + eps) * 1.25
    lo = max(min(lower, 1.0 - eps) * 0.6, 1e-3)
    grid = [lo + (hi - lo) * i / 599 for i in range(600)]
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    ax.plot(grid, [w - 1.0 - math.log(w) for w in grid], color="black", label="KL3 = w - 1 - log w")
    ax.axhline(delta, color="tab:blue", linestyle=":", linewidth=1, label=f"delta = {delta:g}")
    ax.axvspan(lower, upper, color="tab:blue", alpha=0.15, label=f"KL3 region [{lower:.3f}, {upper:.3f}] (Lambert W)")
    for w in (lower, upper):
        ax.axvline(w, color="tab:blue", linewidth=1.2)
    for w in (1.0 - eps, 1.0 + eps):
        ax.axvline(w, color="tab:red", linestyle="--", linewidth=1.2)
    ax.plot([], [], color="tab:red", linestyle="--", label=f"symmetric clip [{1 - eps:g}, {1 + eps:g}]")
    kl3_at_clip = max(w - 1.0 - math.log(w) for w in (1.0 - eps, 1.0 + eps))
    ax.set_ylim(0.0, max(3.0 * delta, 1.5 * kl3_at_clip))
    ax.set_xlim(lo, hi)
    ax.set_xlabel("importance ratio w = pi_theta / pi_old")
    ax.set_ylabel("per-token KL3")
    ax.set_title("KL3 trust region vs PPO clip")
    ax.legend(fontsize=8, loc="upper center")
    ax.grid(alpha=0.3)
    return _save(fig, out)


def _save(fig: Any, out: str | os.PathLike[str]) -> Path:
    path = Path(out)
    if path.suffix.lower() != ".png":
        raise ValueError(f"--out {str(path)!r}: figures are written as PNG; use a .png name")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# -- CLI ---------------------------------------------------------------------------------


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m recipe.plots", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (("curves", "reward, entropy, length, validation mean@k"), ("clipfrac", "clip fractions")):
        p = sub.add_parser(name, help=help_text)
        p.add_argument("logs", nargs="+", help="verl file-logger JSONL, one per run")
        p.add_argument("--out", required=True, help="PNG path")
        p.add_argument("--smooth", type=int, default=1, help="trailing moving-average window (1 = raw)")
        p.add_argument("--labels", help="comma list of run names (default: file stems)")
    sc = sub.add_parser("scatter", help="ERC Figure 3 from verl_ext.token_dump files")
    sc.add_argument("dumps", nargs="+")
    sc.add_argument("--out", required=True)
    sc.add_argument("--step", type=int, help="only this dumped step")
    sc.add_argument("--beta-low", type=float, help="draw the band edge 1 - beta_low")
    sc.add_argument("--beta-high", type=float, help="draw the band edge 1 + beta_high")
    kl = sub.add_parser("kl3", help="ATR Figure 1: KL3 vs ratio with Lambert-W bounds")
    kl.add_argument("--out", required=True)
    kl.add_argument("--delta", type=float, default=0.07, help="KL3 budget delta (default 0.07)")
    kl.add_argument("--eps", type=float, default=0.2, help="symmetric clip epsilon for comparison")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry; returns 0, or 2 with the reason on stderr for bad input."""
    args = _build_parser().parse_args(argv)
    try:
        if args.command == "curves":
            path = plot_curves(args.logs, args.out, args.smooth, args.labels)
        elif args.command == "clipfrac":
            path = plot_clipfrac(args.logs, args.out, args.smooth, args.labels)
        elif args.command == "scatter":
            path = plot_scatter(args.dumps, args.out, args.step, args.beta_low, args.beta_high)
        else:
            path = plot_kl3(args.out, args.delta, args.eps)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
