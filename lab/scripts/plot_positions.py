"""Overlay the by-position curves of several ``longnet eval perplexity --by-position`` runs.

    python -m lab.scripts.plot_positions runs/a/positions.csv runs/b/positions.csv \\
        --out docs/long_context/plot.png [--rename OLD=NEW ...] [--skip LABEL ...] [--title TEXT]

Every (model, context length) of every ``positions.csv`` is one line, labelled as in the run
(``model @ context``, a model renamed by ``--rename``), except the labels ``--skip`` names
(e.g. ``"dilated + sinks @ 8,192"``); runs on the same documents and scored bytes compare
byte for byte.
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

from longnet.eval.plotting import plot_bits_by_position


def read_curves(paths: list[Path], rename: dict[str, str] | None = None
                ) -> dict[str, list[tuple[int, int, float]]]:
    """``label @ context -> [(start, end, bits_per_byte), ...]`` of every file, in order."""
    rename = rename or {}
    curves: dict[str, list[tuple[int, int, float]]] = {}
    for path in paths:
        if not path.is_file():
            raise SystemExit(f"{path}: no such file (a positions.csv of eval perplexity "
                             "--by-position)")
        for row in csv.DictReader(path.open()):
            model = rename.get(row["model"], row["model"])
            label = f"{model} @ {int(row['context_length']):,}"
            curves.setdefault(label, []).append(
                (int(row["start"]), int(row["end"]), float(row["bits_per_byte"])))
    return curves


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("positions", type=Path, nargs="+")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rename", nargs="+", default=[], metavar="OLD=NEW")
    parser.add_argument("--skip", nargs="+", default=[], metavar="LABEL",
                        help="curves to leave out, as labelled in the plot (model @ context)")
    parser.add_argument("--title", default="Bits per byte by position in the document")
    args = parser.parse_args(argv)
    if not all("=" in pair for pair in args.rename):
        parser.error("--rename takes OLD=NEW pairs")
    rename = dict(pair.split("=", 1) for pair in args.rename)
    curves = read_curves(args.positions, rename)
    unknown = sorted(set(args.skip) - set(curves))
    if unknown:
        parser.error(f"--skip {unknown}: no such curve; the curves are {sorted(curves)}")
    curves = {label: curve for label, curve in curves.items() if label not in args.skip}
    print(plot_bits_by_position(curves, args.out, title=args.title))


if __name__ == "__main__":
    main()
