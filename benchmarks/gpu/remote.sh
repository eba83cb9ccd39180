#!/usr/bin/env bash
# Runs on the lent H200 machine from the repo root (carry .whl): stages CUDA vLLM 0.26.0
# and this package, then runs what is asked:
#   bash benchmarks/gpu/remote.sh tests      parity/taps tests on CUDA (NNSIGHT_GPU_TESTS picks files)
#   bash benchmarks/gpu/remote.sh headline [--variants a,b] [--reps N]
#   bash benchmarks/gpu/remote.sh profile [plain prefill every_token]
#   bash benchmarks/gpu/remote.sh anchors     nnsight 0.8.1 taps (anchor harness) + stock graphs
set -euo pipefail
what="${1:?tests|headline}"; shift || true
cd .whl && source stage.sh && cd ..
export PYTHONPATH=/tmp/site          # not the repo root: the installed copy carries the entry point
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/extra/*.whl
python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site . 2>&1 | grep -v WARNING || true
python3 -c "import vllm, vllm_nnsight_plugin, torch; print('vllm', vllm.__version__, 'torch', torch.__version__, torch.cuda.get_device_name())"
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
case "$what" in
  tests)
    # several engines and servers share the GPU; the taps tests run vLLM's default
    # compilation (compiled, piecewise + full CUDA graphs). VLLM_USE_V2_MODEL_RUNNER picks
    # the runner (unset: vLLM's default, V2 for these models).
    export NNSIGHT_TEST_ENGINE_KWARGS='{"gpu_memory_utilization": 0.12}'
    export NNSIGHT_TEST_SERVER_ARGS='["--gpu-memory-utilization", "0.12"]'
    export NNSIGHT_TEST_TAPS_COMPILATION='{}'
    if [ "${VLLM_USE_V2_MODEL_RUNNER:-}" = "0" ]; then export NNSIGHT_TEST_EXPECT_RUNNER=v1; else export NNSIGHT_TEST_EXPECT_RUNNER=v2; fi
    # the test process touches CUDA after its first engine: later engines must spawn
    export VLLM_WORKER_MULTIPROC_METHOD=spawn
    # exact fp32 for the HF comparison: Triton kernels (vLLM's fp32 attention on Hopper)
    # use TF32 dots by default, ~2.5e-3 off a CPU fp32 reference
    export TRITON_F32_DEFAULT="${TRITON_F32_DEFAULT:-ieee}"
    # shellcheck disable=SC2086
    python3 -m pytest -q -p no:cacheprovider ${NNSIGHT_GPU_TESTS:-tests/test_parity_llama.py \
      tests/test_parity_gpt2.py tests/test_engine_isolation.py tests/test_gpu_bf16.py tests/test_taps.py} "$@" 2>&1 \
      | tee "$OUT/tests-$NNSIGHT_TEST_EXPECT_RUNNER.log" | tail -40 ;;
  headline)
    python3 benchmarks/gpu/headline.py "$@" 2>&1 | tee "$OUT/headline.log" ;;
  anchors)  # row 6 beside a stock-with-graphs reference (needs a bundle built with ANCHORS=1)
    AB_STEPS="${AB_STEPS:-stock_graph nn_taps}" OUT="$OUT" bash .whl/anchors/run_all.sh 2>&1 \
      | tee "$OUT/anchors.log" | tail -40 ;;
  profile)
    for w in "${@:-plain prefill every_token}"; do
      for x in $w; do python3 benchmarks/gpu/profile_capture.py "$x" > "$OUT/profile_$x.txt" 2>&1 || true; done
    done ;;
esac
