"""A request's rows of vLLM's flat token batch: the step layout the runner adapters
publish, narrowing a module value to one request's rows, and assigning into them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from .tree import leaves, map_tensors


class Chunk(NamedTuple):
    """This step's part of a prompt that chunked prefill (or a prefix-cache hit)
    splits across steps, for a request whose blocks all run batched plans."""

    start: int  # the prompt's rows computed before this step: this chunk's first position
    prompt_len: int
    more_chunks: bool  # a later step computes more of the prompt (this is not its last chunk)


@dataclass
class StepLayout:
    """Rows of this step's flat batch per request."""

    spans: dict[str, tuple[int, int]]  # req_id -> [start, end) token rows
    rows: dict[str, int]  # req_id -> index among the step's requests (logits/samples row)
    num_tokens: int  # leading size of activation tensors (including any padding)
    kept_logits: Any = None  # a copy of this step's logits rows kept_from.. (see keep_logits)
    kept_from: int = 0
    sampled: Any = None  # this step's sampled token ids (device tensor), once sampled
    sampled_cpu: list | None = None
    logits_seen: bool = False
    # requests whose prompt is split this step (batched plans): req_id -> its chunk
    chunks: dict[str, Chunk] = field(default_factory=dict)

    def more_chunks(self, req_id: str) -> bool:
        """The request's prompt is split and this step is not its last chunk."""
        chunk = self.chunks.get(req_id)
        return chunk is not None and chunk.more_chunks

    def sampled_token(self, req_id: str) -> int:
        """This step's token for a request (one device-to-host copy per step, on demand)."""
        if self.sampled_cpu is None:
            self.sampled_cpu = self.sampled.reshape(len(self.rows), -1)[:, 0].tolist()
        return int(self.sampled_cpu[self.rows[req_id]])


def per_token(t: Any, num_tokens: int) -> bool:
    """Whether ``t`` has a row per token of the step's batch. A parameter never has,
    whatever its size: a linear built with ``skip_bias_add`` (Falcon's) returns its
    bias beside its output, and that bias is the model's own, shared by every request."""
    return isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == num_tokens \
        and not isinstance(t, torch.nn.Parameter)


def narrow(value: Any, start: int, end: int, num_tokens: int) -> Any:
    """The request's rows of a module value: views, so in-place edits land."""
    return map_tensors(value, lambda t: t[start:end] if per_token(t, num_tokens) else t)


def _per_token(value: Any, num_tokens: int) -> bool:
    return any(per_token(t, num_tokens) for t in leaves(value))


def assign_into(target: Any, value: Any, where: str) -> None:
    """Write ``value`` into the view ``target`` (shape-checked, broadcasting allowed)."""
    if isinstance(target, torch.Tensor):
        if not isinstance(value, torch.Tensor):
            value = torch.as_tensor(value, dtype=target.dtype, device=target.device)
        if isinstance(target, torch.nn.Parameter):  # (a linear's bias, returned beside its output)
            if value is target or torch.equal(value.to(device=target.device, dtype=target.dtype), target):
                return
            raise ValueError(f"{where} is one of the model's parameters (a linear's bias), which every "
                             "request reads: assign the output (element 0) instead")
        try:
            target.copy_(value.to(device=target.device))
        except RuntimeError as exc:
            raise ValueError(
                f"cannot assign a tensor of shape {tuple(value.shape)} to {where} "
                f"of shape {tuple(target.shape)}: {exc}"
            ) from None
        return
    if isinstance(target, (tuple, list)):
        if not isinstance(value, (tuple, list)) or len(value) != len(target):
            raise ValueError(
                f"{where} is a {type(target).__name__} of {len(target)} items; assign one of the same length"
            )
        for i, (t, v) in enumerate(zip(target, value)):
            if t is None and v is None:
                continue
            assign_into(t, v, f"{where}[{i}]")
        return
    raise ValueError(f"{where} is a {type(target).__name__} and cannot be assigned")
