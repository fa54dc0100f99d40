#!/usr/bin/env bash
# One prepared GPU check for the Pallas FP8 kernels (Hopper: H100/H200); every step has a
# timeout, 10 minutes in all at most (each step also runs alone: python benchmarks/gpu_bench.py --part NAME).
# Needs jax 0.11.2 with CUDA plus chex, numpy, scipy, pytest already installed; no network.
# Run from anywhere; it works in the repository root:
#   bash benchmarks/gpu_check.sh                 # everything
#   WHEELS=/path/to/wheels bash benchmarks/gpu_check.sh   # first installs missing packages
#                                                          # from that local wheel directory only
#   bash benchmarks/gpu_check.sh --cpu-smoke     # CPU: tiny sizes, kernels in interpret mode
# Prints everything to stdout: (a) the kernel tests on the GPU (non-interpret), (b) forward
# timings against jax.nn.dot_product_attention (cudnn, xla), (c) the paper's Table 2 MSEs from the
# kernels and from the simulator, (d) a paper-size sweep (256 seeds, micro-batches of 8, 32, 128): instances/s
# and the fraction of the GPU's FP32 matmul rate on the same P·V products, (e) the FP8 MMA
# accumulator's mantissa bits fitted to the Mosaic kernel's outputs (the simulator's
# KernelConfig.mma_acc_bits model, 14 bits by assumption until this step has run on Hopper), (f) JAX's
# own cuDNN FP8 attention beside the cuDNN presets: which lazy-rescale threshold reproduces it, (g) the
# same attention fingerprinted from its outputs on designed probes (pcast_jax.fingerprint), (h) the
# P-collapse check (pcast_jax.testing) on both kernels, compiled, against the simulator's verdicts.
set -u -o pipefail
cd "$(dirname "$0")/.." || exit 2
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python}"
SMOKE=""
[ "${1:-}" = "--cpu-smoke" ] && SMOKE="--cpu-smoke"
status=0

if [ -n "${WHEELS:-}" ]; then
  echo "== installing from local wheels in $WHEELS (no index) =="
  "$PY" -m pip install --no-index --find-links "$WHEELS" pytest chex ml_dtypes || status=1
fi

echo "== environment =="
"$PY" -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__); print(jax.devices())" || status=1
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader

if [ -z "$SMOKE" ]; then
  echo
  echo "== (a) tests/test_pallas.py on the GPU (interpret-mode classes deselected) =="
  timeout 100 "$PY" -m pytest tests/test_pallas.py -q -p no:cacheprovider -k "not Interpret" -rs || status=1
fi

echo
echo "== (b) timing =="
timeout 75 "$PY" benchmarks/gpu_bench.py --part timing $SMOKE || status=1

echo
echo "== (c) Table 2 =="
timeout 75 "$PY" benchmarks/gpu_bench.py --part table2 $SMOKE || status=1

echo
echo "== (d) paper-size sweep: instances/s and fraction of the FP32 matmul rate =="
if [ -n "$SMOKE" ]; then
  timeout 120 "$PY" benchmarks/sweep_bench.py --steady-only --seeds 2 --repeats 1 --micro-batch 1,2 \
    --out /dev/null || status=1
else
  timeout 90 "$PY" benchmarks/sweep_bench.py --steady-only --seeds 256 --repeats 3 --micro-batch 8,32,128 \
    --out results/benchmark-gpu.json || status=1
fi

echo
echo "== (e) FP8 MMA accumulator: fit mma_acc_bits (10..23, exact) to the Mosaic kernel's outputs =="
timeout 60 "$PY" benchmarks/gpu_bench.py --part mma $SMOKE || status=1

echo
echo "== (f) JAX's own FP8 attention (cuDNN) beside the cuDNN presets (tau = 0 / 4 nats) =="
timeout 60 "$PY" benchmarks/gpu_bench.py --part cudnn $SMOKE || status=1

echo
echo "== (g) fingerprint: JAX's cuDNN FP8 attention read from its outputs (scale_s 1 and 32) =="
timeout 100 "$PY" benchmarks/gpu_bench.py --part fingerprint $SMOKE || status=1

if [ -z "$SMOKE" ]; then
  echo
  echo "== (h) P-collapse check on both Pallas kernels, compiled (fwd_s1 fails, fa3 passes, as simulated) =="
  timeout 40 "$PY" -m pytest tests/test_testing.py -q -p no:cacheprovider -k pallas_kernels_get -rA || status=1
fi

echo
echo "gpu_check exit status: $status"
exit $status
