"""A run's labelled passkey loss by whether its heads see the copy: which copies it learns.

    python -m lab.scripts.passkey_training_loss runs/smollm2-135m-1k-rate2-pilot [--span 100]
    python -m lab.scripts.passkey_training_loss --config lab/configs/gpu/smollm2_135m_32k.yaml \
        --metrics chunks/smollm2-135m-32k/metrics.csv --out runs/eval/passkey-loss

Reads a ``longnet fit`` run, while it trains or after: a run folder (its ``config.yaml``,
``metrics.csv`` and ``tokenizer/``) or a config and a ``metrics.csv`` (a chunked run's, which
the chunks bring back). Rebuilds the passkey example of every logged step that trained on one
passkey example of its ``LengthCurriculum``, and splits their ``train/passkey_loss`` by what
gives the query of the answer's first digit the key's first digit in the model's dilated
pattern (lab.passkey_training): a rate-1 branch (``dense``), heads of sparse branches
only (``sparse``) or no head (``unseen``). Prints the mean and median loss per ``--span``
steps and visibility and writes ``passkey_training_loss.csv`` (every such step) and
``passkey_training_loss.png`` into ``--out`` (by default the run folder). Log every step
(``--trainer.log_every_n_steps 1``) to see every passkey step.
"""

from __future__ import annotations

import dataclasses
import sys

from lab.passkey_training import (
    loss_by_visibility,
    plot_loss_by_visibility,
    read_passkey_steps,
    span_for,
)
from lab.scripts.arguments import ScriptParser, run_cli
from longnet.cli.arguments import path_argument, positive_int_argument
from longnet.eval import format_table, write_csv
from longnet.validation import UsageError


def main(argv: list[str] | None = None) -> int:
    parser = ScriptParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=path_argument, nargs="?",
                        help="the run folder (runs/<name>): its config.yaml, metrics.csv and "
                             "tokenizer/")
    parser.add_argument("--config", type=path_argument,
                        help="the run's config (default: the run folder's config.yaml)")
    parser.add_argument("--metrics", type=path_argument,
                        help="the run's metrics.csv (default: the run folder's)")
    parser.add_argument("--span", type=positive_int_argument,
                        help="optimizer steps per row of the table (default: about 8 rows)")
    parser.add_argument("--out", type=path_argument,
                        help="where the CSV and the PNG go (default: the run folder)")
    args = parser.parse_args(argv)
    if args.run is None and not (args.config and args.metrics and args.out):
        parser.error("give a run folder, or --config, --metrics and --out")
    config = args.config or args.run / "config.yaml"
    metrics = args.metrics or args.run / "metrics.csv"
    tokenizer = args.run / "tokenizer" if args.run and (args.run / "tokenizer").is_dir() else None
    run = read_passkey_steps(config, metrics, tokenizer)
    if not run.steps:
        raise UsageError(
            f"none of the {run.logged_steps} logged steps in {metrics} trained on exactly one "
            "passkey example; log every step (log_every_n_steps 1) to see them all (a log "
            "without train/passkey_loss counts steps of one window only).")
    span = args.span or span_for(run.steps)
    print(f"{len(run.steps)} of {run.logged_steps} logged steps trained on one passkey "
          f"example. The key is given to the answer's query by a rate-1 branch (dense), by "
          f"heads of sparse branches only (sparse) or by no head (unseen) of the pattern "
          f"{run.pattern.branches}.")
    print(format_table(loss_by_visibility(run.steps, span)))
    out = args.out or args.run
    written = [write_csv([dataclasses.asdict(item) for item in run.steps],
                         out / "passkey_training_loss.csv"),
               plot_loss_by_visibility(run.steps, out / "passkey_training_loss.png",
                                       title=f"{metrics.parent.name}: passkey loss by copy")]
    print("wrote " + ", ".join(str(path) for path in written))
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
