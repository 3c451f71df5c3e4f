"""Score only the positions trl scores: trl's fused LM head (``add_fused_lm_head``) projects every position of the
sequence through the LM head where Triton is missing (CPU), although only the completion's carry a label: for a
3.5k-token prompt and a 200-token answer, ~95% of the LM head's work (forward and backward) is thrown away."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn


@contextmanager
def scored_positions_only(model: nn.Module, keep: int) -> Iterator[None]:
    """Within this, a forward of ``model`` (patched by trl's ``add_fused_lm_head``) passes to its LM head only the
    last ``keep + 1`` positions of its backbone's hidden states and labels: the ``keep`` completion tokens and the
    position that predicts the first of them. Logprobs, entropies and gradients are unchanged (the labels of the
    positions cut are all -100)."""

    def cut_labels(_: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
        if kwargs.get("labels") is not None:
            kwargs["labels"] = kwargs["labels"][:, -(keep + 1) :]
        return args, kwargs

    def cut_hidden(_: nn.Module, __: tuple, output: Any) -> Any:
        output.last_hidden_state = output.last_hidden_state[:, -(keep + 1) :]
        return output

    backbone = getattr(model, "base_model", model)
    if backbone is model:  # no separate backbone: leave trl's forward as it is
        yield
        return
    handles = [
        model.register_forward_pre_hook(cut_labels, with_kwargs=True),
        backbone.register_forward_hook(cut_hidden),
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
