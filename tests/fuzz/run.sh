#!/usr/bin/env bash
# tests/fuzz/run.sh FUZZER SEEDS WORK SECONDS: one harness for SECONDS
# (PSLD_FUZZ_SECONDS overrides it) from the seed corpus SEEDS. New inputs go
# to WORK/corpus, made empty first, and a crash, leak or timeout to WORK/
# (crash-*, leak-*, timeout-*), named in the output; SEEDS is only read.
set -euo pipefail
fuzzer=$1 seeds=$2 work=$3
seconds=${PSLD_FUZZ_SECONDS:-$4}
rm -rf "$work/corpus"
mkdir -p "$work/corpus"
# -timeout: an input that takes 10 s is a hang; -rss_limit_mb: a decoder
# that allocates 2 GiB on a 4 KiB input is a bug too.
exec "$fuzzer" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
  -artifact_prefix="$work/" "$work/corpus" "$seeds"
