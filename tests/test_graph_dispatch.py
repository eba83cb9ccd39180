"""How tapped steps are kept off full CUDA graphs, per runner: the wrappers' effect on
the arguments vLLM's own dispatch functions receive (the graphs themselves are
exercised by tests/test_taps.py on a GPU)."""

from __future__ import annotations

import types

from vllm.config import CUDAGraphMode

from vllm_nnsight_plugin.boundary import runner_v2, runners


class _Dispatcher:
    """Records what V1's CudagraphDispatcher.dispatch would be asked."""

    def dispatch(self, num_tokens, uniform_decode=False, has_lora=False, num_active_loras=0,
                 valid_modes=None, invalid_modes=None):
        return valid_modes, invalid_modes


def test_v1_guard_excludes_full_graphs_only_while_asked():
    runner = types.SimpleNamespace(cudagraph_dispatcher=_Dispatcher())
    wanted = {"mode": None}
    runners.guard_v1_dispatcher(runner, lambda: wanted["mode"])
    runners.guard_v1_dispatcher(runner, lambda: wanted["mode"])  # re-entrant
    dispatch = runner.cudagraph_dispatcher.dispatch
    assert dispatch(8, uniform_decode=True, valid_modes=None, invalid_modes=None) == (None, None)
    wanted["mode"] = "piecewise"
    assert dispatch(8, uniform_decode=True, valid_modes=None, invalid_modes=None) == (None, {CUDAGraphMode.FULL})
    wanted["mode"] = "eager"
    assert dispatch(8, valid_modes=None, invalid_modes=None) == ({CUDAGraphMode.NONE}, None)
    forced = {CUDAGraphMode.NONE}  # vLLM's own forced-eager / DP-synced choice is left alone
    assert dispatch(8, valid_modes=forced, invalid_modes=None) == (forced, None)


def test_v2_dispatch_drops_full_graphs_for_tapped_steps():
    calls = []

    def dispatch_cg_and_sync_dp(manager, num_reqs, num_tokens, uniform_token_count, dp_size, dp_rank,
                                need_eager=False, num_active_loras=0):
        calls.append((uniform_token_count, need_eager))
        mode = "NONE" if need_eager else ("FULL" if uniform_token_count else "PIECEWISE")
        return types.SimpleNamespace(cg_mode=types.SimpleNamespace(name=mode)), None

    wrapped = runner_v2._dispatch(dispatch_cg_and_sync_dp)
    try:
        assert wrapped(None, 4, 4, 1, 1, 0, need_eager=False)[0].cg_mode.name == "FULL"  # untraced step
        runner_v2._graph_mode = "piecewise"
        assert wrapped(None, 4, 4, 1, 1, 0, need_eager=False)[0].cg_mode.name == "PIECEWISE"
        runner_v2._graph_mode = "eager"
        assert wrapped(None, 4, 4, 1, 1, 0, need_eager=False)[0].cg_mode.name == "NONE"
    finally:
        runner_v2._graph_mode = None
    assert calls == [(1, False), (None, False), (1, True)]


def test_v2_falls_back_to_eager_when_only_full_graphs_exist():
    def full_only(manager, num_reqs, num_tokens, uniform_token_count, dp_size, dp_rank,
                  need_eager=False, num_active_loras=0):  # cudagraph_mode=FULL: the mixed graph is full too
        mode = "NONE" if need_eager else "FULL"
        return types.SimpleNamespace(cg_mode=types.SimpleNamespace(name=mode)), None

    wrapped = runner_v2._dispatch(full_only)
    runner_v2._graph_mode = "piecewise"
    try:
        assert wrapped(None, 4, 4, None, 1, 0, need_eager=False)[0].cg_mode.name == "NONE"
    finally:
        runner_v2._graph_mode = None


def test_v2_data_parallel_dispatches_a_tapped_step_once_and_eager():
    """With data parallel each dispatch is a collective that every rank makes once per
    step: a second try on one rank would pair with another step's on the others. So a
    tapped step asks eager in one call (the ranks agree on the lowest mode asked)."""
    calls = []

    def dispatch_cg_and_sync_dp(manager, num_reqs, num_tokens, uniform_token_count, dp_size, dp_rank,
                                need_eager=False, num_active_loras=0):
        calls.append((uniform_token_count, dp_size, need_eager))
        mode = "NONE" if need_eager else ("FULL" if uniform_token_count else "PIECEWISE")
        return types.SimpleNamespace(cg_mode=types.SimpleNamespace(name=mode)), None

    wrapped = runner_v2._dispatch(dispatch_cg_and_sync_dp)
    try:
        assert wrapped(None, 4, 4, 1, 2, 1, need_eager=False)[0].cg_mode.name == "FULL"  # untraced step
        for mode in ("piecewise", "eager"):
            runner_v2._graph_mode = mode
            assert wrapped(None, 4, 4, 1, 2, 1, need_eager=False)[0].cg_mode.name == "NONE"
    finally:
        runner_v2._graph_mode = None
    assert calls == [(1, 2, False), (1, 2, True), (1, 2, True)]  # one call per step


def test_v2_data_parallel_keeps_a_tapped_step_off_microbatches():
    """Where vLLM offers microbatching (dual-batch overlap), a microbatched step picks its
    graph before the ranks' requested modes count: a tapped step votes no (one rank's no
    keeps every rank off them). An untraced step's vote is vLLM's own."""
    calls = []

    def dispatch_cg_and_sync_dp(manager, num_reqs, num_tokens, uniform_token_count, dp_size, dp_rank,
                                max_query_len=None, need_eager=False, num_active_loras=0,
                                parallel_config=None, allow_ubatching=False, uniform_decode=False):
        calls.append((need_eager, allow_ubatching))
        return types.SimpleNamespace(cg_mode=types.SimpleNamespace(name="NONE" if need_eager else "FULL")), None

    wrapped = runner_v2._dispatch(dispatch_cg_and_sync_dp)
    try:
        wrapped(None, 4, 4, 1, 2, 0, need_eager=False, allow_ubatching=True)
        runner_v2._graph_mode = "piecewise"
        wrapped(None, 4, 4, 1, 2, 0, need_eager=False, allow_ubatching=True)
    finally:
        runner_v2._graph_mode = None
    assert calls == [(False, True), (True, False)]
