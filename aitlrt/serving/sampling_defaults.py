"""What vLLM applies to a call that leaves a sampling field unset: by default (``--generation-config auto``) the
model's ``generation_config.json`` (Qwen2.5 checkpoints set ``repetition_penalty`` 1.05-1.1), with
``--generation-config vllm`` neutral values. ``aitlrt-serve`` forces temperature, top-p and top-k on every call and
drops the agent's other sampling fields, so a penalty or ``min_p`` from that file reaches every call unseen: the
sampler's logprobs then include it, the trainer's do not, and the importance-sampling ratio is off on every token.
``managed_server`` starts vLLM with ``--generation-config vllm``; the trainer's sampling check reads the server's
(``served_sampling_defaults``) and refuses one that would alter sampling."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx

from aitlrt.common.keys import bearer

log = logging.getLogger(__name__)

NEUTRAL_CONFIG_FLAG = ("--generation-config", "vllm")
"""vLLM's flag for neutral sampling defaults (the model's generation config still gives its stop tokens)."""

UNFORCED = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "min_p": 0.0}
"""The sampling fields a generation config can set that ``aitlrt-serve`` does not force by default, with their
neutral values (temperature, top-p and top-k are always forced; the length cap changes no logprob)."""


def altering(config: Mapping[str, Any]) -> dict[str, float]:
    """The fields of ``config`` (a generation config's) that alter sampling: those of ``UNFORCED`` set to another
    value than the neutral one."""
    return {k: float(v) for k, neutral in UNFORCED.items() if (v := config.get(k)) is not None and v != neutral}


def model_sampling_defaults(model: str | Path) -> dict[str, float] | None:
    """The sampling-altering defaults of ``model``'s ``generation_config.json``: a local folder's ({} without the
    file), else a Hub model's from the local Hub cache (None when it is not there: unknown)."""
    path = Path(model) / "generation_config.json"
    if Path(model).is_dir():
        return altering(json.loads(path.read_text())) if path.is_file() else {}
    from huggingface_hub import try_to_load_from_cache

    try:
        cached = try_to_load_from_cache(str(model), "generation_config.json")
    except ValueError:  # not a Hub id either (a folder that does not exist here)
        return None
    if isinstance(cached, str):
        return altering(json.loads(Path(cached).read_text()))
    return {} if cached is not None else None  # a cached "no such file" vs not in the cache


def vllm_sampling_defaults(model_config: Mapping[str, Any]) -> dict[str, float] | None:
    """What vLLM with this ``model_config`` (its ``/server_info`` JSON's) applies to a call that sets none of
    ``UNFORCED``, as vLLM's ``ModelConfig.get_diff_sampling_param``: the generation config that
    ``generation_config`` names (``auto``: the model's; ``vllm``: none; else a folder), overridden by
    ``override_generation_config``. None when that generation config cannot be read here."""
    source = model_config.get("generation_config", "auto")
    folder = None if source == "vllm" else model_config.get("model") if source == "auto" else source
    defaults = model_sampling_defaults(folder) if folder else {}
    if defaults is None:
        return None
    overrides = {k: v for k, v in (model_config.get("override_generation_config") or {}).items() if k in UNFORCED}
    return {k: v for k, v in {**defaults, **overrides}.items() if v != UNFORCED[k]}


def served_sampling_defaults(vllm_url: str, key: str | None = None) -> dict[str, float] | None:
    """``vllm_sampling_defaults`` of the vLLM at ``vllm_url`` (its dev-mode ``GET /server_info``, which
    ``aitlrt-serve`` turns on), None when it cannot be read (a vLLM elsewhere, dev mode off: say so and go on)."""
    try:
        response = httpx.get(
            f"{vllm_url}/server_info", params={"config_format": "json"}, headers=bearer(key) if key else {}, timeout=60
        ).raise_for_status()
        return vllm_sampling_defaults(response.json()["vllm_config"]["model_config"])
    except (httpx.HTTPError, KeyError, TypeError, ValueError) as exc:
        log.warning("could not read vLLM's sampling defaults at %s/server_info: %s", vllm_url, exc)
        return None
