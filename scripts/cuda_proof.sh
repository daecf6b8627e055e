#!/usr/bin/env bash
# The CUDA proof: build empanel-gguf with CUDA for one GPU architecture and run scripts/gpu_check.py
# on it (exactness against the same build without slots at its defaults, decode at 100 % and 25 %
# slots against resident, the host round trip per MoE layer), on a machine with no network.
#
#   scripts/cuda_proof.sh pack           here, with the network: .cuda/ gets the prepared llama.cpp
#                                        tree trimmed to what a CUDA build compiles (a tarball) and
#                                        the wheels a GPU machine lacks (gguf, cffi, pycparser,
#                                        diskcache, llama-cpp-python's bindings); about 12 MiB
#   scripts/cuda_proof.sh run [OUT]      there, offline: install what is missing, build (16 jobs,
#                                        sm_90 unless CUDA_ARCH says otherwise), write OUT/cuda.json,
#                                        OUT/cuda-speed.json and OUT/cuda.log (OUT: $OUT, else ./cuda-out)
#
# The build leaves out what the check does not run (llama.cpp's programs, the RPC backend, the
# FlashAttention kernels: GGML_CUDA_FA=OFF), so that it fits in about 6 minutes on 16 cores and a
# rerun fits too. Without nvcc `run` goes as far as it can: it unpacks, installs and configures a
# CPU build from the packed tree (the offline path itself), then stops with exit status 3;
# CUDA_PROOF_CPU=1 then also builds that CPU build and runs the checks on it (a dry run: no layer
# is offloaded, every number but the GPU's).
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
PACK=$REPO/.cuda
PY=${PYTHON:-python3}

pack() {
    rm -rf "$PACK" && mkdir -p "$PACK/wheels"
    local tree
    tree=$(mktemp -d)
    "$PY" scripts/llama_source.py prepare --dest "$tree/llama.cpp"
    # what a CUDA build of the libraries does not compile (the other backends, the programs,
    # models, docs): left out so that the pack travels (64 MiB with the working tree)
    (cd "$tree/llama.cpp" && rm -rf models docs media examples benches tools/server/public* \
        ggml/src/ggml-vulkan ggml/src/ggml-sycl ggml/src/ggml-cann ggml/src/ggml-metal ggml/src/ggml-opencl \
        ggml/src/ggml-musa ggml/src/ggml-hip ggml/src/ggml-webgpu ggml/src/ggml-zdnn ggml/src/ggml-kompute \
        ggml/src/ggml-openvino ggml/src/ggml-hexagon gguf-py)
    tar -C "$tree" -czf "$PACK/llama.cpp.tar.gz" llama.cpp
    rm -rf "$tree"
    # the GPU machine's image has numpy, jinja2, cmake, ninja, pytest (device KINDS.md); not these
    local sdist
    sdist=$("$PY" scripts/llama_source.py fetch)
    CMAKE_ARGS="-DLLAMA_BUILD=OFF" "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$PACK/wheels" "$sdist"
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$PACK/wheels" \
        "gguf==$("$PY" -c 'import importlib.metadata as m; print(m.version("gguf"))')" \
        "cffi==$("$PY" -c 'import importlib.metadata as m; print(m.version("cffi"))')" \
        pycparser diskcache
    du -sh "$PACK"
}

run() {
    local out=${1:-${OUT:-$REPO/cuda-out}}
    mkdir -p "$out"
    exec > >(tee "$out/cuda.log") 2>&1
    local t0=$SECONDS
    [ -f "$PACK/llama.cpp.tar.gz" ] || { echo "cuda_proof: no $PACK/llama.cpp.tar.gz: run 'scripts/cuda_proof.sh pack' first (with the network), and carry .cuda"; exit 1; }

    echo "== Python packages (installed from .cuda/wheels where missing)"
    # (llama_cpp is only looked up: importing it loads a libllama, ours once the build is done)
    if ! "$PY" -c "import cffi, gguf, diskcache, importlib.util as u; assert u.find_spec('llama_cpp')" 2>/dev/null; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/cuda-site "$PACK"/wheels/*.whl
        export PYTHONPATH=/tmp/cuda-site${PYTHONPATH:+:$PYTHONPATH}
    fi
    export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}
    "$PY" -c "import sys, cffi, gguf, numpy; print('python', sys.version.split()[0], 'numpy', numpy.__version__, 'cffi', cffi.__version__)"

    echo "== llama.cpp tree (packed, patched)"
    rm -rf /tmp/cuda-src && mkdir -p /tmp/cuda-src && tar -C /tmp/cuda-src -xzf "$PACK/llama.cpp.tar.gz"

    local build=$REPO/build/cuda-proof
    configure() {  # $1: GGML_CUDA ON|OFF
        rm -rf "$build"
        cmake -S "$REPO" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DEMPANEL_LLAMA_SRC=/tmp/cuda-src/llama.cpp \
            -DGGML_CUDA="$1" -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCH:-90}" -DGGML_CUDA_FA=OFF -DGGML_RPC=OFF \
            -DEMPANEL_ARCHS=OFF -DEMPANEL_PROGRAMS=OFF -DEMPANEL_INSTALL_INPLACE=OFF \
            -DPython_EXECUTABLE="$(command -v "$PY")" > "$out/cmake-configure-$1.log" 2>&1
    }
    local cuda=ON
    if ! command -v nvcc >/dev/null; then
        cuda=OFF
        echo "cuda_proof: no nvcc here: configuring a CPU build from the packed tree instead"
    elif ! configure ON; then
        grep -A3 "CMake Error" "$out/cmake-configure-ON.log" | head -12
        command -v nvidia-smi >/dev/null && { echo "cuda_proof: the CUDA configure failed"; exit 1; }
        cuda=OFF
        echo "cuda_proof: nvcc but no usable CUDA toolkit and no GPU here: configuring a CPU build instead"
    fi
    if [ $cuda = OFF ]; then
        configure OFF || { tail -30 "$out/cmake-configure-OFF.log"; exit 1; }
    fi
    echo "configured in $((SECONDS - t0)) s (GGML_CUDA=$cuda)"
    if [ $cuda = OFF ] && [ "${CUDA_PROOF_CPU:-0}" != 1 ]; then
        echo "cuda_proof: stopped before the build: no CUDA here (CUDA_PROOF_CPU=1 builds and checks on the CPU)"
        exit 3
    fi

    echo "== build ($(nproc) jobs)"
    local tb=$SECONDS
    cmake --build "$build" -j "$(nproc)" > "$out/cmake-build.log" || { tail -40 "$out/cmake-build.log"; exit 1; }
    cmake --install "$build" --prefix "$build-install" --component empanel > /dev/null
    echo "built in $((SECONDS - tb)) s"
    export EMPANEL_GGUF_LIB_DIR=$build-install/empanel_gguf/lib
    unset LLAMA_CPP_LIB_PATH
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader

    echo "== exactness: every fixture, pools in GPU memory vs the same build without slots"
    "$PY" scripts/gpu_check.py -ngl 99 -n 8 --json "$out/cuda.json" || true

    echo "== decode: 100 % and 25 % slots vs resident, round trip per MoE layer (8-layer 30B shape)"
    "$PY" -m empanel_gguf bench --write-model /tmp/cuda-m8.gguf --write-only --shape synthetic --layers 8 > /dev/null
    "$PY" scripts/gpu_check.py -ngl 99 --fixtures qwen3moe-q4_k --speed /tmp/cuda-m8.gguf --n-gen 32 \
        --json "$out/cuda-speed.json" || true
    echo "cuda_proof: done in $((SECONDS - t0)) s; $out/cuda.json, $out/cuda-speed.json"
}

case "${1:-}" in
    pack) pack ;;
    run)  shift; run "$@" ;;
    *)    sed -n '2,20p' "$0"; exit 2 ;;
esac
