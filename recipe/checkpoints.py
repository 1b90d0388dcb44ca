"""Only complete checkpoints in ``trainer.default_local_dir``: what a crash mid-save leaves is set aside.

Every ``global_step_N`` newer than verl's ``latest_checkpointed_iteration.txt`` moves to
``incomplete/global_step_N.<time>`` before verl's resume; nothing is deleted (docs/experiments.md, "When a node or
rank dies").
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import time
from pathlib import Path
from typing import Optional

logger = logging.getLogger(__name__)

TRACKER = "latest_checkpointed_iteration.txt"
STEP_FOLDER = re.compile(r"^global_step_(\d+)$")
INCOMPLETE = "incomplete"


def tracked_step(checkpoint_dir: Path) -> Optional[int]:
    """The step verl's tracker names (the last complete checkpoint), or None without a readable tracker."""
    try:
        return int((checkpoint_dir / TRACKER).read_text().strip())
    except (FileNotFoundError, ValueError):
        return None


def step_folders(checkpoint_dir: Path) -> dict[int, Path]:
    """``global_step_N`` folders of ``checkpoint_dir`` by N."""
    if not checkpoint_dir.is_dir():
        return {}
    found = (STEP_FOLDER.match(p.name) for p in checkpoint_dir.iterdir() if p.is_dir())
    return {int(m.group(1)): checkpoint_dir / m.group(0) for m in found if m}


def set_aside_incomplete_checkpoints(checkpoint_dir: str | os.PathLike[str]) -> list[Path]:
    """Move the step folders newer than the tracker (none complete: the tracker is written last) into
    ``incomplete/``; returns where each went. Without a tracker nothing is moved: verl then trains from
    scratch, and with ``checkpoint.async_save`` the tracker is written later, by verl's callback."""
    directory = Path(checkpoint_dir)
    latest = tracked_step(directory)
    if latest is None:
        return []
    moved = []
    for step, folder in sorted(step_folders(directory).items()):
        if step <= latest:
            continue
        target = directory / INCOMPLETE / f"{folder.name}.{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        target.parent.mkdir(exist_ok=True)
        shutil.move(str(folder), str(target))
        logger.warning(
            "checkpoint %s was written after the last complete one (tracker: %s): set aside as %s",
            folder,
            latest,
            target,
        )
        moved.append(target)
    return moved
