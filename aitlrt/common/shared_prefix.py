"""Forward a batch's common token prefix once: the rows of a GRPO group share their prompt (an Aider prompt is ~3,000
tokens, an answer ~100), so a micro-batch of one group's rows runs the backbone over the prompt once and over each
row's remaining tokens attending to the prompt's keys and values. The hidden states, logprobs and gradients are the
plain forward's (the prefix's keys and values keep their graph: the backward goes through them once).

Decoder-only models with transformers' ``DynamicCache`` (Llama, Qwen2, SmolLM2, ...). The caches never change once
made (the prefix's records each layer's keys and values, overwriting; a row's returns the prefix's with its own
appended), so a layer recomputed by gradient checkpointing sees what its forward saw: with checkpointing only where
it is non-reentrant (a reentrant recompute runs the forward without a graph, so the prefix's keys and values would
get no gradient from the rows). Not with sharded parameters (ZeRO-3, FSDP: every rank must run the same number of
forwards, and a prefix makes that number depend on the rows).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

if TYPE_CHECKING:
    from transformers import PretrainedConfig

log = logging.getLogger(__name__)

MIN_SHARED_TOKENS = 16
"""A shorter common prefix is not worth the extra forward calls: the batch runs as it is."""


CPU_MIN_SHARED = 0.5
"""On CPU, rows share a micro-batch only where they share at least half their tokens (one group's rows and their
prompt): unrelated rows padded into one pass ran 0.66x the bare loop's tokens/s against 0.91x one by one
(``bench/step.py``'s multi-turn rows; padding takes attention off its unmasked causal kernel), and one ~1k-token row
already fills the cores' matrix units, so a batch of them gains nothing there. Without ``shared_prefix`` (where
the model does not allow it) every row has its own pass on CPU for the same reason."""


def common_prefix_len(rows: Sequence[Sequence[int]]) -> int:
    """Length of the longest token prefix that every row starts with."""
    if not rows:
        return 0
    first, n = rows[0], min(len(row) for row in rows)
    for row in rows[1:]:
        k = 0
        while k < n and row[k] == first[k]:
            k += 1
        n = k
    return n


def prefix_batches(rows: Sequence[Sequence[int]], budget: int | None, min_shared: float = 0.0) -> list[list[int]]:
    """Row indices in micro-batches of rows that share long prefixes (rows in token order, so those of one group and
    one model call are neighbours), each within ``budget`` distinct tokens: the common prefix once plus every row's
    rest (a longer row goes alone; None: one micro-batch). With ``min_shared``, a row joins a micro-batch only
    where the prefix it shares with it is at least that share of its tokens (``CPU_MIN_SHARED``)."""
    order = sorted(range(len(rows)), key=lambda i: list(rows[i]))
    if budget is None:
        return [sorted(order)] if order else []
    groups: list[list[int]] = []
    current: list[int] = []
    shared = total = 0
    for i in order:
        if current:
            joined = min(shared, common_prefix_len([rows[current[-1]], rows[i]]))
            over = joined + (total + len(rows[i])) - joined * (len(current) + 1) > budget
            if over or joined < min_shared * max(len(rows[j]) for j in (*current, i)):
                groups.append(sorted(current))
                current = []
        if not current:
            current, shared, total = [i], len(rows[i]), len(rows[i])
            continue
        shared = joined
        current.append(i)
        total += len(rows[i])
    if current:
        groups.append(sorted(current))
    return groups


def supports_shared_prefix(model: nn.Module) -> str | None:
    """Why ``model`` cannot forward a shared prefix (None: it can)."""
    backbone = getattr(model, "base_model", model)
    if backbone is model:
        return "the model exposes no separate backbone (base_model)"
    if getattr(backbone, "is_gradient_checkpointing", False) or getattr(model, "is_gradient_checkpointing", False):
        why = _checkpointing_blocks(backbone)
        if why:
            return why
    if getattr(model.config, "is_encoder_decoder", False):
        return "an encoder-decoder model"
    return None


def _checkpointing_blocks(backbone: nn.Module) -> str | None:
    """Why ``backbone``'s gradient checkpointing rules a shared prefix out (None: its layers keep the caches and
    recompute with a graph)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    if not hasattr(GradientCheckpointingLayer, "_can_checkpoint_with_cache"):
        return "gradient checkpointing is on and this transformers drops a checkpointed layer's cache"
    for layer in _checkpointed_layers(backbone):
        func = getattr(layer, "_gradient_checkpointing_func", None)
        if getattr(func, "keywords", {}).get("use_reentrant", True):
            return (
                "gradient checkpointing is reentrant (gradient_checkpointing_kwargs use_reentrant: true): its "
                "recompute has no graph, so the prefix's keys and values would get no gradient from the rows"
            )
    return None


def _checkpointed_layers(backbone: nn.Module) -> list[nn.Module]:
    """``backbone``'s layers that gradient checkpointing recomputes."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in backbone.modules() if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing]


def use_shared_prefix(asked: bool, model: nn.Module, blocked: str | None = None) -> bool:
    """Whether a trainer forwards shared prefixes: ``asked`` and neither ``model`` (``supports_shared_prefix``) nor
    the caller's ``blocked`` reason (its parallelism) rules it out; when asked and ruled out, logs why."""
    if not asked:
        return False
    why = blocked or supports_shared_prefix(model)
    if why:
        log.info("shared_prefix off: %s", why)
    return why is None


@contextmanager
def shared_prefix_forward(model: nn.Module) -> Iterator[None]:
    """Within this, a forward of ``model``'s backbone over ``input_ids`` and ``attention_mask`` (each row's tokens
    one contiguous run: trl's left-padded prompt and right-padded completion) runs the rows' common prefix once when
    it has at least ``MIN_SHARED_TOKENS`` tokens; any other call, or a batch of one row, runs as it is."""
    from transformers import DynamicCache
    from transformers.modeling_outputs import BaseModelOutputWithPast

    backbone = getattr(model, "base_model", model)
    original = backbone.forward
    own = backbone.__dict__.get("forward")  # an instance-level forward (accelerate's hooks) comes back as it was
    config = cast("PretrainedConfig", backbone.config)

    class PrefixCache(DynamicCache):
        """Records each layer's keys and values of the prefix (a recompute overwrites them with the same)."""

        def __init__(self) -> None:
            super().__init__(config=config)
            self.kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *_: Any, **__: Any):
            self.kv[layer_idx] = (key_states, value_states)
            return key_states, value_states

    class RowCache(DynamicCache):
        """The prefix's keys and values, read-only: a layer gets them with its own appended, and nothing is kept."""

        def __init__(self, kv: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
            super().__init__(config=config)
            for index in sorted(kv):  # held as a plain cache's too: its length and mask sizes are the prefix's
                DynamicCache.update(self, *kv[index], index)
            self.kv = kv

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *_: Any, **__: Any):
            keys, values = self.kv[layer_idx]
            return torch.cat([keys, key_states], dim=-2), torch.cat([values, value_states], dim=-2)

    def forward(
        input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None, **kwargs: Any
    ) -> Any:
        hidden = None
        if input_ids is not None and not any(v is not None and k != "use_cache" for k, v in kwargs.items()):
            hidden = _forward_shared(original, PrefixCache, RowCache, input_ids, attention_mask)
        if hidden is None:
            return original(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        return BaseModelOutputWithPast(last_hidden_state=cast(torch.FloatTensor, hidden))

    checkpointed = _checkpointed_layers(backbone)
    backbone.forward = forward
    for layer in checkpointed:  # the caches never change: a recomputed layer reads what its forward read
        vars(layer)["_can_checkpoint_with_cache"] = True
    try:
        yield
    finally:
        for layer in checkpointed:
            del vars(layer)["_can_checkpoint_with_cache"]
        if own is None:
            del backbone.forward
        else:
            backbone.forward = own


def _forward_shared(
    original: Callable[..., Any],
    prefix_cache: Callable[[], Any],
    row_cache: Callable[[Any], Any],
    input_ids: torch.Tensor,
    mask: torch.Tensor | None,
) -> torch.Tensor | None:
    """The backbone's last hidden states of ``input_ids`` with the rows' common prefix forwarded once (zero on
    padding); None where that does not apply (one row, rows not contiguous, a prefix under ``MIN_SHARED_TOKENS``)."""
    spans = _token_spans(input_ids, mask) if input_ids.dim() == 2 and input_ids.size(0) > 1 else None
    if spans is None:
        return None
    rows = [ids[start:end] for ids, (start, end) in zip(input_ids, spans, strict=True)]
    shared = min(common_prefix_len([row.tolist() for row in rows]), min(map(len, rows)) - 1)
    if shared < MIN_SHARED_TOKENS:
        return None
    recorded = prefix_cache()
    prefix = original(input_ids=rows[0][None, :shared], past_key_values=recorded, use_cache=True)
    hidden = []
    for row, (start, end) in zip(rows, spans, strict=True):
        cache = row_cache(recorded.kv)
        rest = original(input_ids=row[None, shared:], past_key_values=cache, use_cache=True).last_hidden_state
        states = torch.cat([prefix.last_hidden_state[0], rest[0]])
        hidden.append(nn.functional.pad(states, (0, 0, start, input_ids.size(1) - end)))
    return torch.stack(hidden)


def _token_spans(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> list[tuple[int, int]] | None:
    """Each row's [start, end) of real tokens; None where a row's tokens are not one contiguous run."""
    if attention_mask is None:
        return [(0, input_ids.size(1))] * input_ids.size(0)
    spans = []
    for mask in attention_mask.bool():
        real = mask.nonzero().flatten()
        if not len(real) or int(real[-1]) - int(real[0]) + 1 != len(real):
            return None
        spans.append((int(real[0]), int(real[-1]) + 1))
    return spans
