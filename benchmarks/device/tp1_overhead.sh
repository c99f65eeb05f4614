#!/bin/sh
# Interleaved runs of tp1_overhead.py on the tree before tensor parallelism ($1, a `git archive` of it
# unpacked there) and the current tree, each going first in every other pair; JSON lines to $2.
set -e
before() { PYTHONPATH="$1/src:$PYTHONPATH" python3 benchmarks/device/tp1_overhead.py --label before >> "$2"; }
current() { PYTHONPATH="src:$PYTHONPATH" python3 benchmarks/device/tp1_overhead.py --label tp-code >> "$2"; }
for pair in 1 2; do
  before "$1" "$2"; current "$1" "$2"
  current "$1" "$2"; before "$1" "$2"
done
