"""The GPU acceptance's targets and report: each figure against verl's baseline in the same run, the targets
judged on them, the Markdown report and the exit code (:func:`verdict`). Imports nothing of the project.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Optional

GAUGE = "actor/divclip/onpolicy/"
EXIT_MET, EXIT_FAILED, EXIT_BAD_OPTIONS, EXIT_UNMEASURED = 0, 1, 2, 3
"""The exit codes (:mod:`recipe.bench.acceptance`'s ``--help`` epilog says when each is returned)."""


@dataclass(frozen=True)
class Target:
    name: str
    variant: str  #: a loss of ``recipe.bench.acceptance_runs.LOSSES``, or "aligned" (the packing run)
    figure: str  #: a key of that variant's ratios
    limit: float
    at_least: bool = False  #: the figure must be >= limit (else <= limit)


TARGETS = (
    Target("vocabulary pass (ERC): loss-phase peak", "divclip_erc_vocab_pass", "loss_peak_vs_no_entropy", 0.50),
    Target("vocabulary pass (ERC): update time", "divclip_erc_vocab_pass", "update_time_vs_no_entropy", 1.05),
    Target(
        "vocabulary pass (ERC): longest micro-batch",
        "divclip_erc_vocab_pass",
        "longest_vs_no_entropy",
        1.5,
        at_least=True,
    ),
    Target("ERC on the logits: loss-phase peak", "divclip_erc", "loss_peak_vs_no_entropy", 1.00),
    Target("ERC on the logits: update time", "divclip_erc", "update_time_vs_no_entropy", 1.05),
    Target("kl_full on the logits: loss-phase peak", "divclip_kl_full", "loss_peak_vs_no_entropy", 1.05),
    Target("kl_full through the pass: loss-phase peak", "divclip_kl_full_vocab_pass", "loss_peak_vs_no_entropy", 1.05),
    Target("pack_old_log_prob_as_update: old-log-prob pass time", "aligned", "old_time_vs_own", 1.05),
    Target("pack_old_log_prob_as_update: old-log-prob pass peak", "aligned", "old_peak_vs_own", 1.00),
)


def _ratio(value: Optional[float], base: Optional[float]) -> Optional[float]:
    return None if value is None or not base else round(value / base, 3)


def _longest_ratio(candidate: Optional[dict[str, Any]], base: Optional[dict[str, Any]]) -> tuple[Optional[float], str]:
    """The longest micro-batch against the baseline's, or None and why: the baseline's search must have
    resolved, the candidate's too unless its lower bound already meets the target."""
    if candidate is None or base is None:
        return None, "not searched (--search-losses)"
    if "error" in candidate or "error" in base:
        return None, f"the search failed: {candidate.get('error') or base.get('error')}"
    if "broken" in candidate or "broken" in base:
        return None, candidate.get("broken") or base["broken"]
    if base["stopped"] != "resolved" or not base["tokens"]:
        return None, f"the baseline's search stopped on its {base['stopped']} bound at {base['tokens']} tokens"
    value = round(candidate["tokens"] / base["tokens"], 3)
    limit = next(target.limit for target in TARGETS if target.figure == "longest_vs_no_entropy")
    if candidate["stopped"] != "resolved" and value < limit:
        return None, f"a lower bound ({value:.3f}x): the search stopped on its {candidate['stopped']} bound"
    return value, ""


def ratios(losses: dict[str, Any], packing: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each variant's figures against its baseline in the same run (no_entropy; verl's packing); a figure
    that is None has its reason under ``why``."""
    base = losses["no_entropy"]
    out: dict[str, dict[str, Any]] = {}
    for name, f in losses.items():
        rounds = [_ratio(t, b) for t, b in zip(f["update_seconds"], base["update_seconds"], strict=False)]
        longest, why = _longest_ratio(f.get("longest"), base.get("longest"))
        out[name] = {
            "update_time_vs_no_entropy": _ratio(f["update_seconds_median"], base["update_seconds_median"]),
            "update_time_vs_no_entropy_per_round": rounds,
            "loss_peak_vs_no_entropy": _ratio(f["loss_peak_bytes"], base["loss_peak_bytes"]),
            "optimizer_peak_vs_no_entropy": _ratio(f["optimizer_peak_bytes"], base["optimizer_peak_bytes"]),
            "update_peak_vs_no_entropy": _ratio(f["update_peak_bytes"], base["update_peak_bytes"]),
            "old_time_vs_no_entropy": _ratio(f["old_seconds"], base["old_seconds"]),
            "old_peak_vs_no_entropy": _ratio(f["old_peak_bytes"], base["old_peak_bytes"]),
            "longest_vs_no_entropy": longest,
            "why": {"longest_vs_no_entropy": why} if longest is None else {},
        }
    own, aligned = packing["own"], packing["aligned"]
    out["aligned"] = {
        "old_time_vs_own": _ratio(aligned["old_seconds_median"], own["old_seconds_median"]),
        "old_peak_vs_own": _ratio(aligned["old_peak_bytes"], own["old_peak_bytes"]),
        "why": {},
    }
    return out


def judge(strategy_ratios: Optional[dict[str, dict[str, Any]]], why_unmeasured: str) -> list[dict[str, Any]]:
    """Each target of :data:`TARGETS` with its figure and status (``pass``, ``fail`` or ``unmeasured``,
    then with ``why``: ``why_unmeasured``, or the figure's own reason from :func:`ratios`); a time
    target also carries the per-round ratios' min and max (``spread``)."""
    rows = []
    for target in TARGETS:
        variant = None if strategy_ratios is None else strategy_ratios.get(target.variant, {})
        figure = None if variant is None else variant.get(target.figure)
        met = figure is not None and (figure >= target.limit if target.at_least else figure <= target.limit)
        status = "unmeasured" if figure is None else ("pass" if met else "fail")
        row = {**asdict(target), "value": figure, "status": status}
        if status == "unmeasured":
            row["why"] = (variant or {}).get("why", {}).get(target.figure) or why_unmeasured
        per_round = [r for r in (variant or {}).get(f"{target.figure}_per_round", []) if r is not None]
        if per_round:
            row["spread"] = [min(per_round), max(per_round)]
        rows.append(row)
    return rows


def _gib(n: Optional[int]) -> str:
    return "-" if n is None else f"{n / 2**30:.3f}" if abs(n) >= 2**26 else f"{n / 2**20:.1f} MiB"


def markdown(report: dict[str, Any]) -> str:
    lines = [
        f"# GPU acceptance ({report['date']}, {report['device_name']})",
        "",
        f"`{report['command']}`: {report['shape']}; {report['timing']}; wall time {report['wall_seconds']:.0f} s.",
        "",
        f"MFU against {report['peak_flops']}.",
        "",
    ]
    for strategy, rows in report["targets"].items():
        lines += [f"## {strategy}", "", "| target | figure | limit | status |", "| --- | --- | --- | --- |"]
        for row in rows:
            value = "-" if row["value"] is None else f"{row['value']:.3f}x"
            if "spread" in row:
                value += f" (rounds {row['spread'][0]:.3f}-{row['spread'][1]:.3f}x)"
            status = row["status"] + (f" ({row['why']})" if "why" in row else "")
            bound = ">=" if row["at_least"] else "<="
            lines.append(f"| {row['name']} | {value} | {bound} {row['limit']:.2f}x | {status} |")
        losses = report["figures"].get(strategy, {}).get("losses", {})
        if losses:
            lines += [
                "",
                "| loss | update s: median [min-max] | held GiB | loss-phase peak GiB | optimizer-step peak GiB "
                "| update peak GiB | TFLOP/s | MFU | longest micro-batch (tokens) |",
                "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
            ]
            for name, f in losses.items():
                longest = f.get("longest")
                reach = (
                    "-"
                    if longest is None
                    else longest.get("error")
                    or longest.get("broken")
                    or (
                        f"{longest['tokens']} ({longest['stopped']}"
                        + (f", fails at {longest['fails_at_tokens']}" if longest["fails_at_tokens"] else "")
                        + ")"
                    )
                )
                mfu = "-" if f["mfu"] is None else f"{100 * f['mfu']:.1f} %"
                lines.append(
                    f"| {name} | {f['update_seconds_median']:.3f} [{f['update_seconds_min']:.3f}-"
                    f"{f['update_seconds_max']:.3f}] | {_gib(f['held_bytes'])} | {_gib(f['loss_peak_bytes'])} "
                    f"| {_gib(f['optimizer_peak_bytes'])} | {_gib(f['update_peak_bytes'])} "
                    f"| {f['update_flops_per_second'] / 1e12:.3g} | {mfu} | {reach} |"
                )
        gauge = report["on_policy"].get(strategy, {})
        if gauge:
            lines += [
                "",
                "| on-policy (first update) | holds | max \\|log w\\| | ratio clip | ERC masked | tensor cores |",
                "| --- | --- | --- | --- | --- | --- |",
            ]
            for name, g in gauge.items():
                first = g.get("first_update", {})
                pick = lambda key, first=first: "-" if key not in first else f"{max(first[key]):.3g}"  # noqa: E731
                lines.append(
                    f"| {name} | {g['holds']} | {pick(GAUGE + 'log_ratio_abs_max')} | {pick(GAUGE + 'ratio_clipfrac')} "
                    f"| {pick(GAUGE + 'erc_masked_frac')} | {g.get('tensor_cores', '-')} |"
                )
            own = gauge.get("divclip_erc_dynamic (own)")
            if own is not None:
                lines += [
                    "",
                    f"verl's own packing (responses of {report['packing_lengths'].get(strategy, '?')}): "
                    + (
                        "**shows its noise**: the first update is not exactly on-policy."
                        if own["holds"] is False
                        else "shows **no** noise here: the first update is exactly on-policy."
                    ),
                ]
        lines.append("")
    return "\n".join(lines)


@dataclass(frozen=True)
class Verdict:
    """What an acceptance report amounts to: its exit code, every missed target, failed run and broken
    on-policy check (``failed``), and every target without a figure (``unmeasured``)."""

    exit_code: int
    failed: list[str] = field(default_factory=list)
    unmeasured: list[str] = field(default_factory=list)
    allow_unmeasured: bool = False

    def summary(self) -> str:
        """One paragraph naming what the exit code stands for, every target behind it included."""
        lines = [
            f"exit code {self.exit_code}: "
            + {
                EXIT_MET: "every target met" + (" that was measured" if self.unmeasured else ""),
                EXIT_FAILED: "failed",
                EXIT_UNMEASURED: "targets unmeasured (--allow-unmeasured accepts them)",
            }[self.exit_code]
        ]
        lines += [f"  failed: {item}" for item in self.failed]
        lines += [f"  unmeasured{' (allowed)' if self.allow_unmeasured else ''}: {item}" for item in self.unmeasured]
        return "\n".join(lines)


def verdict(report: dict[str, Any], allow_unmeasured: bool = False) -> Verdict:
    """The verdict on an acceptance report (as written to ``acceptance.json``): :data:`EXIT_FAILED` if a target
    was missed, a run failed or an on-policy check broke (the ``(own)`` packing arm's gauge is a finding, not a
    check); else :data:`EXIT_UNMEASURED` if a target has no figure and not ``allow_unmeasured``; else
    :data:`EXIT_MET`.
    """
    failed = [f"run {run}: {why}" for run, why in report["errors"].items()]
    unmeasured: list[str] = []
    for strategy, rows in report["targets"].items():
        for row in rows:
            if row["status"] == "fail":
                failed.append(
                    f"{strategy}: {row['name']} ({row['value']:.3f}x {'<' if row.get('at_least') else '>'} "
                    f"{row['limit']:.2f}x)"
                )
            elif row["status"] == "unmeasured":
                unmeasured.append(f"{strategy}: {row['name']} ({row.get('why') or 'no figure'})")
    failed += [
        f"on-policy check: {strategy}/{name}"
        for strategy, gauges in report["on_policy"].items()
        for name, gauge in gauges.items()
        if gauge["holds"] is False and "(own)" not in name
    ]
    code = EXIT_FAILED if failed else EXIT_UNMEASURED if unmeasured and not allow_unmeasured else EXIT_MET
    return Verdict(code, failed, unmeasured, allow_unmeasured)
