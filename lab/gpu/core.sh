#!/usr/bin/env bash
# One GPU device call: the attention core's GPU check (lab/scripts/gpu_check.py: the CUDA tests,
# compute-sanitizer, the attention ratio table 8K-1M against dense SDPA, the training-step
# table, the CLI on the GPU), its results brought back in two files:
#
#   bash lab/gpu/core.sh [gpu_check.py options, e.g. --only environment "cuda tests"]
#
# The wheels of .whl/ (lab/gpu/fetch_wheels.sh) are installed first when longnet's CLI does
# not import without them (gpu_check.py --wheels). $OUT (the device machine sets it; default
# runs/gpu-core-out) gets gpu_check.md (each step's status, time and key lines) and
# gpu_check.tar.gz (every step's log, the benchmark tables, JSON and plots), the archive
# refreshed every 5 s while the check runs, so that a call cut short still brings back the logs
# of the steps done. Exit status: gpu_check.py's.
set -uo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT" || exit 2
PY=${PYTHON:-python3}
OUT=${OUT:-runs/gpu-core-out}
mkdir -p "$OUT" || exit 2
WORK=$(mktemp -d)
export PYTHONUNBUFFERED=1
wheels=()
if ! "$PY" -c "import longnet.cli" 2>/dev/null && compgen -G "${WHEELS:-.whl}/*.whl" >/dev/null
then
    wheels=(--wheels "${WHEELS:-.whl}")
fi

"$PY" -m lab.scripts.gpu_check --out "$WORK/gpu_check" "${wheels[@]}" "$@" &
check=$!
# gpu_check.py writes its summary at the end; until then bring back each step's status line
while kill -0 "$check" 2>/dev/null; do
    sleep 5
    [ -d "$WORK/gpu_check" ] && tar -czf "$OUT/gpu_check.tar.gz" -C "$WORK" gpu_check 2>/dev/null
done
wait "$check"
status=$?
[ -f "$WORK/gpu_check/gpu_check.md" ] && cp "$WORK/gpu_check/gpu_check.md" "$OUT/"
[ -d "$WORK/gpu_check" ] && tar -czf "$OUT/gpu_check.tar.gz" -C "$WORK" gpu_check
echo "core.sh: gpu_check.py exited $status; brought back: $(cd "$OUT" && ls | tr '\n' ' ')"
rm -rf "$WORK"
exit $status
