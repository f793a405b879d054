#!/usr/bin/env bash
# The wheels a GPU machine's image lacks, fetched here (where pip reaches the package index) into
# a folder that travels with the working tree to the GPU machine (docs/long_context_gpu.md):
#
#   bash lab/gpu/fetch_wheels.sh [--pretrained] [FOLDER]
#
# FOLDER: default .whl, with --pretrained .whl-pretrained (both ignored by git; carry it).
# The GPU image has torch, lightning, transformers, tokenizers, pyarrow, pandas, xxhash, fsspec,
# huggingface-hub, PyYAML, einops, safetensors, matplotlib, tqdm and torchmetrics, but not
# datasets (with dill and multiprocess) nor jsonargparse (with docstring-parser and
# typeshed-client). With --pretrained, also what a fine-tune of an imported base needs:
# transformers at CI's version (the image's 5.17 converts the SmolLM2 GGUF's tokenizer into
# another tokenizer.json: byte fallback, untrimmed offsets), gguf and peft (14.5 MB more), in
# a folder of their own: the GPU configs that read `packages: [installed]` read the wheels a
# call installs too, so .whl stays the same six for every chunk of those.
# Their versions are those of .ci/constraints.txt (the set CI tests), for CPython 3.12 on
# x86-64 Linux (the image's Python), without dependencies (the image has them).
# Prints each wheel fetched with its size, and the total. Exit status 1 when one is not found.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
PACKAGES=(datasets dill multiprocess jsonargparse docstring_parser typeshed_client)
FOLDER=$ROOT/.whl
if [ "${1:-}" = --pretrained ]; then
    PACKAGES+=(transformers gguf peft)
    FOLDER=$ROOT/.whl-pretrained
    shift
fi
FOLDER=${1:-$FOLDER}

pins=()
for package in "${PACKAGES[@]}"; do
    pin=$(grep -i -E "^${package//_/[-_]}==" "$ROOT/.ci/constraints.txt" || true)
    if [ -z "$pin" ]; then
        echo "fetch_wheels.sh: $package has no pin in .ci/constraints.txt; add it there." >&2
        exit 1
    fi
    pins+=("$pin")
done

mkdir -p "$FOLDER"
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --dest "$FOLDER" "${pins[@]}"

echo "fetch_wheels.sh: fetched into $FOLDER (${pins[*]}):"
for pin in "${pins[@]}"; do
    name=${pin%%==*}
    wheel=$(compgen -G "$FOLDER/${name//-/_}-${pin##*==}-*.whl" || compgen -G "$FOLDER/${name}-${pin##*==}-*.whl")
    printf '  %-50s %8s bytes\n' "$(basename "$wheel")" "$(stat -c %s "$wheel")"
done
du -cb "$FOLDER"/*.whl | tail -1 | awk '{printf "  total %s bytes\n", $1}'
