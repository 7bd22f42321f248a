#!/usr/bin/env bash
# Prepares, on this CPU box, what the GPU calls carry (all ignored paths):
#   .whl/       FlashInfer 0.2.14.post1's sdist (attention_bench's peer; JIT-built there) and
#               the gguf wheel (tests/cuda read the default GGUF's metadata with it)
#   .devcache/  the default GGUF (98 MB) in two parts, since one call carries at most 64 MiB
#   probe.tar.xz  the kernel probes (bench/gpu/build_probe.sh), packed; run_all.sh unpacks it
# and prints the two calls that bring it all over: the first parks part a in /tmp on the
# machine, the second (within the machine's 30 s warm window) carries part b and runs.
#   bash bench/gpu/prepare_carry.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
mkdir -p .whl .devcache
# The sdist (its metadata is prepared with this environment's packages: with build
# isolation pip would try to build numpy and torch for it).
ls .whl/flashinfer_python-0.2.14.post1.tar.gz >/dev/null 2>&1 ||
  "$PY" -m pip download -q --no-deps --no-binary=:all: --no-build-isolation -d .whl flashinfer-python==0.2.14.post1
ls .whl/gguf-*.whl >/dev/null 2>&1 ||
  "$PY" -m pip download -q --no-deps --only-binary=:all: -d .whl "gguf==$("$PY" -c 'import gguf, importlib.metadata as m; print(m.version("gguf"))')"
gguf=$("$PY" -c 'from k25.model import resolve_model_path; print(resolve_model_path("smollm2-135m-instruct"))')
rm -f .devcache/smollm2.part*
split -n 2 -d -a 1 "$gguf" .devcache/smollm2.part  # .devcache/smollm2.part0, .part1
ls probe/*_probe_* >/dev/null 2>&1 || bash bench/gpu/build_probe.sh >/dev/null
# Packed: the binaries share their static runtime, ~30 MB of them become ~1.5 MB.
tar cJf probe.tar.xz probe
du -sh .whl .devcache/* probe.tar.xz
cat <<'MSG'
Call 1 (carry [".devcache/smollm2.part0"]):  cp .devcache/smollm2.part0 /tmp/
Call 2 (carry [".devcache/smollm2.part1", ".whl", "probe.tar.xz"], right after):
  cp /tmp/smollm2.part0 .devcache/ && K25_ATTN_BENCH=1 K25_PROBE=1 bash bench/gpu/run_all.sh
MSG
