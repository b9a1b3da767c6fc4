#!/usr/bin/env bash
# Regenerates requirements.txt (every package at the exact version the suite was run with) from requirements.in
# (the direct needs), then requirements-trackers.txt (wandb, trackio) from requirements-trackers.in, pinned to the
# same versions wherever the two share a package. Needs pip-tools (pip install pip-tools). Edit the .in file, run
# this, run the suite, commit both.
set -euo pipefail
cd "$(dirname "$0")/.."
compile() {
    CUSTOM_COMPILE_COMMAND="bash tools/pin_requirements.sh" python -m piptools compile --quiet --strip-extras \
        --allow-unsafe --no-emit-index-url --no-emit-find-links -o "$1" "$2"
}
compile requirements.txt requirements.in
# torch's version without its build label (+cpu where pip found the CPU file): `torch==2.13.0` is then satisfied by
# the CPU build here and by the CUDA build of the same version on a GPU machine (README: Set up).
sed -i -E 's/^torch==([0-9][0-9.]*)\+[a-z0-9]+$/torch==\1/' requirements.txt
compile requirements-trackers.txt requirements-trackers.in
