#!/bin/bash
# Stage CUDA vLLM 0.26.0 + what this package needs for the lent H200 machine, in one run.
# Output: DEST/vllm_site.tar.xz (~53 MB: vllm and the deps the machine lacks, pruned of kernels
# dense models on Hopper never load), DEST/stage.sh, DEST/extra/*.whl (greenlet, jsonschema...).
# Needs python3.12 here (pyenv has one) and xz.  Usage: bash benchmarks/gpu/build_bundle.sh .whl
# Then, on the device (carry DEST):  bash benchmarks/gpu/remote.sh tests|headline|profile
set -euo pipefail
DEST=${1:?usage: build_bundle.sh DEST}; mkdir -p "$DEST/extra"; DEST=$(cd "$DEST" && pwd)
W=${WORK:-/tmp/vllm_bundle}; HERE=$(cd "$(dirname "$0")" && pwd)
PY312=${PY312:-}; if [ -z "$PY312" ]; then for c in python3.12 $(ls -d "$(pyenv root 2>/dev/null)"/versions/3.12*/bin/python3.12 2>/dev/null); do "$c" -V >/dev/null 2>&1 && { PY312=$c; break; }; done; fi
[ -n "$PY312" ] || { echo "needs a python3.12 here (set PY312)"; exit 1; }
rm -rf "$W"; mkdir -p "$W/wheels"
PLAT="--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_24_x86_64
 --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_35_x86_64"
DL="python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $PLAT"
# what `pip install vllm==0.26.0` resolves, limited to what the device image lacks (see ../shared notes)
PKGS="vllm==0.26.0 annotated-types==0.8.0 apache-tvm-ffi==0.1.10 cachetools==8.0.2 cbor2==6.3.0
 fastapi==0.136.3 httpx2==2.16.2 httpcore2==2.16.2 jmespath==1.1.0 llguidance==1.7.6
 model-hosting-container-standards==0.1.16 msgspec==0.23.0 openai==3.57.0 openai-harmony==0.0.8
 opentelemetry-api==1.45.2 partial-json-parser==0.2.1.1.post7 pybase64==1.5.1 pydantic==2.14.4
 pydantic_core==2.50.5 pyzmq==27.3.0 sniffio==1.3.1 starlette==1.10.0 uvicorn==0.54.0 watchfiles==1.3.0
 xgrammar==0.2.7 prometheus-fastapi-instrumentator==8.1.0 python-multipart==0.0.34 typing-inspection==0.4.5"
$DL -d "$W/wheels" $PKGS
# this package's own runtime needs that the device image lacks (installed by remote.sh)
$DL -d "$DEST/extra" greenlet==3.5.6 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 \
    referencing==0.37.0 rpds-py==2026.9.1 truststore==0.10.5 py-spy==0.4.3
# (truststore: the openai client in tests; py-spy: spy_user_way.py samples vLLM's processes)
"$PY312" -m pip install -q --no-deps --no-compile --no-cache-dir --target "$W/site" "$W"/wheels/*.whl
cd "$W/site"
# prune: FA2 (Hopper uses FA3), MoE kernels, the Rust frontend, Blackwell FMHA sources, deep_gemm
# builds for other Pythons, console scripts; keep sm_90 cubins + all PTX in the main kernel library
rm -rf bin vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so vllm/_moe_C_stable_libtorch.abi3.so vllm/vllm-rs \
       vllm/third_party/fmha_sm100 vllm/third_party/deep_gemm/_C.cpython-31[0134]-*.so
python3 "$HERE/prune_fatbin.py" vllm/_C_stable_libtorch.abi3.so --keep 90 | tail -1
cd "$W"; tar cf - site | xz -9 -T0 > "$DEST/vllm_site.tar.xz"
cp "$HERE/stage.sh" "$DEST/stage.sh"
# the anchor harness (row 6: nnsight 0.8.1's VLLM with taps, same run): ANCHORS=1
if [ "${ANCHORS:-0}" = 1 ]; then
  mkdir -p "$DEST/anchors"
  $DL -d "$DEST/anchors" nnsight==0.8.1 greenlet==3.5.6 websocket-client==1.9.2 zstandard==0.25.0
  cp "$HERE"/../../../shared/gpu/anchors/*.py "$HERE"/../../../shared/gpu/anchors/run_all.sh "$DEST/anchors/"
fi
ls -l "$DEST/vllm_site.tar.xz" "$DEST/extra"
