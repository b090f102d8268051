#!/usr/bin/env bash
# Several gpu_suite.py parts in one device call, each under its own time limit, and every
# file they write packed into one archive (the device machine returns at most 8 files).
#
#   bash benchmarks/gpu_parts.sh OUT part:seconds [part:seconds ...]
#
# Prints each part's exit status, time and last lines; OUT/parts.tar.gz holds the logs and
# JSON files, one folder per part.
set -u
out=$1
shift
work=$(mktemp -d)
mkdir -p "$out"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export OPSWAP_MAX_TIME_S=${OPSWAP_MAX_TIME_S:-2}
for spec in "$@"; do
    part=${spec%%:*}
    limit=${spec##*:}
    t0=$(date +%s)
    # timeout signals the whole process group: the part's pytest and scripts stop with it
    timeout -k 10 "$limit" python3 benchmarks/gpu_suite.py --only "$part" --workers 4 \
        --out "$work/$part" >"$work/$part.log" 2>&1
    rc=$?
    echo "== $part rc=$rc $(($(date +%s) - t0))s"
    grep -E "passed|failed|error|Error|wrote" "$work/$part.log" | tail -n 6
    tar -czf "$out/parts.tar.gz" -C "$work" . # after every part: a later kill loses nothing
done
