"""CSV files, plain-text tables, ``run.json``, and lengths such as ``16K``."""

from __future__ import annotations

import csv
import io
import json
import re
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from longnet.files import write_atomic

_LENGTH = re.compile(r"^\s*(\d+)\s*([kKmM]?)\s*$")


def parse_length(text: str, minimum: int = 1) -> int:
    """``"4096"`` -> 4096, ``"16K"``/``"16k"`` -> 16384, ``"1M"`` -> 1048576 (binary units);
    values below ``minimum`` are refused."""
    match = _LENGTH.match(str(text))
    if not match:
        raise ValueError(f"cannot read {text!r} as a length; write e.g. 2048, 16K or 1M.")
    value = int(match.group(1)) * {"": 1, "k": 1 << 10, "m": 1 << 20}[match.group(2).lower()]
    if value < minimum:
        raise ValueError(f"lengths must be at least {minimum}, got {text!r}.")
    return value


def powers_of_two(low: int, high: int) -> list[int]:
    """``low, 2 low, 4 low, ...`` up to ``high`` (``high`` appended when not a power step)."""
    if low < 1 or high < low:
        raise ValueError(f"need 1 <= low <= high, got low={low}, high={high}.")
    values = []
    value = low
    while value <= high:
        values.append(value)
        value *= 2
    if values[-1] != high:
        values.append(high)
    return values


def write_csv(rows: Sequence[Mapping[str, Any]], path: str | Path) -> Path:
    """Write dict rows (the first row's keys) with a header, whole or not at all
    (``longnet.files.write_atomic``)."""
    path = Path(path)
    if not rows:
        raise ValueError(f"no rows to write to {path}.")
    text = io.StringIO(newline="")
    writer = csv.DictWriter(text, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
    return write_atomic(path, text.getvalue())


def format_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str] | None = None) -> str:
    """A right-aligned plain-text table (floats with 4 decimals)."""
    if not rows:
        return "(no rows)"
    columns = list(columns or rows[0])
    cells = [[_cell(row[c]) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(v.rjust(w) for v, w in zip(r, widths)) for r in cells]
    return "\n".join(lines)


def write_run_info(path: str | Path, settings: Mapping[str, Any]) -> Path:
    """``settings`` plus the command line and the git commit, as JSON (written atomically)."""
    info = {"command": " ".join(sys.argv), "git_commit": _git_commit(), **settings}
    return write_atomic(path, json.dumps(info, indent=2, default=str) + "\n")


def _cell(value: Any) -> str:
    return f"{value:.4f}" if isinstance(value, float) else str(value)


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None
