"""Tensor and pipeline parallel: the ranks, their collectives, which values a
rank holds a shard of, and the modules another pipeline stage holds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..engine.shards import Split, gather


def stand_in_classes(model: Any) -> dict[int, type]:
    """For each placeholder of a module another pipeline stage holds, the class of a
    sibling this stage holds in the same ``ModuleList`` (decoder layers are alike), so a
    block records into the same plan on every stage. (Others, e.g. the final norm on the
    first stage, have none.)"""
    import torch
    from vllm.model_executor.models.utils import PPMissingLayer

    out: dict[int, type] = {}
    for parent in model.modules():
        if not isinstance(parent, torch.nn.ModuleList):
            continue
        real = next((type(m) for m in parent if not isinstance(m, PPMissingLayer)), None)
        if real is not None:
            out.update({id(m): real for m in parent if isinstance(m, PPMissingLayer)})
    return out


def take_carried(intermediate_tensors: Any, prefix: str) -> dict[str, Any] | None:
    """Pop the entries named ``prefix...`` from a step's received intermediate tensors
    (vLLM copies every entry into buffers of its own, by name, so none may stay). Waits
    for them to arrive, as vLLM does right after."""
    if intermediate_tensors is None:
        return None
    tensors = intermediate_tensors.tensors
    names = [k for k in tensors if k.startswith(prefix)]
    return {k: tensors.pop(k) for k in names} if names else None


def pipeline_stages(vllm_config: Any) -> int:
    return int(getattr(getattr(vllm_config, "parallel_config", None), "pipeline_parallel_size", 1) or 1)


def stages_carry(vllm_config: Any) -> bool:
    """Whether plans may reach earlier pipeline stages' modules (``engine/stages.py``):
    with two stages (the plan signatures an earlier stage sends are compared as one),
    not with tensor parallel too (each rank of a stage would send its own shard of a
    value), nor under the external launcher (vLLM sends the step's tensors inside the
    runner, before the plugin adds what travels with them)."""
    parallel_config = getattr(vllm_config, "parallel_config", None)
    return pipeline_stages(vllm_config) == 2 and int(getattr(parallel_config, "tensor_parallel_size", 1) or 1) == 1 \
        and getattr(parallel_config, "distributed_executor_backend", None) != "external_launcher"


def pipeline_position() -> tuple[bool, bool]:
    """Whether this worker runs the model's (first, last) pipeline stage; the last is
    the only one whose output (logits, samples, results) reaches the scheduler. Both
    without pipeline parallel, or outside a worker."""
    from vllm.distributed import get_pp_group

    try:
        group = get_pp_group()
    except AssertionError:  # (no distributed state in this process: not a worker)
        return True, True
    return bool(group.is_first_rank), bool(group.is_last_rank)


def absent_modules(model: Any, position: tuple[bool, bool] | None = None) -> list[str]:
    """Paths of the modules another pipeline stage runs (see :func:`stage_absent`), at
    ``position`` (first, last; None: this worker's). The architecture's adapter
    (``hooks.arch_adapter``, third parties first) names the modules that run at the
    model's end, whatever their registration order."""
    from vllm.model_executor.models.utils import PPMissingLayer

    from ..hooks import arch_adapter

    first, last = pipeline_position() if position is None else position
    at_end: tuple[str, ...] = ()
    if not (first and last):
        adapter = arch_adapter(type(model).__name__)
        at_end = tuple(p for p in (getattr(adapter, "final_norm", None), getattr(adapter, "unembed", None)) if p)
    return stage_absent(list(model.named_modules()), lambda m: isinstance(m, PPMissingLayer), first, last, at_end)


def stage_absent(named: list[tuple[str, Any]], missing: Callable[[Any], bool], first: bool, last: bool,
                 at_end: tuple[str, ...] = ()) -> list[str]:
    """The modules of ``named`` (``model.named_modules()``, in registration order) that
    another pipeline stage runs: those vLLM left ``missing`` (a placeholder), and the
    ones it builds on every stage but runs on one (GPT-2's ``wte``/``wpe``/``ln_f``, a
    tied input embedding). Those in ``at_end`` (and under them) belong to the last
    stage; the others to the first stage when registered before the split layer list,
    else to the last (a module registered on the other side of the list from where it
    runs, and not named in ``at_end``, is then traced on a stage that never runs it: its
    ops fail as not reached, loudly)."""
    import torch

    out = [path for path, module in named if missing(module)]
    split = next((path for path, module in named if isinstance(module, torch.nn.ModuleList)
                  and any(missing(child) for child in module)), None)
    if split is None or (first and last):
        return out
    before = True
    for path, _ in named:
        if path == split:
            before = False
        if path == "" or split.startswith(path + ".") or path == split or path.startswith(split + ".") \
                or any(path.startswith(a + ".") or path == a for a in out):
            continue  # (the list, its layers, the containers around it, placeholders and what is under them)
        ends = any(path == e or path.startswith(e + ".") for e in at_end)
        if (before and not ends and not first) or ((ends or not before) and not last):
            out.append(path)
    return out


def tp_world() -> tuple[int, int]:
    """(tensor-parallel size, this worker's rank); (1, 0) outside a TP group."""
    try:
        from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        return get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()
    except Exception:  # noqa: BLE001 - no distributed state (a unit test's model)
        return 1, 0


@dataclass(frozen=True)
class TensorParallelGroup:
    """This worker's tensor-parallel group for the core (``engine.shards.Collectives``)."""

    ranks: int
    rank: int

    def all_gather(self, x: Any) -> Any:
        """Every rank's ``x`` side by side along the last dimension (a collective)."""
        from vllm.distributed import tensor_model_parallel_all_gather

        return tensor_model_parallel_all_gather(x.contiguous(), -1)

    def all_reduce(self, x: Any) -> Any:
        """The sum of every rank's ``x`` (a collective)."""
        from vllm.distributed import tensor_model_parallel_all_reduce

        return tensor_model_parallel_all_reduce(x.clone())

    def split_of(self, module: Any, io: str) -> Split | None:
        return shard_of(module, io)


def call_whole(module: Any, args: tuple, kwargs: dict) -> Any:
    """A block's own call of a module (``model.lm_head(model.model.norm(h))``, a logit
    lens), as the whole model computes it, without its hooks. vLLM's unembedding (an
    ``lm_head``, or the input embedding it ties to) called with hidden states projects
    them to the vocabulary's logits as vLLM's logits processor does, without its
    scaling (as Hugging Face's ``lm_head``); with token ids it embeds them. Under tensor
    parallel a call of a column-parallel linear returns its whole output, and one of a
    row-parallel linear takes the whole input (and returns the summed output). A layer
    vLLM wrapped for LoRA adapters is refused: its adapters apply to the rows of the
    step's batch, which a call of the block's own does not have (its kernels are not
    safe to feed other shapes)."""
    import torch
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    if _lora_wrapped(module):
        raise NotImplementedError(f"{type(module).__name__} is a layer vLLM wrapped for LoRA adapters (enable_lora): a "
                                  "block cannot call it (its adapters apply to the step's batch); read its .output")
    x = args[0] if args else None
    group = tp_group()
    if isinstance(module, VocabParallelEmbedding) and isinstance(x, torch.Tensor) and x.is_floating_point():
        logits = module.quant_method.apply(module, x, bias=getattr(module, "bias", None))
        if group is not None and module.tp_size > 1:  # (each rank holds a slice of the vocabulary)
            logits = group.all_gather(logits)
        return logits[..., : module.org_vocab_size]
    from vllm.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear

    if group is None or not isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
        return module.forward(*args, **kwargs)
    split_in = shard_of(module, "input")
    if split_in is not None and split_in.kind == "sharded" and split_in.segments == "whole":
        if x is None and isinstance(kwargs.get("input_"), torch.Tensor):  # (vLLM's name for it)
            args, x = (kwargs["input_"],), kwargs["input_"]
            kwargs = {k: v for k, v in kwargs.items() if k != "input_"}
        if x is not None:
            part = x.shape[-1] // group.ranks
            args = (x[..., group.rank * part : (group.rank + 1) * part], *args[1:])
    out = module.forward(*args, **kwargs)
    split_out = shard_of(module, "output")
    return out if split_out is None else gather(out, split_out, group)[0]


def output_structure(module: Any) -> int | None:
    """What a vLLM linear returns, which its forward's annotation leaves open (a tensor
    or a tuple): ``(output, bias)`` (2), the bias None unless built with
    ``skip_bias_add``; one tensor (0) when built with ``return_bias=False``. None for
    other modules (their annotation says)."""
    from vllm.model_executor.layers.linear import LinearBase

    while _lora_wrapped(module):
        module = module.base_layer
    if not isinstance(module, LinearBase):
        return None
    return 2 if getattr(module, "return_bias", True) else 0


def _lora_wrapped(module: Any) -> bool:
    """A layer vLLM replaced by its LoRA wrapper (``enable_lora``), which holds the layer."""
    return hasattr(module, "base_layer") and type(module).__module__.startswith("vllm.lora.")


def tp_group() -> TensorParallelGroup | None:
    """This worker's group; None with one rank."""
    ranks, rank = tp_world()
    return TensorParallelGroup(ranks, rank) if ranks > 1 else None


def shard_of(module: Any, io: str) -> Split | None:
    """How a module's value is split across tensor-parallel ranks (:class:`Split`);
    None when every rank holds the whole value. Raises NotImplementedError for a split
    it cannot put together. A layer vLLM wrapped for LoRA adapters (``enable_lora``) is
    split as the layer it wraps."""
    from vllm.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear

    while _lora_wrapped(module):
        module = module.base_layer
    if isinstance(module, ColumnParallelLinear):
        if io != "output" or module.tp_size <= 1 or module.gather_output:
            return None
        sizes = tuple(int(s) for s in module.output_partition_sizes)
        replicas = int(getattr(module, "num_kv_head_replicas", 1) or 1)
        if replicas > 1:  # fewer KV heads than ranks: each KV head is on `replicas` ranks in a row
            if len(sizes) != 3:
                raise NotImplementedError(f"{type(module).__name__}: replicated KV heads in {len(sizes)} segments")
            return Split.sharded(sizes, (1, replicas, replicas))
        return Split.sharded(sizes)
    if isinstance(module, RowParallelLinear):
        if module.tp_size <= 1:
            return None
        if io == "input":
            return Split.sharded("whole") if module.input_is_parallel else None
        return None if module.reduce_results else Split.partial()
    if tp_world()[0] <= 1:
        return None
    name = type(module).__name__
    if name == "Attention" and type(module).__module__.startswith("vllm."):
        return Split.sharded("whole")  # (its heads are this rank's: query in, heads' values out)
    if name.endswith("AndMul") or name == "MulAndSilu":  # (gate and up in, their product out)
        return Split.sharded("halves") if io == "input" else Split.sharded("whole")
    if hasattr(module, "reduce_results") and io == "output" and not module.reduce_results \
            and hasattr(module, "tp_size") and module.tp_size > 1:
        return Split.partial()  # (a fused MoE whose caller all-reduces)
    return None
