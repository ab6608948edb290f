"""Reading a metrics.jsonl that a live job may be writing to."""

from __future__ import annotations

import json
from pathlib import Path


def complete_records(path: Path) -> list[dict]:
    """The records of every complete line of ``path`` (none if it does not exist yet).

    A writer appends one line at a time, but a reader may see the file between two writes of one line; the text after
    the last newline is therefore left for the next read, never parsed.
    """
    if not path.exists():
        return []
    lines = path.read_text().split("\n")[:-1]  # the last piece is "" or a line still being written
    return [json.loads(line) for line in lines if line.strip()]
