#!/usr/bin/env bash
# One chunk of a long training run, on a machine that shares nothing with the previous chunk's
# but the repository (docs/long_context_gpu.md):
#
#   bash lab/gpu/train_chunk.sh CONFIG [longnet fit options...]
#
# 1. longnet must import: if it does not and $WHEELS (default .whl; set, it must be a folder)
#    holds wheels, they are installed offline into a temporary folder first;
# 2. the newest state present becomes <run folder>/checkpoints/last.ckpt: that folder's own, the
#    full state packed in $STATE (default runs/<name>-state) or the compact handoff in $HANDOFF
#    (default chunks/<name>/handoff); none of them: a new run (chunk_state.py restore). A
#    folder set in $STATE or $HANDOFF must exist, a default one is read when present; a state
#    or handoff of another run (run id, model shape) than the checkpoint or the other folder
#    stops the chunk, the checkpoint kept;
# 3. chunks/<name>/metrics.csv, if present, is continued, and one chunk trains:
#    longnet fit --config CONFIG --ckpt_path last (the config's max_time ends it);
# 4. $OUT (default runs/<name>-out) gets at most 8 files: handoff/ (weights.safetensors,
#    handoff.json), state/ (the full state: index.json and at most 3 shards of 16 MiB, left out
#    when larger), metrics.csv, chunk.log (everything printed) and, from a config with a
#    lab.profiling.StepProfiler, profile.txt (what one training step costs).
#    A fit that left no checkpoint brings back no handoff or state, and says so.
# <run folder> is trainer.logger's save_dir/name, <name> its name: the config's, or those given
# among the fit options (--trainer.logger.init_args.name NAME, ...save_dir DIR, or another
# --config), as longnet fit reads them. Exit status: the fit's (0 also when max_time ended the
# chunk), 2 when nothing could be trained.
set -uo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT" || exit 2
PY=${PYTHON:-python3}
if [ $# -lt 1 ] || [ ! -f "$1" ]; then
    echo "train_chunk.sh: give a config file first (e.g. lab/configs/gpu/longnet_tiny_64k.yaml)," \
         "got '${1:-}'." >&2
    exit 2
fi
CONFIG=$1
shift

export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if [ -n "${WHEELS:-}" ] && [ ! -d "$WHEELS" ]; then
    echo "train_chunk.sh: WHEELS=$WHEELS is not a folder; give the folder of the wheels or" \
         "leave WHEELS unset (default .whl)." >&2
    exit 2
fi
WHEELS=${WHEELS:-.whl}
if ! "$PY" -c "import longnet.cli" 2>/dev/null; then  # checked again after the install
    if compgen -G "$WHEELS/*.whl" >/dev/null; then
        SITE=$(mktemp -d)
        "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" \
            "$WHEELS"/*.whl || exit 2
        export PYTHONPATH="$SITE:$PYTHONPATH"
    fi
    if ! "$PY" -c "import longnet.cli"; then
        echo "train_chunk.sh: longnet does not import with $PY (above: the missing package);" \
             "put the wheels of what is missing in $WHEELS (docs/long_context_gpu.md)." >&2
        exit 2
    fi
fi

RUN_NAME=$("$PY" - "$CONFIG" "$@" <<'EOF'
import sys
import yaml


def logger_args(path):
    """trainer.logger.init_args of the config file ``path``."""
    logger = ((yaml.safe_load(open(path)) or {}).get("trainer") or {}).get("logger") or {}
    return (logger.get("init_args") or {}) if isinstance(logger, dict) else {}


found = dict(logger_args(sys.argv[1]))
options = {f"--trainer.logger.{middle}{key}": key
           for key in ("name", "save_dir") for middle in ("init_args.", "")}
args, index = sys.argv[2:], 0
while index < len(args):  # what longnet fit reads of the fit options, in their order
    key, equals, value = args[index].partition("=")
    if key in options or key == "--config":
        if not equals:
            index += 1
            value = args[index] if index < len(args) else ""
        found.update(logger_args(value) if key == "--config" else {options[key]: value})
    index += 1
if not found.get("name"):
    sys.exit(f"train_chunk.sh: {sys.argv[1]} names no run folder "
             "(trainer.logger: longnet.training.RunLogger with save_dir and name).")
print(f"{found.get('save_dir') or 'runs'}/{found['name']}", found["name"])
EOF
) || exit 2
read -r RUN NAME <<<"$RUN_NAME"
OUT=${OUT:-runs/$NAME-out}
STATE_SET=${STATE:-} HANDOFF_SET=${HANDOFF:-}
STATE=${STATE:-runs/$NAME-state}
HANDOFF=${HANDOFF:-chunks/$NAME/handoff}
FROM=()  # what restore reads: a folder set must exist, a default one is read when present
if [ -n "$STATE_SET" ] || [ -e "$STATE" ]; then FROM+=(--state "$STATE"); fi
if [ -n "$HANDOFF_SET" ] || [ -e "$HANDOFF" ]; then FROM+=(--handoff "$HANDOFF"); fi
CKPT=$RUN/checkpoints/last.ckpt
mkdir -p "$OUT" "$RUN" || exit 2
exec > >(tee "$OUT/chunk.log") 2>&1

echo "train_chunk.sh: $CONFIG, run folder $RUN, state from ${FROM[*]:-none}, output $OUT"
"$PY" -m lab.scripts.chunk_state restore "$CKPT" "${FROM[@]}" || exit 2
echo "train_chunk.sh: restored in $SECONDS s."
if [ -f "chunks/$NAME/metrics.csv" ] && [ ! -f "$RUN/metrics.csv" ]; then
    cp "chunks/$NAME/metrics.csv" "$RUN/metrics.csv"
fi

rm -f "$RUN/profile.txt"  # written again by a StepProfiler in the config
started=$SECONDS
"$PY" -m longnet fit --config "$CONFIG" --ckpt_path last "$@"
status=$?
echo "train_chunk.sh: fit took $((SECONDS - started)) s."
started=$SECONDS

[ -f "$RUN/metrics.csv" ] && cp "$RUN/metrics.csv" "$OUT/metrics.csv"
[ -f "$RUN/profile.txt" ] && cp "$RUN/profile.txt" "$OUT/profile.txt"
if [ ! -f "$CKPT" ]; then
    echo "train_chunk.sh: fit exited $status and left no checkpoint at $CKPT: no handoff or" \
         "state is written, nothing to keep (see $OUT/chunk.log)."
    exit $status
fi
# $OUT is this script's own: an earlier chunk's handoff and state there are replaced
"$PY" -m lab.scripts.chunk_state handoff "$CKPT" "$OUT/handoff" --overwrite
"$PY" -m lab.scripts.chunk_state pack "$CKPT" "$OUT/state" --max-files 4 --overwrite \
    || echo "train_chunk.sh: the full state is left out; the compact handoff carries the run on."
echo "train_chunk.sh: handoff and state written in $((SECONDS - started)) s."
echo "train_chunk.sh: fit exited $status. Keep $OUT/handoff/* in chunks/$NAME/handoff/ and" \
     "$OUT/metrics.csv in chunks/$NAME/ (commit them), and $OUT/state/* in $STATE/ (carry it" \
     "to the next chunk where it fits)."
exit $status
