"""``VLLM``: nnsight's ``VLLM`` API over a stock vLLM engine."""

from __future__ import annotations

import atexit
import dis
import gc
import sys
import weakref
from typing import Any

from ..payload import codec
from ..payload.tapset import TapSet
from .envoy import Envoy
from .requests import attach_results, sampling_kwargs, to_prompt
from .tracer import _NO_PROMPT, Invoke, Tracer

DEFAULT_TRACE_MAX_TOKENS = 1


def _is_with_statement(frame: Any) -> bool:
    """True when the caller's current call is the expression of a ``with``."""
    for ins in dis.get_instructions(frame.f_code):
        if ins.offset > frame.f_lasti and ins.opname not in ("CACHE", "EXTENDED_ARG"):
            return ins.opname in ("BEFORE_WITH", "LOAD_SPECIAL", "SETUP_WITH")
    return False


class VLLM(Envoy):
    """A vLLM engine you can trace like an nnsight model.

    ``VLLM(path, dispatch=True, **llm_kwargs)`` starts a ``vllm.LLM``; other
    keywords go to it. Without ``dispatch`` nothing heavy happens until the first
    trace. The engine runs eager by default (``enforce_eager=True``) because
    compiled graphs skip Python hooks; ``model.logits``/``model.samples`` work
    in every mode. ``taps=["model.layers.*.output", ...]`` runs it compiled with
    CUDA graphs instead, serving module values at those locations only.
    """

    def __init__(self, model: str, dispatch: bool = False, mode: str = "sync",
                 taps: Any = (), **llm_kwargs: Any):
        super().__init__("", None)
        if mode not in ("sync", "async"):
            raise ValueError("mode is 'sync' (vllm.LLM) or 'async' (vllm AsyncLLM)")
        tapset = TapSet([taps] if isinstance(taps, str) else (taps or ()))
        if tapset:  # compiled + CUDA graphs, the tap op at each declared location
            if llm_kwargs.get("enforce_eager"):
                raise ValueError("taps= runs the engine compiled (with CUDA graphs on a GPU) and enforce_eager=True "
                                 "asks for no compilation: drop one (an eager engine serves every module without taps)")
            extra = dict(llm_kwargs.get("additional_config") or {})
            extra["nnsight"] = {**extra.get("nnsight", {}), "taps": tapset.patterns}
            llm_kwargs["additional_config"] = extra
            llm_kwargs.setdefault("enforce_eager", False)
        llm_kwargs.setdefault("enforce_eager", True)
        object.__setattr__(self, "taps", tapset)
        object.__setattr__(self, "model_path", model)
        object.__setattr__(self, "mode", mode)
        object.__setattr__(self, "llm_kwargs", llm_kwargs)
        object.__setattr__(self, "_llm", None)
        object.__setattr__(self, "_tokenizer", None)
        if dispatch:
            self.dispatch()

    def __nnsight_ref__(self) -> tuple:
        return ("model",)

    # ------------------------------------------------------------ module tree
    def meta_tree(self) -> dict[str, str] | None:
        """The module tree vLLM builds for this model: the engine's after dispatch,
        else vLLM's model class built on the meta device from the config (no weights,
        no GPU; needs a vLLM install). None if it cannot be built here."""
        if self._tree is None and not self.__dict__.get("_meta_failed"):
            from ..boundary.meta_tree import meta_tree

            kwargs = {k: v for k, v in self.llm_kwargs.items() if k in ("dtype", "trust_remote_code",
                                                                          "revision", "hf_overrides")}
            try:
                object.__setattr__(self, "_tree", meta_tree(self.model_path, **kwargs))
            except Exception as exc:  # noqa: BLE001 - inspection is best effort without vLLM
                import warnings

                object.__setattr__(self, "_meta_failed", True)
                warnings.warn(f"no module tree for {self.model_path!r} here ({exc}); paths are "
                              "checked by the engine instead", RuntimeWarning, stacklevel=3)
        return self._tree

    def __getattr__(self, name: str) -> Any:
        if not name.startswith("_"):
            self.meta_tree()
        return super().__getattr__(name)

    def __repr__(self) -> str:
        self.meta_tree()
        return super().__repr__()

    # ------------------------------------------------------------ engine
    def dispatch(self) -> VLLM:
        """Start the engine (once) and learn the module tree it loaded."""
        if self._llm is None:
            if self.mode == "async":
                from ..boundary.entrypoints import make_async_engine

                object.__setattr__(self, "_llm", make_async_engine(self.model_path, self.llm_kwargs))
                # at interpreter exit, before modules are torn down (AsyncLLM.__del__ then fails)
                atexit.register(_shutdown_at_exit, weakref.ref(self))
                _freeze_startup_heap()
                return self  # module paths are checked in the worker (no blocking RPC here)
            from ..boundary.entrypoints import make_llm

            llm = make_llm(self.model_path, self.llm_kwargs)
            object.__setattr__(self, "_llm", llm)
            try:
                tree = llm.collective_rpc("nnsight_module_tree")[-1]  # (the last pipeline stage's)
            except Exception as exc:  # noqa: BLE001
                raise RuntimeError(
                    "the vllm-nnsight-plugin is not active in this engine's workers "
                    f"(is VLLM_NNSIGHT_DISABLE=1 set, or VLLM_PLUGINS excluding 'nnsight'?): {exc}"
                ) from None
            object.__setattr__(self, "_tree", {path: cls for path, cls in tree})
            from ..boundary.configuration import llm_config
            from ..boundary.frontend import learn_module_table  # specs are checked against it up front

            learn_module_table(llm_config(llm), llm.collective_rpc("nnsight_module_table"))
            _freeze_startup_heap()
        return self

    def shutdown(self) -> None:
        """Stop the engine (a later trace starts a new one)."""
        if self._llm is not None:
            from ..boundary.entrypoints import shutdown_llm

            shutdown_llm(self._llm)
            object.__setattr__(self, "_llm", None)
            _thaw_startup_heap()

    def engine_stats(self) -> dict[str, Any]:
        """What the engine holds for traced requests (scheduler and each worker);
        all zero when none are in flight. Sync engines only (see :meth:`aengine_stats`)."""
        from ..boundary.entrypoints import engine_utility

        if self.mode == "async":
            raise RuntimeError("on an async engine use: await model.aengine_stats()")
        return engine_utility(self._engine(), "nnsight_stats")

    async def aengine_stats(self) -> dict[str, Any]:
        from ..boundary.entrypoints import engine_utility_async

        return await engine_utility_async(self._engine(), "nnsight_stats")

    @property
    def dispatched(self) -> bool:
        return self._llm is not None

    @property
    def vllm_entrypoint(self) -> Any:
        """The engine (``vllm.LLM``, or ``AsyncLLM`` with ``mode="async"``); None before
        dispatch, as in nnsight: reading it starts nothing (``dispatch()`` or the first
        trace does)."""
        return self._llm

    def _engine(self) -> Any:
        """The engine, started if it is not yet."""
        return self.dispatch()._llm

    @property
    def tokenizer(self) -> Any:
        if self._llm is not None and self.mode == "sync":
            return self._llm.get_tokenizer()
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            object.__setattr__(self, "_tokenizer", AutoTokenizer.from_pretrained(self.model_path))
        return self._tokenizer

    # ------------------------------------------------------------ API
    def trace(self, prompt: Any = _NO_PROMPT, **sampling: Any) -> Tracer:
        """``with model.trace(prompt, **sampling):`` -- a block run inside the engine."""
        return Tracer(self, prompt, **sampling)

    def generate(self, *prompts: Any, **sampling: Any) -> Any:
        """``with model.generate(...)`` is :meth:`trace`; a plain call generates.

        Without a ``with`` block this is vLLM generation: a prompt or a list of
        prompts, returning ``RequestOutput``s (with ``.saves`` where anything was
        saved); on an async engine, an awaitable of them.
        """
        if _is_with_statement(sys._getframe(1)):
            if len(prompts) > 1:
                raise ValueError("with model.generate(...) takes one prompt; use invokes for more")
            return Tracer(self, prompts[0] if prompts else _NO_PROMPT, **sampling)
        from ..boundary.entrypoints import sampling_params

        batch = prompts[0] if len(prompts) == 1 and isinstance(prompts[0], list) and prompts[0] \
            and not isinstance(prompts[0][0], int) else list(prompts)
        kw = sampling_kwargs(sampling, {}, None)
        lora = kw.pop("lora_request", None)  # (one adapter for every prompt, as vLLM's generate takes it)
        params = sampling_params(whole=self.mode == "async", **kw)  # (async: only the last output is kept)
        if self.mode == "async":
            from .async_backend import generate_all

            return generate_all(self._engine(), [to_prompt(p) for p in batch], params, attach_results, lora)
        outputs = self._engine().generate([to_prompt(p) for p in batch], params, use_tqdm=False, lora_request=lora)
        for output in outputs:
            attach_results(output)
        return outputs

    def edit(self, name: str | None = None, inplace: bool = True, serve: str | None = None,
             api_key: str | None = None) -> Any:
        """``with model.edit(name=...) as (tracer, edit):`` -- a block installed on the
        engine that runs for every request admitted afterwards (see :mod:`.edits`)."""
        if not inplace:
            raise ValueError(
                "edit(inplace=False) is not supported: the edit is installed on the shared engine, "
                "which cannot be copied privately; use a trace for a one-off intervention"
            )
        from .edits import EditContext

        return EditContext(self, name, serve, api_key)

    def clear_edits(self) -> None:
        """Remove every edit installed through this object (from the next request on)."""
        if self.mode == "async":
            raise RuntimeError("on an async engine use: await model.aclear_edits()")
        for handle in list(self.__dict__.get("_edits", ())):
            handle.clear()

    async def aclear_edits(self) -> None:
        """:meth:`clear_edits` on an async engine."""
        for handle in list(self.__dict__.get("_edits", ())):
            await handle.aclear()

    def scan(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            "VLLM.scan is not supported: there is no local forward pass to scan (the model "
            "runs inside vLLM's engine under inference mode). Use model.trace(...) instead."
        )

    # ------------------------------------------------------------ running
    def _check_paths(self, invokes: list[Invoke], tree: dict[str, str] | None,
                     taps: Any = "local") -> None:
        """Wrong module paths, and accesses no tap serves on a compiled engine, fail
        here, before anything is sent."""
        if taps == "local":  # this client's own engine: compiled unless enforce_eager
            taps = None if self.llm_kwargs.get("enforce_eager") else self.taps
        checked = self.__dict__.setdefault("_checked", set())  # (one block, many invokes: checked once)
        for inv in invokes:
            key = (inv.block, tuple(sorted(n for n, v in inv.values.items() if v is self)), id(tree), repr(taps))
            if key in checked:
                continue
            self._check_block(inv.block, inv.values, tree, taps)
            if len(checked) > 1024:
                checked.clear()
            checked.add(key)

    def _check_block(self, block: Any, values: dict[str, Any], tree: dict[str, str] | None,
                     taps: TapSet | None) -> None:
        from .paths import check_paths, check_taps

        roots = {name for name, value in values.items() if value is self}
        if tree:
            check_paths(block.statements, roots, tree, block.filename)
        if taps is not None:
            check_taps(block.statements, roots, taps, block.filename)

    def _payload(self, inv: Invoke) -> str | None:
        """The invoke's code payload; None for an empty body (a plain request)."""
        if inv.block.empty:
            return None
        return codec.encode_code(
            codec.CodePayload(inv.block.source, inv.block.filename, inv.block.lineno, inv.values)
        )

    def _submit_async(self, invokes: list[Invoke], trace_sampling: dict[str, Any], stream_saves: bool) -> Any:
        from ..boundary.entrypoints import sampling_params
        from ..payload.codec import STREAM_KEY
        from .async_backend import AsyncBackend

        if len(invokes) != 1:
            raise ValueError("an async trace takes a single prompt: start one trace per request")
        inv = invokes[0]
        self._check_paths(invokes, self._tree)
        kw = sampling_kwargs(trace_sampling, inv.sampling, DEFAULT_TRACE_MAX_TOKENS)
        lora = kw.pop("lora_request", None)
        extra = dict(kw.pop("extra_args", None) or {})
        if self._payload(inv) is not None:
            extra[codec.PAYLOAD_KEY] = self._payload(inv)
        if stream_saves:
            extra[STREAM_KEY] = 1
        params = sampling_params(**kw, extra_args=extra)
        return AsyncBackend(self._engine(), to_prompt(inv.prompt), params, attach_results, lora)

    def _run_invokes(self, invokes: list[Invoke], trace_sampling: dict[str, Any],
                     serve: tuple[str, str | None] | None = None) -> list[Any]:
        if serve is not None:
            return self._run_served(invokes, trace_sampling, *serve)
        from ..boundary.entrypoints import sampling_params

        self.dispatch()
        self._check_paths(invokes, self._tree)
        prompts, params, loras = [], [], []
        last: tuple[dict, Any] | None = None  # (the previous invoke's keywords, its params)
        for inv in invokes:
            kw = sampling_kwargs(trace_sampling, inv.sampling, DEFAULT_TRACE_MAX_TOKENS)
            loras.append(kw.pop("lora_request", None))  # (vLLM takes it beside the params)
            extra = dict(kw.pop("extra_args", None) or {})
            payload = self._payload(inv)
            if payload is not None:
                extra[codec.PAYLOAD_KEY] = payload
            kw["extra_args"] = extra or None
            # invokes of one body and the same values share one SamplingParams, as a stock
            # generate() over many prompts does (vLLM copies it per request, shallowly:
            # entrypoints.sampling_params)
            if last is None or not _same_keywords(last[0], kw):
                last = (kw, sampling_params(**kw))
            params.append(last[1])
            prompts.append(to_prompt(inv.prompt))
        outputs = self._engine().generate(prompts, params, use_tqdm=False,
                                          lora_request=loras if any(loras) else None)
        for output in outputs:
            attach_results(output)
        return outputs


    def _served(self, conn: Any) -> tuple[str, Any]:
        """A server's model name and :class:`.served.ServedTree`, asked once per URL."""
        cache = self.__dict__.setdefault("_served_at", {})
        if conn.url not in cache:
            cache[conn.url] = (conn.model_name(), conn.tree())
        return cache[conn.url]

    def _run_served(self, invokes: list[Invoke], trace_sampling: dict[str, Any], url: str,
                    api_key: str | None) -> list[Any]:
        from . import served, served_plans

        conn = served.Connection(url, api_key)
        name, tree = self._served(conn)
        if self._tree is None:
            object.__setattr__(self, "_tree", tree.modules)
        self._check_paths(invokes, tree.modules, None if tree.taps is None else TapSet(tree.taps))
        bodies, plans = [], []
        for inv in invokes:
            kw = sampling_kwargs(trace_sampling, inv.sampling, DEFAULT_TRACE_MAX_TOKENS)
            payload, plan = served_plans.payload_for(self._payload(inv), kw.get("extra_args"), tree)
            bodies.append(served.completion_body(name, to_prompt(inv.prompt), kw, payload))
            plans.append(plan)
        outputs = served.post_all(conn, bodies, [served_plans.explain(p) for p in plans])
        for output, plan in zip(outputs, plans):
            attach_results(output)
            served_plans.finish(output, plan)
        return outputs


_engines_up = 0  # engines this process dispatched and has not shut down
_exiting = False


def _same_keywords(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two invokes' sampling keywords are equal (values such as arrays or
    tensors, whose ``==`` does not give one bool, count as different)."""
    try:
        return bool(a == b)
    except (ValueError, RuntimeError, TypeError):
        return False


def _freeze_startup_heap() -> None:
    """Take what exists once the engine is up (torch, vLLM, the engine, the module tree:
    about a million objects) out of the cyclic collector's reach, as vLLM does in its
    engine-core process (and so in this one when the engine runs in-process). Otherwise
    each full collection walks all of it: 400 ms on the development CPU, in the middle of
    an every-token trace whose results make tens of thousands of tensors. Cycles among
    these objects are collected again once the engine is shut down."""
    global _engines_up
    _engines_up += 1
    gc.collect()
    gc.freeze()


def _thaw_startup_heap() -> None:
    """An engine was shut down: its objects may be freed now. ``gc.unfreeze`` is for the
    whole process, so the engines still up are frozen again (one full collection)."""
    global _engines_up
    _engines_up = max(0, _engines_up - 1)
    if _exiting:
        return  # (the process ends: nothing to free, and a million objects to walk)
    gc.unfreeze()
    if _engines_up:
        gc.collect()
        gc.freeze()


def _shutdown_at_exit(ref: Any) -> None:
    global _exiting
    _exiting = True
    model = ref()
    if model is not None:
        try:
            model.shutdown()
        except Exception:  # noqa: BLE001 - exiting anyway: never a traceback here
            pass
