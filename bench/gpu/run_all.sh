#!/usr/bin/env bash
# One call on the GPU machine: build k25 with CUDA once, run tests/cuda, then the GPU
# benchmarks. Results and logs go to $OUT. Extra arguments go to pytest.
#   bash bench/gpu/run_all.sh [-k expr]
# K25_SKIP_TESTS=1 skips tests/cuda; K25_ATTN_BENCH=1, K25_SPARSE_BENCH=1, K25_SPARSE_MODEL=1, K25_BENCH=1,
# K25_TIER_BENCH=1, K25_LONGEST=1 and K25_PROBE=1 (carried probe/ binaries) run the benchmarks.
# K25_EXTRA="command" runs a command of its own last, in this environment (output in $OUT/extra.log).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/k25-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# Wheels carried in .whl/ (packages the GPU image lacks, e.g. gguf).
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
# The default model, carried in parts that fit the working-tree limit.
if [ "$(ls .devcache/smollm2.part* 2>/dev/null | wc -l)" -ge 2 ]; then
  cat .devcache/smollm2.part* > /tmp/smollm2.gguf && export K25_DEFAULT_MODEL_PATH=/tmp/smollm2.gguf
  ls -la /tmp/smollm2.gguf
elif [ -f /tmp/smollm2.gguf ]; then  # joined by an earlier call on this (still warm) machine
  export K25_DEFAULT_MODEL_PATH=/tmp/smollm2.gguf
fi
# transformers reads a GGUF only through the gguf package (the oracle of test_cuda_model's bf16 case).
if [ -n "${K25_DEFAULT_MODEL_PATH:-}" ] && ! python3 -c "import gguf" 2>/dev/null; then
  echo "WARNING: the default GGUF is here but gguf is not importable (carry .whl): transformers cannot load it"
fi
# The probes, carried packed (prepare_carry.sh): ~30 MB of binaries in ~1.5 MB.
[ -f probe.tar.xz ] && tar xJf probe.tar.xz
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, torch.version.cuda)" | tee -a "$OUT/gpu.txt"
start=$(date +%s)
K25_CUDA=on K25_BUILD_JOBS=$(nproc) K25_CUDA_ARCHS=90a \
  python3 -m pip install --no-build-isolation --no-deps -e . > "$OUT/build.log" 2>&1
rc=$?
echo "build rc=$rc in $(( $(date +%s) - start )) s" | tee -a "$OUT/gpu.txt"
if [ $rc -ne 0 ]; then grep -E "error|Error" "$OUT/build.log" | head -40; tail -20 "$OUT/build.log"; exit $rc; fi
if [ "${K25_SKIP_TESTS:-0}" != "1" ]; then
  python3 -m pytest -q -p no:cacheprovider ${K25_TEST_PATHS:-tests/cuda} "$@" 2>&1 | tee "$OUT/tests.log" | tail -40
fi
if [ "${K25_ATTN_BENCH:-0}" = "1" ]; then
  # FlashInfer 0.2.14.post1 (the peer), carried as an sdist; it JIT-compiles its kernels.
  if ls .whl/flashinfer_python-*.tar.gz >/dev/null 2>&1 && ! python3 -c "import flashinfer" 2>/dev/null; then
    t0=$(date +%s)
    FLASHINFER_CUDA_ARCH_LIST=9.0a python3 -m pip install -q --no-deps --no-build-isolation --no-index \
      .whl/flashinfer_python-*.tar.gz > /tmp/flashinfer_install.log 2>&1
    rc=$?
    echo "flashinfer install rc=$rc in $(( $(date +%s) - t0 )) s" | tee -a "$OUT/gpu.txt"
    [ $rc -eq 0 ] || tail -20 /tmp/flashinfer_install.log  # ($OUT brings back 8 files at most)
  fi
  FLASHINFER_CUDA_ARCH_LIST=9.0a MAX_JOBS=$(nproc) python3 bench/gpu/attention_bench.py \
    --json "$OUT/attention_bench.json" ${K25_ATTN_ARGS:-} 2>&1 | grep -v Warning | tee "$OUT/attention_bench.log"
fi
if [ "${K25_PROBE:-0}" = "1" ] && ls probe/*_probe_* >/dev/null 2>&1; then
  # The attention kernels alone (binaries built on the CPU box by bench/gpu/build_probe.sh,
  # probe/ carried), in the same call as attention_bench's figures for the same kernels.
  bash bench/gpu/probe_run.sh ${K25_PROBE_LENS:-16384} 2>&1 | tee "$OUT/probe_run.log" | tail -12
fi
if [ "${K25_SPARSE_BENCH:-0}" = "1" ]; then
  python3 bench/gpu/sparse_attention_bench.py --json "$OUT/sparse_attention_bench.json" 2>&1 | grep -v Warning \
    | tee "$OUT/sparse_attention_bench.log"
fi
if [ "${K25_SPARSE_MODEL:-0}" = "1" ]; then
  # Issue #5 end to end: the 8B shape (random bf16 weights), B1 / B8 at 8K-128K, dense and caps 0.6 / 0.8.
  # K25_SPARSE_MODEL_ARGS replaces the defaults (e.g. "--layers 8 --path /tmp/llama8b-8l" fits B8 @ 128K).
  python3 bench/gpu/sparse_model_bench.py --json "$OUT/sparse_model_bench.json" ${K25_SPARSE_MODEL_ARGS:-} 2>&1 \
    | grep -v Warn | tee "$OUT/sparse_model_bench.log"
fi
if [ "${K25_TIER_BENCH:-0}" = "1" ]; then
  # Tiered KV on CUDA (issue #6): swap-in vs recompute of a preempted 8K sequence; then cold
  # blocks, the default model at 8K with L1 a fraction of what it needs, the rest read in
  # place in pinned L2 (graphs on, then every step eager unless K25_COLD_EAGER=0).
  # K25_SWAP=0 skips the swap bench; K25_COLD_ARGS (e.g. "--sparse --max-moves 2": on CUDA
  # with sparsity the predictor knobs are a ConfigError) replaces "--max-moves 0 2".
  [ "${K25_SWAP:-1}" = "1" ] && python3 bench/preempt_swap.py --device cuda 2>&1 | grep -v Warn | tee -a "$OUT/tiers.log"
  for f in ${K25_COLD_FRACTIONS:-0.25 0.9}; do
    python3 bench/cpu_long_context.py --device cuda --l1-fraction "$f" ${K25_COLD_ARGS:---max-moves 0 2} 2>&1 \
      | grep -v Warn | sed "s/^/[L1 $f, graphs] /" | tee -a "$OUT/tiers.log"
    [ "${K25_COLD_EAGER:-1}" = "1" ] || continue
    K25_DISABLE_CUDA_GRAPHS=1 python3 bench/cpu_long_context.py --device cuda --l1-fraction "$f" \
      ${K25_COLD_ARGS:-} 2>&1 | grep -v Warn | sed "s/^/[L1 $f, eager] /" | tee -a "$OUT/tiers.log"
  done
fi
if [ "${K25_LONGEST:-0}" = "1" ]; then
  # The longest context served at batch 1 with L1 a quarter of what it needs (issue #6): the
  # Llama-3.1-8B shape (random bf16 weights) at K25_LONGEST_TOKENS (default: its 128K positions),
  # dense, then sparse; 3/4 of the blocks cold in pinned L2. Same process: all resident first.
  [ -f /tmp/llama8b-random/config.json ] || python3 -c "import sys; sys.path.insert(0, 'bench/gpu'); \
from model_bench import write_checkpoint; write_checkpoint('/tmp/llama8b-random', 32)"
  for mode in "" "--sparse"; do
    python3 bench/cpu_long_context.py --device cuda --model /tmp/llama8b-random --tokens "${K25_LONGEST_TOKENS:-131000}" \
      --new 32 --l1-fraction 0.25 --max-moves 0 $mode 2>&1 | grep -v Warn | sed "s/^/[longest ${mode:-dense}] /" \
      | tee -a "$OUT/longest.log"
  done
fi
if [ "${K25_BENCH:-0}" = "1" ]; then
  python3 bench/gpu/model_bench.py --json "$OUT/model_bench.json" 2>&1 | grep -v Warning | tee "$OUT/model_bench.log"
  K25_DISABLE_CUDA_GRAPHS=1 python3 bench/gpu/model_bench.py --batches 1,32 --no-reference --json "$OUT/model_bench_eager.json" 2>&1 | grep -E "decode|prefill" | sed "s/^/eager: /" | tee -a "$OUT/model_bench.log"
fi
if [ -n "${K25_EXTRA:-}" ]; then
  bash -c "$K25_EXTRA" 2>&1 | grep -v Warn | tee "$OUT/extra.log"
fi
