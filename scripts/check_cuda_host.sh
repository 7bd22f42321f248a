#!/usr/bin/env bash
# Type-checks the CUDA builds' host C++ (the K25_WITH_CUDA parts of cpp/) on a machine with
# the CUDA toolkit but a CPU build of torch, which ships the ATen/c10 CUDA headers but not
# the CUDA libraries' headers: those few (cuBLAS, cuSPARSE, cuSOLVER handles and status
# types) are declared here as opaque stubs, enough for torch's headers to parse. Nothing is
# linked or run; the device build (bench/gpu/run_all.sh) stays the real check.
#   bash scripts/check_cuda_host.sh [file.cpp ...]   (default: cuda_glue.cpp and every cpp/ file
#                                                     using K25_WITH_CUDA)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
T=$("$PY" -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "include"))')
# shellcheck disable=SC2207
extra=($("$PY" -c 'import pybind11, sysconfig; print("-isystem", pybind11.get_include(), "-isystem", sysconfig.get_paths()["include"])'))
CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")}
[ -f "$CUDA_HOME/include/cuda_runtime.h" ] || CUDA_HOME=$(ls -d /usr/local/cuda* 2>/dev/null | head -1)
stub=$(mktemp -d)
trap 'rm -rf "$stub"' EXIT
mkdir -p "$stub/c10/cuda/impl"
echo '#pragma once' > "$stub/c10/cuda/impl/cuda_cmake_macros.h"
printf '#pragma once\ntypedef struct cusparseContext* cusparseHandle_t;\ntypedef int cusparseStatus_t;\n' > "$stub/cusparse.h"
printf '#pragma once\n#include <cuda_runtime.h>\ntypedef struct cublasContext* cublasHandle_t;\ntypedef int cublasStatus_t;\n' \
  > "$stub/cublas_v2.h"
printf '#pragma once\ntypedef struct cublasLtContext* cublasLtHandle_t;\n' > "$stub/cublasLt.h"
printf '#pragma once\ntypedef struct cusolverDnContext* cusolverDnHandle_t;\n' > "$stub/cusolverDn.h"
printf '#pragma once\ntypedef int cusolverStatus_t;\n' > "$stub/cusolver_common.h"
files=("$@")
[ ${#files[@]} -eq 0 ] && mapfile -t files < <(echo cpp/model/cuda_glue.cpp; grep -rl "K25_WITH_CUDA" cpp --include=*.cpp)
rc=0
for f in "${files[@]}"; do
  if c++ -DK25_WITH_CUDA -Icpp/include -Icpp -Icuda -isystem "$stub" -isystem "$CUDA_HOME/include" -isystem "$T" \
      -isystem "$T/torch/csrc/api/include" "${extra[@]}" -std=gnu++20 -march=native -fsyntax-only -Wall -Wextra -Wno-unused-parameter "$f"; then
    echo "ok   $f"
  else
    echo "FAIL $f"; rc=1
  fi
done
exit $rc
