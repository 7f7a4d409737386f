#!/usr/bin/env bash
# The installed package from a user's side (meson test 'consumer', suite
# package): stages `meson install` of BUILD_DIR in a temporary folder, builds
# tests/consumer/trainer.cc against the stage with its own meson.build
# (pkg-config, PKG_CONFIG_PATH into the stage) and its own CMakeLists.txt
# (find_package, CMAKE_PREFIX_PATH into the stage), and runs each build as a
# 2-worker, 1-server job under the staged `psld launch`, checking exact sums.
# Nothing of the source or build tree is on an include or library path.
#
#   tests/consumer/run.sh MESON BUILD_DIR SOURCE_DIR
#
# The temporary folder and every process of a job go, whatever the outcome.
set -euo pipefail

meson=$1
build=$2
src=$3
tmp=$(mktemp -d "${TMPDIR:-/tmp}/psld-consumer.XXXXXX")
job=

cleanup() {
  # A job runs in its own process group (setsid): stop all of it.
  if [[ -n $job ]]; then kill -KILL -- "-$job" 2>/dev/null || true; fi
  rm -rf "$tmp"
}
trap cleanup EXIT

step() { printf '== %s\n' "$*"; }

# meson test puts the build's lib/ on the loader's path: the stage alone here.
unset LD_LIBRARY_PATH

step "staging the install in $tmp/stage"
DESTDIR=$tmp/stage "$meson" install -C "$build" --no-rebuild --quiet
pc=$(find "$tmp/stage" -name psld.pc -path '*/pkgconfig/*' | head -1)
[[ -n $pc ]] || { echo "no psld.pc in the stage"; exit 1; }
libdir=$(dirname "$(dirname "$pc")")
prefix=$(find "$tmp/stage" -path '*/bin/psld' -type f | head -1)
prefix=$(dirname "$(dirname "$prefix")")
for f in "$prefix/include/psld/worker.h" "$prefix/include/psld/version.h" \
  "$libdir/cmake/psld/psld-config.cmake" "$libdir/cmake/psld/psld-config-version.cmake"; do
  [[ -f $f ]] || { echo "missing from the install: ${f#"$tmp/stage"}"; exit 1; }
done

# Only the consumer's own sources: a copy, so neither build writes into the tree.
cp -r "$src/tests/consumer" "$tmp/src"

step "building with meson through pkg-config"
# psld.pc is relocatable (prefix=${pcfiledir}/...) in a build configured since
# meson.build set pkgconfig.relocatable; one configured before names the
# install prefix, which the stage's sysroot then goes in front of.
sysroot=
grep -q '^prefix=${pcfiledir}' "$pc" || sysroot=$tmp/stage
PKG_CONFIG_PATH=$libdir/pkgconfig PKG_CONFIG_SYSROOT_DIR=$sysroot "$meson" setup "$tmp/meson-build" "$tmp/src" >"$tmp/meson.log" 2>&1 ||
  { cat "$tmp/meson.log"; exit 1; }
"$meson" compile -C "$tmp/meson-build" >>"$tmp/meson.log" 2>&1 || { cat "$tmp/meson.log"; exit 1; }

step "building with cmake through find_package"
cmake -G Ninja -S "$tmp/src" -B "$tmp/cmake-build" -DCMAKE_PREFIX_PATH="$prefix" >"$tmp/cmake.log" 2>&1 ||
  { cat "$tmp/cmake.log"; exit 1; }
cmake --build "$tmp/cmake-build" >>"$tmp/cmake.log" 2>&1 || { cat "$tmp/cmake.log"; exit 1; }

# run_job TRAINER: 2 workers and 1 server under the staged psld launch.
run_job() {
  local rounds=10 rc=0 deps
  deps=$(LD_LIBRARY_PATH=$libdir ldd "$1")
  [[ $deps == *"=> $libdir/libpsld.so"* ]] || { echo "$1 does not load the staged libpsld: $deps"; return 1; }
  LD_LIBRARY_PATH=$libdir \
    PSLD_SERVER_MODE=sum PSLD_UCX_TLS=tcp PSLD_LIVENESS_HEARTBEAT_TIMEOUT_MS=10000 \
    setsid timeout -k 5 60 "$prefix/bin/psld" launch -w 2 -s 1 -- "$1" "$rounds" >"$tmp/job.log" 2>&1 &
  job=$!
  wait "$job" || rc=$?
  job=
  cat "$tmp/job.log"
  ((rc == 0)) || { echo "the job failed (exit status $rc)"; return 1; }
  for w in 0 1; do
    grep -q "worker $w of 2: $rounds rounds exact" "$tmp/job.log" ||
      { echo "worker $w did not report exact sums"; return 1; }
  done
}

step "running the meson build under psld launch"
run_job "$tmp/meson-build/trainer"
step "running the cmake build under psld launch"
run_job "$tmp/cmake-build/trainer"
step "both consumers built against the staged install and summed exactly"
