#!/usr/bin/env bash
# Build Horovod from its PyPI sdist (once) and install it into the Python given by $PYTHON.
#
# Why a script: Horovod 0.28.1 is the last release and its CMake pins C++14, while torch >= 2.1
# headers need C++17 (fixed upstream in horovod PR #3998, never released). We patch the
# standard in the unpacked sdist (and need CMake < 4: its bundled gloo asks for CMake < 3.5 compatibility) and build without isolation so the build sees the installed
# torch. We also close its elastic rendezvous hole (CVE-2024-10190, unfixed upstream; see
# tools/patch_horovod_rendezvous.py and docs/security.md). The wheel is cached, keyed by Horovod,
# torch, Python, GPU operations and the patch's revision, so a second `make install`, CI and the
# Docker images reuse it. The Makefile and both Dockerfiles call this.
#
# Environment:
#   PYTHON                  interpreter of the target environment (default: python3)
#   HOROVOD_VERSION         sdist version (default: 0.28.1)
#   HVD_CACHE               wheel cache folder (default: ${XDG_CACHE_HOME:-$HOME/.cache}/hvd_averaging)
#   HOROVOD_GPU_OPERATIONS  set to NCCL for a CUDA build (GPU image); unset for CPU (MPI + Gloo)
set -euo pipefail

PYTHON=${PYTHON:-python3}
HOROVOD_VERSION=${HOROVOD_VERSION:-0.28.1}
HVD_CACHE=${HVD_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/hvd_averaging}
GPU_OPS=${HOROVOD_GPU_OPERATIONS:-}

torch_version=$("$PYTHON" -c 'import torch; print(torch.__version__)')
py_tag=$("$PYTHON" -c 'import sys; print("py%d%d" % sys.version_info[:2])')
variant=${GPU_OPS:-cpu}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
patch_revision=$("$PYTHON" "$here/patch_horovod_rendezvous.py" --revision)
key="horovod-${HOROVOD_VERSION}-torch${torch_version//+/_}-${py_tag}-${variant,,}-${patch_revision}"
wheel_dir="$HVD_CACHE/wheels/$key"

installed=$("$PYTHON" - <<PY 2>/dev/null || true
import importlib.metadata as md, json, pathlib
try:
    print(md.version("horovod"))
except md.PackageNotFoundError:
    pass
PY
)
stamp="$("$PYTHON" -c 'import sys; print(sys.prefix)')/.horovod-build-key"
if [[ "$installed" == "$HOROVOD_VERSION" && -f "$stamp" && "$(cat "$stamp")" == "$key" ]]; then
    echo "build_horovod: horovod $installed already installed for $key"
    exit 0
fi

if ! compgen -G "$wheel_dir/horovod-*.whl" >/dev/null; then
    echo "build_horovod: building $key (a few minutes, once)"
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    "$PYTHON" -m pip download --no-deps --no-binary :all: "horovod==$HOROVOD_VERSION" -d "$work"
    tar -xzf "$work"/horovod-"$HOROVOD_VERSION".tar.gz -C "$work"
    src="$work/horovod-$HOROVOD_VERSION"
    # torch's headers need C++17; 0.28.1 pins 14 in these two files.
    sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' \
        "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt"
    grep -q 'CMAKE_CXX_STANDARD 17' "$src/CMakeLists.txt"
    grep -q 'CMAKE_CXX_STANDARD 17' "$src/horovod/torch/CMakeLists.txt"
    "$PYTHON" "$here/patch_horovod_rendezvous.py" "$src"
    export HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_MPI=1 HOROVOD_WITH_GLOO=1
    export HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1
    export MAKEFLAGS="${MAKEFLAGS:--j$(nproc)}"
    if [[ -n "$GPU_OPS" ]]; then
        export HOROVOD_GPU_OPERATIONS="$GPU_OPS"
    fi
    mkdir -p "$wheel_dir"
    "$PYTHON" -m pip wheel --no-deps --no-build-isolation -w "$work/dist" "$src"
    mv "$work"/dist/horovod-*.whl "$wheel_dir/"
fi

"$PYTHON" -m pip install --no-deps --force-reinstall "$wheel_dir"/horovod-*.whl
# Horovod's own runtime dependencies (the wheel was installed without them).
"$PYTHON" -m pip install cloudpickle psutil pyyaml packaging
echo "$key" > "$stamp"
echo "build_horovod: installed $key"
