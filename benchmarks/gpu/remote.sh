#!/usr/bin/env bash
# Runs on the lent H200 machine from the repo root (carry .whl): stages CUDA vLLM 0.26.0
# and this package, then runs what is asked:
#   bash benchmarks/gpu/remote.sh tests      parity/taps tests on CUDA (NNSIGHT_GPU_TESTS picks files)
#   bash benchmarks/gpu/remote.sh headline [--variants a,b] [--reps N]
#   bash benchmarks/gpu/remote.sh user_way [--seconds S] [--pin] [--tensor-parallel-size N]   one trace, 256 invokes, default settings + taps
#   bash benchmarks/gpu/remote.sh profile [--taps] [--v1] [every_token_spec ...]
#   bash benchmarks/gpu/remote.sh spy [--workloads a,b] [--seconds S]   py-spy of vLLM's processes, user's way
#   bash benchmarks/gpu/remote.sh untraced [--kinds a,b] [--reps N]   untraced traffic counted per engine kind
#   bash benchmarks/gpu/remote.sh gather [--batches N]   the worker's every-token gather alone
#   bash benchmarks/gpu/remote.sh anchors     nnsight 0.8.1 taps (anchor harness) + stock graphs
#   bash benchmarks/gpu/remote.sh stage       only stage (then STAGED=1 for runs side by side)
set -euo pipefail
what="${1:?tests|headline}"; shift || true
# STAGED=1: an earlier call staged /tmp/site already (runs side by side must not both install)
[ "$what" = tests-staged ] && what=tests
cd .whl && source stage.sh && cd ..
export PYTHONPATH=/tmp/site          # not the repo root: the installed copy carries the entry point
if [ -z "${STAGED:-}" ]; then
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/extra/*.whl
python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site . 2>&1 | grep -v WARNING || true
fi
python3 -c "import vllm, vllm_nnsight_plugin, torch; print('vllm', vllm.__version__, 'torch', torch.__version__, torch.cuda.get_device_name())"
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
case "$what" in
  tests)  # (tests-both: V2 and V1 at once, one GPU each on a two-GPU machine)
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
  tests-both)
    # V2 and V1 side by side: one GPU each when two are visible, else one after the other
    # (and one after the other on every GPU for tests/test_tp.py)
    ngpu=$(python3 -c "import torch; print(torch.cuda.device_count())")
    extra=("$@"); export STAGED=1
    run_one() {  # $1 = value of VLLM_USE_V2_MODEL_RUNNER (1|0), $2 = GPU index
      CUDA_VISIBLE_DEVICES=$2 VLLM_USE_V2_MODEL_RUNNER=$1 VLLM_CACHE_ROOT=/tmp/vllm-cache-$1 \
        bash benchmarks/gpu/remote.sh tests-staged "${extra[@]}"; }
    if [ "$ngpu" -ge 2 ] && [[ "${NNSIGHT_GPU_TESTS:-}" != *test_tp* ]]; then
      run_one 1 0 > "$OUT/tests-v2.out" 2>&1 & run_one 0 1 > "$OUT/tests-v1.out" 2>&1 & wait
    else  # (one GPU; or tensor parallel tests, whose engines take two GPUs each)
      all=$(seq -s, 0 $((ngpu - 1)))
      run_one 1 "$all" > "$OUT/tests-v2.out" 2>&1; run_one 0 "$all" > "$OUT/tests-v1.out" 2>&1
    fi
    tail -3 "$OUT"/tests-v*.out ;;
  headline)
    python3 benchmarks/gpu/headline.py "$@" 2>&1 | tee "$OUT/headline.log" ;;
  user_way)  # (--engines ...,nnsight: nnsight 0.8.1 beside it, from .whl/anchors; see build_bundle.sh)
    if [ -d .whl/anchors ]; then
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site2 .whl/anchors/nnsight-*.whl \
        .whl/anchors/websocket_client-*.whl .whl/anchors/zstandard-*.whl 2>&1 | grep -v WARNING || true
      PYTHONPATH=benchmarks/gpu:$PYTHONPATH python3 -c "import headline; headline.make_config()"  # (then copied)
      python3 .whl/anchors/make_tok.py /tmp/models
    fi
    # the cores' NUMA nodes (where an engine is pinned moves its speed: README, Method)
    { lscpu 2>/dev/null | grep -iE "^(CPU\(s\)|Model name|NUMA)" || true; } | tee "$OUT/user_way.log"
    OUT="$OUT" python3 benchmarks/gpu/user_way.py "$@" 2>&1 | tee -a "$OUT/user_way.log" ;;
  untraced)  # untraced [--kinds ...] [--reps N]: stock, loaded, taps, nolanes counted side by side
    python3 benchmarks/gpu/untraced_compare.py "$@" 2>&1 | tee "$OUT/untraced.log" | grep -vE "^(INFO|WARNING)" | tail -60 ;;
  gather)
    python3 benchmarks/gpu/gather_bench.py "$@" 2>&1 | tee "$OUT/gather.log" ;;
  anchors)  # row 6 beside a stock-with-graphs reference (needs a bundle built with ANCHORS=1)
    # ANCHORS_GPU=i: the harness ends leftover GPU processes after each step; only on GPU i
    # (another job may run on the other GPU)
    sed "s/nvidia-smi --query-compute-apps/nvidia-smi ${ANCHORS_GPU:+--id=$ANCHORS_GPU} --query-compute-apps/" \
      .whl/anchors/run_all.sh > /tmp/anchors_run_all.sh
    AB_STEPS="${AB_STEPS:-stock_graph nn_taps}" OUT="$OUT" bash /tmp/anchors_run_all.sh 2>&1 \
      | tee "$OUT/anchors.log" | tail -40 ;;
  spy)  # spy [--workloads a,b] [--seconds S]: py-spy of each vLLM process, user's-way workloads
    # (spawn: the front end has touched CUDA by the time the engine starts)
    VLLM_WORKER_MULTIPROC_METHOD=spawn PATH=/tmp/site/bin:$PATH python3 benchmarks/gpu/spy_user_way.py "$@" > "$OUT/spy.txt" 2>&1 || true
    grep -vE "^(INFO|WARNING|\(EngineCore)" "$OUT/spy.txt" | tail -150 ;;
  profile)  # profile [--taps] [--v1] workload...: one engine, one file
    python3 benchmarks/gpu/profile_capture.py "$@" > "$OUT/profile.txt" 2>&1 || true
    grep -E "^(=====|wall:|kernels:|CUDA syncs)" "$OUT"/profile.txt || tail -20 "$OUT"/profile.txt ;;
esac
