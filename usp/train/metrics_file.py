"""``metrics.jsonl`` as a file: strict JSON records (:func:`json_safe`) and the rewrite of a resumed run
(:func:`drop_records_after`)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from usp.atomic import write_text


def json_safe(record: dict[str, Any]) -> dict[str, Any]:
    """``record`` with NaN / inf floats replaced by ``None``, so ``json.dumps(..., allow_nan=False)`` holds."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}


def drop_records_after(path: str | os.PathLike, step: int) -> int:
    """Rewrite ``metrics.jsonl`` at ``path`` without records of steps after ``step`` (and without a torn last
    line), atomically (temp file + rename). Returns the number of lines dropped; a missing file is fine."""
    path = Path(path)
    if not path.is_file():
        return 0
    kept: list[str] = []
    dropped = 0
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line cut short by the crash
            dropped += 1
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] > step:
            dropped += 1
        else:
            kept.append(line)
    if dropped:
        write_text(path, "".join(line + "\n" for line in kept))
    return dropped
