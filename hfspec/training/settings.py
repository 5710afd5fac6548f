"""The settings of a training run: checked on the way in, defaulted alike, and guarded when a run resumes.

A run lives in one ``out_dir`` and resumes when started again. Its settings are written
to ``train/settings.json``; a later run with different settings that shape the
checkpoint (architecture, schedule, seed) must not silently continue it.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from hfspec.errors import HfspecError

__all__ = ["CHECKPOINT", "check_settings", "default_eval_every", "require_positive"]

CHECKPOINT = "checkpoint.pt"  # the training checkpoint's file name inside train/


def require_positive(**values: int) -> None:
    """Refuse any of ``values`` below 1, naming it."""
    for name, value in values.items():
        if value < 1:
            raise HfspecError(f"{name} must be a positive integer, got {value}")


def default_eval_every(steps: int) -> int:
    """A tenth of the steps, at most 200: often enough to catch the best weights, rarely enough to cost little."""
    return max(1, min(200, steps // 10))


def check_settings(path: Path, s: Any, resume: bool, fixed: tuple[str, ...]) -> None:
    """Refuse to resume into a checkpoint made with different ``fixed`` settings (architecture, schedule).

    ``s`` is the run's settings dataclass, written to ``path`` as JSON. Without ``resume``
    the old checkpoint beside ``path`` is deleted, so training starts over (staged data is kept).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    current = json.loads(json.dumps(asdict(s)))  # as the saved file reads back (tuples become lists)
    if path.is_file() and resume:
        saved = json.loads(path.read_text())
        # init_from came later than the other settings: a file without it started fresh.
        changed = [k for k in fixed if saved.get(k, "" if k == "init_from" else None) != current[k]]
        if changed and (path.parent / CHECKPOINT).is_file():
            raise HfspecError(
                f"{path.parent} holds a checkpoint trained with different {', '.join(changed)}; "
                "use a new out_dir, or pass resume=False (--no-resume) to retrain from scratch"
            )
    elif not resume:
        (path.parent / CHECKPOINT).unlink(missing_ok=True)
    path.write_text(json.dumps(current, indent=2) + "\n")
