"""The pluggy extension points, as a third party uses them: a package of its own,
found through the ``vllm_nnsight_plugin`` entry-point group, in a fresh process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

THIRD_PARTY = '''
from vllm_nnsight_plugin.hookspecs import hookimpl


@hookimpl
def nnsight_payload_policy(kind, origin, settings):
    if kind == "code":
        return "this site runs JSON specs only (site policy)"
    return None


@hookimpl
def nnsight_arch_adapter(architecture):
    if architecture == "LlamaForCausalLM":
        from vllm_nnsight_plugin.builtin_hooks import ArchAdapter
        return ArchAdapter("model.layers", True, "site.norm", "lm_head")  # (the builtin says model.norm)
    if architecture == "SiteForCausalLM":
        from vllm_nnsight_plugin.builtin_hooks import ArchAdapter
        return ArchAdapter("model.layers", False, "model.site_norm", "lm_head")
    return None
'''

PROBE = '''
import json
import sys

from vllm_nnsight_plugin import VLLM
from vllm_nnsight_plugin.hooks import arch_adapter, refusal


def stage_zero_absent():
    """The engine's pipeline-stage placement of a model whose final norm is registered
    before its layers: the third party's adapter puts it on the last stage."""
    import torch
    from vllm.model_executor.models.utils import PPMissingLayer

    from vllm_nnsight_plugin.boundary.parallel import absent_modules

    class SiteForCausalLM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = torch.nn.Module()
            self.model.site_norm = torch.nn.LayerNorm(2)
            self.model.layers = torch.nn.ModuleList([torch.nn.Linear(2, 2), PPMissingLayer()])
            self.lm_head = PPMissingLayer()

    return absent_modules(SiteForCausalLM(), position=(True, False))


def main():
    found = {"refusal": refusal("code", "python"), "spec": refusal("spec", "http"),
             "adapter": arch_adapter("LlamaForCausalLM").final_norm, "stage_zero_absent": stage_zero_absent()}
    model = VLLM(sys.argv[1], dispatch=True, dtype="float32", max_model_len=256)
    try:
        with model.trace("Hello", max_tokens=1):
            h = model.model.layers[0].output.save()
        found["traced"] = "ran"
    except Exception as exc:
        found["traced"] = f"{type(exc).__name__}: {exc}"
    model.shutdown()
    print("RESULT " + json.dumps(found))


if __name__ == "__main__":  # (vLLM's engine processes import this file again)
    main()
'''


def _install(root: Path) -> None:
    """A distribution on disk with an entry point in the project's group."""
    (root / "site_policy.py").write_text(textwrap.dedent(THIRD_PARTY))
    info = root / "site_policy-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: site-policy\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[vllm_nnsight_plugin]\nsite = site_policy\n")


def test_a_third_party_hookimpl_found_by_entry_point_decides_in_the_front_end(tmp_path, llama_path):
    _install(tmp_path)
    probe = tmp_path / "probe.py"  # (a traced block's source is read from its file)
    probe.write_text(PROBE)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, str(probe), llama_path], env=env, capture_output=True, text=True,
                         timeout=600)
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line is not None, out.stderr[-3000:]
    found = json.loads(line[len("RESULT "):])
    assert found["refusal"] == "this site runs JSON specs only (site policy)"
    assert found["spec"] is None
    assert found["adapter"] == "site.norm"  # (the third party's adapter is asked before the builtin table)
    assert "model.site_norm" in found["stage_zero_absent"]  # (the engine asks it too: the last stage runs it)
    assert "site policy" in found["traced"]  # (a code block of an in-process caller, refused up front)
