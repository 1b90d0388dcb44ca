"""Opt-in, rate-limited per-token dump for the ERC Figure 3 scatter (pi_old's probability against the entropy
ratio): verl's loggers take only scalars, so a seeded sample of a step's tokens goes to a JSONL file that
``python -m recipe.plots scatter`` reads. docs/evaluation.md has the format and the limits.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where rows are dumped: readers of the dump (the plots) need no torch
    import torch

__all__ = ["TokenDumpWriter", "DUMP_KEYS"]

#: Keys of every dumped row, in order.
DUMP_KEYS = ("step", "prob", "entropy_ratio", "clipped")


def _checked_int(where: str, name: str, value: object, minimum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or (minimum is not None and value < minimum):
        bound = "" if minimum is None else f" >= {minimum}"
        raise ValueError(f"{where}: {name} must be an integer{bound}, got {value!r}")
    return value


class TokenDumpWriter:
    """Append a bounded random sample of per-token (prob, entropy ratio, clipped) rows.

    Args:
        path: output JSONL file; ``{rank}`` is replaced by ``$RANK`` (default ``0``). Parent
            folders are created. Existing content is kept (rows are appended).
        every_n_steps: dump only on steps with ``step % every_n_steps == 0``.
        max_tokens_per_step: at most this many rows per dumped step, over all calls.
        seed: base seed of the token sampling (combined with the step).
    """

    def __init__(self, path: str | os.PathLike[str], every_n_steps: int, max_tokens_per_step: int, seed: int = 0):
        self.every_n_steps = _checked_int("TokenDumpWriter", "every_n_steps", every_n_steps, 1)
        self.max_tokens_per_step = _checked_int("TokenDumpWriter", "max_tokens_per_step", max_tokens_per_step, 1)
        self.seed = _checked_int("TokenDumpWriter", "seed", seed)
        raw = os.fspath(path)
        if not raw:
            raise ValueError("TokenDumpWriter: path is empty")
        self.path = Path(raw.replace("{rank}", os.environ.get("RANK", "0")))
        self.skipped_nonfinite = 0
        self._written_at_step: dict[int, int] = {}

    def wants(self, step: int) -> bool:
        """Whether ``step`` is a dump step with budget left (lets callers skip work early)."""
        return step % self.every_n_steps == 0 and self._written_at_step.get(step, 0) < self.max_tokens_per_step

    def maybe_dump(
        self,
        step: int,
        old_log_prob: torch.Tensor,
        entropy_ratio: torch.Tensor,
        clipped_mask: torch.Tensor,
        response_mask: torch.Tensor,
    ) -> int:
        """Write up to the step's remaining budget of the tokens where ``response_mask`` is true; returns the rows
        written. The four tensors share one shape (``(batch, response_length)``). Computes nothing off dump steps."""
        _checked_int("TokenDumpWriter.maybe_dump", "step", step, 0)
        if not self.wants(step):
            return 0
        shapes = {
            "old_log_prob": tuple(old_log_prob.shape),
            "entropy_ratio": tuple(entropy_ratio.shape),
            "clipped_mask": tuple(clipped_mask.shape),
            "response_mask": tuple(response_mask.shape),
        }
        if len(set(shapes.values())) != 1:
            raise ValueError(f"TokenDumpWriter.maybe_dump: tensors must share one shape, got {shapes}")

        import torch

        with torch.no_grad():
            valid = response_mask.detach().bool().reshape(-1)
            index = valid.nonzero().squeeze(1).cpu()
            budget = self.max_tokens_per_step - self._written_at_step.get(step, 0)
            if index.numel() > budget:
                generator = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
                pick = torch.randperm(index.numel(), generator=generator)[:budget]
                index = index[pick].sort().values
            probs = old_log_prob.detach().reshape(-1).cpu()[index].double().exp().tolist()
            ratios = entropy_ratio.detach().reshape(-1).cpu()[index].double().tolist()
            clipped = clipped_mask.detach().reshape(-1).cpu()[index].bool().tolist()

        lines = []
        for prob, ratio, clip in zip(probs, ratios, clipped, strict=False):
            if not (math.isfinite(prob) and math.isfinite(ratio)):
                self.skipped_nonfinite += 1
                continue
            lines.append(json.dumps({"step": step, "prob": prob, "entropy_ratio": ratio, "clipped": clip}))
        # the budget counts the tokens considered, non-finite ones included; older steps are forgotten
        self._written_at_step = {step: self._written_at_step.get(step, 0) + len(probs)}
        if lines:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a", encoding="utf-8") as handle:
                handle.write("\n".join(lines) + "\n")
        return len(lines)
