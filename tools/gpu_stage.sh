#!/usr/bin/env bash
# Prepare ./.gpu/ for a GPU machine that has torch but lacks some of megazoo's dependencies
# (typically DeepSpeed and the small packages it needs, and megatron-core for the peer rows
# of bench/mcore_peer.py), and may have no network access.
#
#   bash tools/gpu_stage.sh [PACKAGE==VERSION ...]        # here, from the repository root
#   source .gpu/setup.sh && python -m bench.zero_bench    # there, after copying .gpu/ along
#
# Wheels are downloaded for the GPU machine's Python (GPU_PYTHON, default 3.12) on manylinux
# x86_64; versions default to the ones installed here, so both machines run the same
# DeepSpeed. DeepSpeed is published as a source archive only: it is built here into a
# pure-Python wheel (its C++/CUDA ops are compiled on first use on the GPU machine).
# libaio (runtime and headers, Debian packages fetched with `apt-get download`) is staged
# too: DeepSpeed's async_io op (ZeRO-Infinity's nvme offload) compiles against it; setup.sh
# unpacks it under /tmp (never /) and points the compiler and loader there.
# .gpu/ is git-ignored.
set -euo pipefail
cd "$(dirname "$0")/.."
py_version="${GPU_PYTHON:-3.12}"
wheels=.gpu/wheels
mkdir -p "$wheels"

installed() {  # the version of $1 installed here, or the fallback $2
  python3 -c "import importlib.metadata as m, sys
try: print(m.version(sys.argv[1]))
except m.PackageNotFoundError: print(sys.argv[2])" "$1" "$2"
}

# DeepSpeed's runtime dependencies that GPU images commonly lack (torch, numpy, etc. are there).
deps=(
  "hjson==$(installed hjson 3.1.0)"
  "pydantic==$(installed pydantic 2.13.4)"
  "pydantic-core==$(installed pydantic_core 2.46.4)"
  "annotated-types==$(installed annotated-types 0.7.0)"
  "typing-inspection==$(installed typing-inspection 0.4.2)"
  # the megatron-core peer of bench/mcore_peer.py (its local spec: no apex, no TE)
  "megatron-core==0.19.2"
  "packaging==$(installed packaging 25.0)"
)
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64)
python3 -m pip download --quiet --no-deps --only-binary=:all: --implementation cp \
  --python-version "$py_version" "${platforms[@]}" -d "$wheels" "${deps[@]}" "$@"

ds_version="$(installed deepspeed 0.19.8)"
if ! ls "$wheels"/deepspeed-"$ds_version"-*.whl >/dev/null 2>&1; then
  # --no-build-isolation: DeepSpeed's setup.py imports torch to decide which ops to prebuild.
  DS_BUILD_OPS=0 python3 -m pip wheel --quiet --no-deps --no-build-isolation -w "$wheels" \
    "deepspeed==$ds_version"
fi

# libaio1 holds libaio.so.1, libaio-dev the header and the libaio.so link. Ubuntu 24.04
# renamed the runtime libaio1t64; either gives the same library.
debs=.gpu/debs
mkdir -p "$debs"
if ! ls "$debs"/libaio-dev_*.deb >/dev/null 2>&1; then
  runtime=libaio1
  apt-cache show libaio1 >/dev/null 2>&1 || runtime=libaio1t64
  (cd "$debs" && apt-get download "$runtime" libaio-dev)
fi

cat > .gpu/setup.sh <<'SETUP'
# Source from the repository root on the GPU machine: installs the staged wheels into
# /tmp/megazoo-site (no index, no network) and puts them and the repository on PYTHONPATH.
python3 -m pip install --quiet --no-index --no-deps --no-cache-dir --upgrade \
  --target /tmp/megazoo-site .gpu/wheels/*.whl
export PYTHONPATH="$PWD:/tmp/megazoo-site${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
# libaio for DeepSpeed's async_io op: unpacked under /tmp; gcc reads CPATH / LIBRARY_PATH
# (DeepSpeed's compatibility check compiles and links a test program calling io_submit, its
# JIT build links -laio), the loader LD_LIBRARY_PATH (libaio.so.1 at import).
aio=/tmp/megazoo-libaio
for deb in .gpu/debs/*.deb; do [ -e "$deb" ] && dpkg-deb -x "$deb" "$aio"; done
if [ -f "$aio/usr/include/libaio.h" ]; then
  aio_lib="$(dirname "$(find "$aio" -name 'libaio.so*' -print -quit)")"
  export CPATH="$aio/usr/include${CPATH:+:$CPATH}"
  export LIBRARY_PATH="$aio_lib${LIBRARY_PATH:+:$LIBRARY_PATH}"
  export LD_LIBRARY_PATH="$aio_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
# NVLink multicast (NVLS) off: some shared multi-GPU hosts do not allow it.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
SETUP
echo "staged in $wheels: $(ls "$wheels" | tr '\n' ' ')"
echo "staged in $debs: $(ls "$debs" | tr '\n' ' ')"
echo "copy .gpu/ to the GPU machine's checkout, then run: source .gpu/setup.sh && <command>"
