#!/usr/bin/env bash
# The engine's tests under a sanitizer: build the whole tree instrumented, install it aside, and run
# the tests that drive the sidecar (reads, waves, overlap, read-ahead drops, failures, verify, the
# lab, two contexts on two threads, the plan fuzzer) on it; under ASan also the RPC tests.
#
#   scripts/sanitize.sh address [pytest args...]   AddressSanitizer + UndefinedBehaviorSanitizer
#   scripts/sanitize.sh thread  [pytest args...]   ThreadSanitizer
#   scripts/sanitize.sh address --build-only       just the build (build/sanitize-address)
#
# The libraries are built with -DEMPANEL_SANITIZE=<kind> (CMakeLists.txt) into
# build/sanitize-<kind>, installed into build/sanitize-<kind>-install, and the tests load them
# (EMPANEL_GGUF_LIB_DIR) in a CPython that is not instrumented, with the sanitizer's runtime
# preloaded. Any report fails the run: ASan and UBSan stop the process at the first one (the test
# then fails), and TSan's reports are counted from its log files at the end. Nothing of our own
# code is suppressed; what is (CPython's own leaks: detect_leaks=0) is said below.
set -euo pipefail
cd "$(dirname "$0")/.."

kind="${1:-}"
shift || true
case "$kind" in
    address) runtime=libasan.so ;;
    thread)  runtime=libtsan.so ;;
    *) echo "usage: scripts/sanitize.sh address|thread [--build-only] [pytest args...]" >&2; exit 2 ;;
esac

# the tests the sanitizers run: the engine's data path, its failures and its threads (about
# 1 minute under ASan and 3.5 under TSan on 2 cores; .ci/run prints the times)
TESTS=(
    tests/test_pool.py          # reads, waves, overlap, read-ahead and its drops, host tier, g-lru
    tests/test_budget.py        # the live budget moved mid-decode and mid-prompt: exact
    tests/test_pressure.py      # the controller's thread moving it with the memory left
    tests/test_slots_guard.py   # failing reads, files changed under us (both read paths)
    tests/test_read_io.py       # the reader threads and io_uring: exact, short reads, fallback
    tests/test_threads.py       # two contexts on one model on two threads; loads in threads
    tests/test_verify.py        # digests, a file that changes under us
    tests/test_policies.py      # the policy lab
    tests/test_plan.py          # bounds, bind checks, reader start, mutated plans
)
# ASan also runs the RPC tests: real ggml-rpc-server processes (built with it) on loopback, hosts
# lost and taken back, damaged caches. TSan does not: ggml-rpc's dispatcher hands each command to
# its thread through std::promise/future, whose synchronization inside the uninstrumented
# libstdc++ TSan cannot see (a report on every command, none of them in our code).
if [ "$kind" = address ]; then
    TESTS+=(tests/test_rpc.py)
fi

build="build/sanitize-$kind"
install="build/sanitize-$kind-install"
start=$(date +%s)
python_bin="$(command -v python3)"
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DEMPANEL_SANITIZE="$kind" \
      -DGGML_RPC=ON -DEMPANEL_INSTALL_INPLACE=OFF -DEMPANEL_WERROR=ON -DPython_EXECUTABLE="$python_bin" >/dev/null
cmake --build "$build"
cmake --install "$build" --prefix "$install" --component empanel >/dev/null
echo "sanitize $kind: build took $(( $(date +%s) - start )) s"
if [ "${1:-}" = "--build-only" ]; then
    exit 0
fi

logs="$build/reports"
rm -rf "$logs"
mkdir -p "$logs"
# libstdc++ with it: CPython does not link it, and the runtime's C++ exception interceptors need
# it loaded before them (else: "CHECK failed ... real___cxa_throw" at llama.cpp's first throw)
preload="$(gcc -print-file-name="$runtime") $(gcc -print-file-name=libstdc++.so)"
if [ "$kind" = address ]; then
    # detect_leaks=0: CPython frees little at exit by design, and its "leaks" are not ours
    export ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:halt_on_error=1:strict_string_checks=1:detect_stack_use_after_return=1:log_path=$PWD/$logs/asan"
    export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:log_path=$PWD/$logs/ubsan"
else
    export TSAN_OPTIONS="halt_on_error=0:second_deadlock_stack=1:history_size=4:log_path=$PWD/$logs/tsan"
fi
start=$(date +%s)
status=0
env -u EMPANEL_REQUIRE_PROGRAMS -u EMPANEL_REQUIRE_ARCHS -u EMPANEL_VULKAN_LIB_DIR \
    LD_PRELOAD="$preload" EMPANEL_GGUF_LIB_DIR="$PWD/$install/empanel_gguf/lib" EMPANEL_SANITIZER="$kind" \
    python3 -m pytest -q -p no:cacheprovider "${TESTS[@]}" "$@" || status=$?
echo "sanitize $kind: tests took $(( $(date +%s) - start )) s"
reports=$(find "$logs" -type f | wc -l)
if [ "$reports" -gt 0 ]; then
    echo "sanitize $kind: $reports report file(s):"
    for f in "$logs"/*; do
        echo "== $f"
        head -n 80 "$f"
    done
    exit 1
fi
exit "$status"
