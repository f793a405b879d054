#!/usr/bin/env bash
# One GPU device call: a training chunk of each config given, each for the same training time,
# and what the next chunk needs brought back (docs/long_context_gpu.md):
#
#   bash lab/gpu/chunk.sh [--seconds S] [--train-until T] CONFIG [CONFIG ...] [-- longnet fit options...]
#
# --seconds S: each config trains for S seconds (trainer.max_time). --train-until T (one config
# only): training also stops once T seconds have passed since chunk.sh started
# (longnet.training.TrainingDeadline), whatever the imports and the data build took before it;
# for a call with a timeout, T is the timeout less what runs after training (the final
# validation and test, the export, the handoff).
#
# e.g. the dilated model and its dense twin for 150 s of training each:
#   bash lab/gpu/chunk.sh --seconds 150 lab/configs/gpu/longnet_tiny_64k.yaml \
#       lab/configs/gpu/longnet_tiny_64k_dense.yaml
#
# 1. the wheels of .whl/ (lab/gpu/fetch_wheels.sh) are installed once, offline, into a
#    temporary folder when longnet's CLI does not import without them; the machine is described;
# 2. each config in turn: lab/gpu/train_chunk.sh CONFIG --trainer.max_time <S> [options]
#    (restores the newest state, trains, tests, packs the handoff), all configs sharing one data
#    cache, so configs with the same data build it once;
# 3. $OUT (the device machine sets it; default runs/gpu-chunk-out) gets 4 files per config, in
#    $OUT/<run name>/: weights.safetensors and handoff.json (the compact handoff), metrics.csv
#    and chunk.log, and a fifth, profile.txt, from a config with a StepProfiler (the smollm2
#    recipe). Two configs without one fill the 8 files a device call brings back; the full
#    state (37 MiB, 3 shards) does not come back.
# Exit status: 0 when every chunk's fit exited 0, else the last failure's; 2 on a usage error.
set -uo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT" || exit 2
PY=${PYTHON:-python3}
STARTED=$(date +%s)
SECONDS_EACH=""
TRAIN_UNTIL=""
CONFIGS=()
while [ $# -gt 0 ]; do
    case $1 in
        --seconds) SECONDS_EACH=${2:-}; shift 2 || shift ;;
        --train-until) TRAIN_UNTIL=${2:-}; shift 2 || shift ;;
        --) shift; break ;;
        -*) echo "chunk.sh: unknown option $1 (give --seconds S, --train-until T, configs," \
                 "then -- and fit options)." >&2; exit 2 ;;
        *) CONFIGS+=("$1"); shift ;;
    esac
done
FIT_OPTIONS=("$@")
if [ ${#CONFIGS[@]} -eq 0 ]; then
    echo "chunk.sh: give at least one config (e.g. lab/configs/gpu/longnet_tiny_64k.yaml)." >&2
    exit 2
fi
for config in "${CONFIGS[@]}"; do
    [ -f "$config" ] || { echo "chunk.sh: no config file $config." >&2; exit 2; }
done
whole_seconds() {  # OPTION VALUE: refuse a VALUE that is not 1 .. 86399 whole seconds
    if ! [[ $2 =~ ^[1-9][0-9]*$ ]] || [ "$2" -ge 86400 ]; then
        echo "chunk.sh: $1 must be a whole number of seconds from 1 to 86399, got '$2'." >&2
        exit 2
    fi
}
if [ -n "$SECONDS_EACH" ]; then
    whole_seconds --seconds "$SECONDS_EACH"
    FIT_OPTIONS=(--trainer.max_time "$(printf '00:%02d:%02d:%02d' $((SECONDS_EACH / 3600)) \
        $((SECONDS_EACH % 3600 / 60)) $((SECONDS_EACH % 60)))" "${FIT_OPTIONS[@]}")
fi

if [ -n "$TRAIN_UNTIL" ]; then
    whole_seconds --train-until "$TRAIN_UNTIL"
    if [ ${#CONFIGS[@]} -ne 1 ]; then
        echo "chunk.sh: --train-until takes one config (configs of one call share its clock)," \
             "got ${#CONFIGS[@]}; give each config its --seconds instead." >&2
        exit 2
    fi
    FIT_OPTIONS+=(--trainer.callbacks+=longnet.training.TrainingDeadline
                  "--trainer.callbacks.at=$((STARTED + TRAIN_UNTIL))")
fi

OUT=${OUT:-runs/gpu-chunk-out}
mkdir -p "$OUT" || exit 2
WORK=$(mktemp -d)
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export LONGNET_CACHE=${LONGNET_CACHE:-$WORK/cache}
if ! "$PY" -c "import longnet.cli" 2>/dev/null && compgen -G "${WHEELS:-.whl}/*.whl" >/dev/null
then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$WORK/site" \
        "${WHEELS:-.whl}"/*.whl || exit 2
    export PYTHONPATH="$WORK/site:$PYTHONPATH"
fi
"$PY" - <<'EOF'
import importlib.metadata as metadata
import os
import platform
import torch
names = ("torch", "lightning", "transformers", "datasets", "pyarrow", "jsonargparse", "numpy")
versions = []
for name in names:
    try:
        versions.append(f"{name} {metadata.version(name)}")
    except metadata.PackageNotFoundError:
        versions.append(f"{name} -")
card = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device"
print(f"chunk.sh: {card}, {os.cpu_count()} CPUs, Python {platform.python_version()},",
      ", ".join(versions), flush=True)
EOF

status=0
for config in "${CONFIGS[@]}"; do
    name=$("$PY" -c "import sys, yaml; print(yaml.safe_load(open(sys.argv[1]))['trainer']['logger']['init_args']['name'])" "$config") || { status=2; continue; }
    started=$(date +%s)
    OUT="$WORK/out/$name" bash lab/gpu/train_chunk.sh "$config" "${FIT_OPTIONS[@]}"
    fit_status=$?
    [ $fit_status -eq 0 ] || status=$fit_status
    mkdir -p "$OUT/$name"
    for file in handoff/weights.safetensors handoff/handoff.json metrics.csv chunk.log \
            profile.txt; do
        [ -f "$WORK/out/$name/$file" ] && cp "$WORK/out/$name/$file" "$OUT/$name/"
    done
    echo "chunk.sh: $config: fit exited $fit_status after $(( $(date +%s) - started )) s;" \
         "brought back: $(cd "$OUT/$name" && ls | tr '\n' ' ')"
done
echo "chunk.sh: keep $OUT/<name>/weights.safetensors and handoff.json in chunks/<name>/handoff/" \
     "and metrics.csv in chunks/<name>/, and commit them."
rm -rf "$WORK"
exit $status
