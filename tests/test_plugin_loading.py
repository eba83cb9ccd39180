"""The entry point as vLLM loads it, in fresh processes (no engine needed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

PROBE = """
import json, sys
import vllm.plugins
vllm.plugins.load_general_plugins()
vllm.plugins.load_general_plugins()  # vLLM may call it again: register() is re-entrant
from vllm_nnsight_plugin.boundary import patching
finder = any(type(f).__name__ == "_PostImportFinder" for f in sys.meta_path)
heavy_before = "vllm.v1.worker.gpu_model_runner" in sys.modules
import vllm.v1.worker.gpu_model_runner as runner
import vllm.v1.core.sched.scheduler as sched
import vllm.v1.engine.input_processor as inp
print(json.dumps({
    "heavy_imported_by_plugin": heavy_before,
    "finder": finder,
    "runner": patching.is_patched(runner.GPUModelRunner, "execute_model"),
    "scheduler": patching.is_patched(sched.Scheduler, "update_from_output"),
    "frontend": patching.is_patched(inp.InputProcessor, "process_inputs"),
    "double_wrapped": hasattr(runner.GPUModelRunner.execute_model.__nnsight_original__, "__nnsight_wrapped__")
        if patching.is_patched(runner.GPUModelRunner, "execute_model") else False,
}))
"""


def _probe(disable: bool) -> dict:
    env = dict(os.environ)
    env.pop("VLLM_NNSIGHT_DISABLE", None)
    if disable:
        env["VLLM_NNSIGHT_DISABLE"] = "1"
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_entry_point_is_registered():
    from importlib.metadata import entry_points

    eps = [ep for ep in entry_points(group="vllm.general_plugins") if ep.value.startswith("vllm_nnsight_plugin")]
    assert [ep.value for ep in eps] == ["vllm_nnsight_plugin.plugin:register"]


@pytest.mark.parametrize("disable", [False, True])
def test_plugin_patches_lazily_and_disable_switches_it_off(disable):
    got = _probe(disable)
    assert got["heavy_imported_by_plugin"] is False  # nothing heavy at load
    if disable:
        assert got == {"heavy_imported_by_plugin": False, "finder": False, "runner": False,
                       "scheduler": False, "frontend": False, "double_wrapped": False}
    else:
        assert got["finder"] and got["runner"] and got["scheduler"] and got["frontend"]
        assert not got["double_wrapped"]
