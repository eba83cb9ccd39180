"""Where does a capture's time go? cProfile of one rep of the headline workload.

Runs the engine in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so the profile
sees the scheduler, the runner, the plugin and the result encoding together.

    python3 benchmarks/gpu/profile_capture.py prefill|every_token
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import random
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")

sys.path.insert(0, os.path.dirname(__file__))
from headline import MODEL, OLEN, PLEN, N, every_token_capture, make_config, prefill_capture  # noqa: E402


def main() -> None:
    which = sys.argv[1]
    make_config()
    from vllm import LLM, SamplingParams

    from vllm_nnsight_plugin import make_payload

    llm = LLM(model=MODEL, load_format="dummy", skip_tokenizer_init=True, enforce_eager=True,
              dtype="bfloat16", max_model_len=1024, gpu_memory_utilization=0.5, seed=0)
    random.seed(0)
    prompts = [{"prompt_token_ids": [random.randrange(3, 32000) for _ in range(PLEN)]} for _ in range(N)]
    block = {"prefill": prefill_capture, "every_token": every_token_capture, "plain": None}[which]
    extra = {"nnsight": make_payload(block)} if block else None
    sp = SamplingParams(max_tokens=OLEN, ignore_eos=True, temperature=0.8, top_p=0.95, detokenize=False,
                        extra_args=extra)
    llm.generate(prompts, sp, use_tqdm=False)  # warm-up
    prof = cProfile.Profile()
    prof.enable()
    llm.generate(prompts, sp, use_tqdm=False)
    prof.disable()
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out).sort_stats("tottime")
    stats.print_stats(30)
    print(out.getvalue()[:12000])


if __name__ == "__main__":
    main()
