"""What a block sees as ``model`` and ``tracer`` inside the worker.

One envoy tree per worker wraps the real vLLM modules. Envoys are shared by all
requests: an access asks the interleaver's *current* session (the one whose
greenlet is running) to park until the forward reaches that location.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from .cache import cache_op
from .session import _NOTHING, END, StopBlock, Wait

if TYPE_CHECKING:
    from .interleave import Interleaver

# __dict__: submodule envoys are kept as attributes, so the path a block walks every
# step (``model.model.layers[8]``) is plain attribute reads after its first walk
_OWN = ("_module", "_path", "_inter", "_children", "_keys", "__dict__")


class WorkerEnvoy:
    """A module of the loaded vLLM model, addressed by its path."""

    __slots__ = _OWN

    def __init__(self, module: torch.nn.Module, path: str, inter: Interleaver):
        object.__setattr__(self, "_module", module)
        object.__setattr__(self, "_path", path)
        object.__setattr__(self, "_inter", inter)
        object.__setattr__(self, "_children", {})
        object.__setattr__(self, "_keys", None)

    # ------------------------------------------------------------ tree
    def _child(self, name: str) -> WorkerEnvoy:
        child = self._children.get(name)
        if child is None:
            module = self._module._modules[name]
            path = f"{self._path}.{name}" if self._path else name
            child = WorkerEnvoy(module, path, self._inter)
            self._children[name] = child
        return child

    def __getattr__(self, name: str) -> Any:
        """Only for names the class does not define: a submodule (then kept as an attribute,
        which can shadow nothing) or the module's own attribute."""
        module = self._module
        if name in module._modules:
            child = self._child(name)
            object.__setattr__(self, name, child)
            return child
        try:
            return getattr(module, name)
        except AttributeError:
            where = self._path or "model"
            names = ", ".join(module._modules) or "(no submodules)"
            raise AttributeError(
                f"{where!r} ({type(module).__name__}) has no submodule or attribute {name!r}; "
                f"submodules: {names}"
            ) from None

    def __getitem__(self, index: int | slice | str) -> Any:
        keys = self._keys
        if keys is None:  # (a loaded model's tree does not change)
            keys = list(self._module._modules)
            object.__setattr__(self, "_keys", keys)
        if isinstance(index, slice):  # model.layers[:4]: those layers' envoys
            return [self._child(k) for k in keys[index]]
        if isinstance(index, int):
            try:
                key = keys[index]
            except IndexError:
                raise IndexError(
                    f"{self._path or 'model'} has {len(keys)} submodules; index {index} is out of range"
                ) from None
            return self._child(key)
        return self.__getattr__(index)

    def __len__(self) -> int:
        return len(self._module._modules)

    def __iter__(self) -> Iterator[WorkerEnvoy]:
        return (self._child(k) for k in self._module._modules)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Call the module directly (no interleaving), e.g. a logit lens: as the whole
        model computes it (the worker's ``call_module``), else its forward."""
        call = self._inter.setup.call_module
        return call(self._module, args, kwargs) if call is not None else self._module.forward(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<envoy {self._path or 'model'}: {type(self._module).__name__}>"

    # ------------------------------------------------------------ locations
    def _access(self, kind: str, value: Any = _NOTHING) -> Any:
        session = self._inter.require_session()
        if kind in ("output", "input", "inputs"):
            self._inter.check_module_access(self._path, kind)
        wait = Wait(kind, session.target_step, self._path, self._module, value)
        return session.request(wait)

    @property
    def output(self) -> Any:
        return self._access("output")

    @property
    def input(self) -> Any:
        return self._access("input")

    @property
    def inputs(self) -> Any:
        return self._access("inputs")

    def __setattr__(self, name: str, value: Any) -> None:
        if name in ("output", "input"):
            self._access(name, value)
            return
        if self._path == "" and name in ("logits", "samples"):
            self._step_value(name, value)
            return
        raise AttributeError(
            f"cannot set {name!r} on {self._path or 'model'}: only .output/.input "
            "(and model.logits/model.samples) can be assigned"
        )

    # root-only: logits and samples
    def _step_value(self, kind: str, value: Any = _NOTHING) -> Any:
        session = self._inter.require_session()
        return session.request(Wait(kind, session.target_step, "", None, value))

    @property
    def logits(self) -> Any:
        if self._path:
            return self.__getattr__("logits")
        return self._step_value("logits")

    @property
    def samples(self) -> Any:
        if self._path:
            return self.__getattr__("samples")
        return self._step_value("samples")


class ResultRef:
    """``tracer.result``: a path into the finished ``RequestOutput``.

    The output only exists in the front end, so the block records what it wants
    (``tracer.result.outputs[0].token_ids``) and the client resolves it.
    """

    __slots__ = ("__nnsight_result_path__",)

    def __init__(self, path: tuple = ()):
        object.__setattr__(self, "__nnsight_result_path__", path)

    def __getattr__(self, name: str) -> ResultRef:
        if name.startswith("__"):
            raise AttributeError(name)
        return ResultRef(self.__nnsight_result_path__ + (("attr", name),))

    def __getitem__(self, key: Any) -> ResultRef:
        if not isinstance(key, (int, str)):
            raise TypeError("tracer.result can only be indexed by int or str")
        return ResultRef(self.__nnsight_result_path__ + (("item", key),))

    def __repr__(self) -> str:
        return "<tracer.result (available after the request finishes)>"

    def _not_here(self, *args: Any) -> Any:
        raise TypeError("tracer.result is the finished RequestOutput, which exists only in the front end: "
                        "in a block, save it or a part of it (tracer.result.outputs[0].token_ids.save()) "
                        "and compute with it after the trace")

    __len__ = __iter__ = __bool__ = __int__ = __float__ = __index__ = __contains__ = _not_here
    __add__ = __radd__ = __sub__ = __mul__ = __lt__ = __le__ = __gt__ = __ge__ = __eq__ = __ne__ = _not_here
    __hash__ = object.__hash__


class _IterIndexer:
    def __init__(self, tracer: WorkerTracer):
        self._tracer = tracer

    def __getitem__(self, item: int | slice) -> Iterator[int]:
        if isinstance(item, int):
            return self._tracer._steps(item, item + 1, 1)
        if isinstance(item, slice):
            start = item.start or 0
            step = item.step or 1
            if start < 0 or step < 1 or (item.stop is not None and item.stop < 0):
                raise ValueError("tracer.iter takes non-negative steps, e.g. tracer.iter[:3]")
            return self._tracer._steps(start, item.stop, step)
        raise TypeError("tracer.iter takes an int or a slice")


class WorkerTracer:
    """``tracer`` inside a block: iteration over engine steps, result, stop."""

    def __init__(self, inter: Interleaver):
        self._inter = inter
        self.iter = _IterIndexer(self)

    def _steps(self, start: int, stop: int | None, step: int) -> Iterator[int]:
        session = self._inter.require_session()
        session.iter_bounds.append(stop)
        try:
            index = start
            while stop is None or index < stop:
                if index > session.step and session.request(Wait("step", index)) is END:
                    if stop is not None:
                        session.warnings.append(
                            f"the request finished after step {index - 1}, before tracer.iter reached "
                            f"step {stop - 1} (min_tokens= or ignore_eos=True make generation longer)"
                        )
                    return
                session.target_step = index
                yield index
                index += step
        finally:
            session.iter_bounds.pop()

    def all(self) -> Iterator[int]:
        return self._steps(self._inter.require_session().target_step, None, 1)

    @property
    def result(self) -> ResultRef:
        return ResultRef()

    def stop(self) -> None:
        raise StopBlock()

    def cache(self, modules: Any = None, device: Any = None, dtype: Any = None, detach: bool = True,
              include_output: bool = True, include_inputs: bool = False, **_: Any) -> Any:
        """nnsight's activation cache: every module's value (or those of ``modules``)
        from here to the request's end, returned with the block's saves."""
        session = self._inter.require_session()
        op = cache_op(f"c{session.caches}", modules, dtype, include_output, include_inputs)
        return self._inter.cache_for(session, op)

    def log(self, *args: Any) -> None:
        self._inter.require_session().warnings.append(" ".join(str(a) for a in args))
