#!/usr/bin/env bash
# Build llama.cpp's own C++ `llama-server`, `llama-bench`, `llama-perplexity` and `llama-quantize` (the llama.cpp
# peer of benchmarks/compare.py, its perplexity reference, its quantizer) from the llama.cpp source vendored in the
# llama-cpp-python sdist (PyPI is the only source this needs: no GitHub).
#
#     bash benchmarks/build_llama_server.sh [OUT_DIR]        # default /work/peers/llama.cpp/bin
#
# Skips the build when all the binaries are already in OUT_DIR. Environment knobs:
#   PYTHON      python whose pip downloads the sdist (default: .venv/bin/python of this checkout, else python3)
#   JOBS        parallel compile jobs (default 2)
#   WORK_DIR    where the sdist is downloaded, unpacked and built (default: OUT_DIR/../src, kept for rebuilds)
#   LLAMA_CPP_PYTHON_VERSION   pin the sdist version (default: the newest on PyPI)
#   EXTRA_FLAGS extra compiler flags, e.g. "-mno-avx512f" for an AVX2-only stand-in build on an AVX-512 CPU
#               (give it its own OUT_DIR: it builds in its own directory)
#   TOOLS       the binaries to build (default: llama-server llama-bench llama-perplexity llama-quantize)
#
# The binaries are linked statically against llama/ggml (BUILD_SHARED_LIBS=OFF), so OUT_DIR needs nothing else.
# Everything that would fetch from the network at build time (prebuilt web UI, HTTPS, curl) is turned off.
# On CPUs with AMX, GGML_NATIVE's -march=native turns on the AMX tile code, which GCC 12 miscompiles (the tile
# config), so AMX is switched off with -mno-amx-*; the AVX-512 (VNNI/BF16) kernels stay.
set -euo pipefail

OUT_DIR=${1:-/work/peers/llama.cpp/bin}
JOBS=${JOBS:-2}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [[ -z ${PYTHON:-} ]]; then
    if [[ -x $ROOT/.venv/bin/python ]]; then PYTHON=$ROOT/.venv/bin/python; else PYTHON=python3; fi
fi

log() { printf '[build_llama_server %s] %s\n' "$(date +%H:%M:%S)" "$*"; }
die() { printf '[build_llama_server] error: %s\n' "$*" >&2; exit 1; }

read -r -a TOOLS <<< "${TOOLS:-llama-server llama-bench llama-perplexity llama-quantize}"
have_all=1
for exe in "${TOOLS[@]}"; do [[ -x $OUT_DIR/$exe ]] || have_all=0; done
if (( have_all )); then
    log "${TOOLS[*]} are already in $OUT_DIR; nothing to do (delete them to rebuild)"
    exit 0
fi
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
WORK_DIR=${WORK_DIR:-$(dirname "$OUT_DIR")/src}
mkdir -p "$WORK_DIR"

# ---------------------------------------------------------------------------------------------- toolchain
missing=()
command -v cmake >/dev/null 2>&1 || missing+=(cmake)
{ command -v cc >/dev/null 2>&1 && command -v c++ >/dev/null 2>&1 && command -v make >/dev/null 2>&1; } \
    || missing+=(build-essential)
if ((${#missing[@]})); then
    log "missing: ${missing[*]}; trying apt-get"
    SUDO=()
    if [[ $(id -u) -ne 0 ]]; then
        if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then SUDO=(sudo -n); else
            die "need ${missing[*]} (apt-get install -y cmake build-essential) and cannot run apt-get as root"
        fi
    fi
    command -v apt-get >/dev/null 2>&1 || die "need ${missing[*]} and there is no apt-get; install them first"
    "${SUDO[@]}" apt-get update -qq && DEBIAN_FRONTEND=noninteractive "${SUDO[@]}" apt-get install -y -qq \
        cmake build-essential || die "apt-get install cmake build-essential failed; install them first"
fi
command -v cmake >/dev/null 2>&1 || die "cmake is still missing"
command -v c++ >/dev/null 2>&1 || die "a C++ compiler is still missing"
log "cmake: $(cmake --version | head -1); compiler: $(c++ --version | head -1)"

# ---------------------------------------------------------------------------------------------- source
spec=llama-cpp-python${LLAMA_CPP_PYTHON_VERSION:+==$LLAMA_CPP_PYTHON_VERSION}
sdist=$(ls -t "$WORK_DIR"/llama_cpp_python-*.tar.gz 2>/dev/null | head -1 || true)
if [[ -n ${LLAMA_CPP_PYTHON_VERSION:-} && $sdist != *"-$LLAMA_CPP_PYTHON_VERSION.tar.gz" ]]; then sdist=; fi
if [[ -z $sdist ]]; then
    log "downloading the $spec sdist with $PYTHON -m pip"
    "$PYTHON" -m pip download --no-deps --no-binary :all: "$spec" -d "$WORK_DIR" \
        || die "pip download of the $spec sdist failed"
    sdist=$(ls -t "$WORK_DIR"/llama_cpp_python-*.tar.gz 2>/dev/null | head -1 || true)
    [[ -n $sdist ]] || die "pip download left no llama_cpp_python-*.tar.gz in $WORK_DIR"
fi
log "sdist: $sdist"
name=$(basename "$sdist" .tar.gz)
if [[ ! -d $WORK_DIR/$name ]]; then
    log "unpacking into $WORK_DIR/$name"
    tar -xzf "$sdist" -C "$WORK_DIR"
fi
src=$WORK_DIR/$name/vendor/llama.cpp
if [[ ! -f $src/CMakeLists.txt ]]; then
    src=$(dirname "$(find "$WORK_DIR/$name" -path '*/vendor/llama.cpp/CMakeLists.txt' -print -quit)")
fi
[[ -f $src/CMakeLists.txt && -d $src/tools/server ]] || die "no vendored llama.cpp (with tools/server) in $sdist"
commit=$(git -C "$src" log -1 --format='%h %cs' 2>/dev/null || echo unknown)
log "llama.cpp source: $src (commit $commit)"

# ---------------------------------------------------------------------------------------------- build
flags=""
if grep -q amx_tile /proc/cpuinfo 2>/dev/null; then
    flags="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    log "this CPU has AMX: building with $flags (GCC 12 miscompiles the AMX tile config)"
fi
if [[ -n ${EXTRA_FLAGS:-} ]]; then
    flags="$flags $EXTRA_FLAGS"
    log "extra compiler flags: $EXTRA_FLAGS"
fi
build=$src/build-server${EXTRA_FLAGS:+-$(printf '%s' "$EXTRA_FLAGS" | tr -c 'A-Za-z0-9' '_')}
log "configuring in $build"
cmake -S "$src" -B "$build" \
    -DCMAKE_BUILD_TYPE=Release \
    -DBUILD_SHARED_LIBS=OFF \
    -DGGML_NATIVE=ON \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON \
    -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF \
    -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF \
    -DCMAKE_C_FLAGS="$flags" -DCMAKE_CXX_FLAGS="$flags"
log "building ${TOOLS[*]} with -j$JOBS (several minutes on 2 cores)"
start=$SECONDS
cmake --build "$build" --config Release -j"$JOBS" --target "${TOOLS[@]}"
log "built in $((SECONDS - start)) s"

for exe in "${TOOLS[@]}"; do
    bin=$(find "$build" -type f -name "$exe" -perm -u+x -print -quit)
    [[ -n $bin ]] || die "the build produced no $exe"
    install -m 0755 "$bin" "$OUT_DIR/$exe"
done
log "installed into $OUT_DIR:"
"$OUT_DIR/${TOOLS[0]}" --version 2>&1 | sed 's/^/    /' || true
log "done"
