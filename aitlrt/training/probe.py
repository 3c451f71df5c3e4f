"""Checks that ``aitlrt-serve`` samples from the trainer's policy.

The weight probe: a fixed short text, tokenised with the trainer's tokenizer, is scored on both sides, by the
server (vLLM's prompt logprobs through the proxy's ``POST /weights/probe``) and by the trainer (a no-grad forward
of the policy; under LoRA the adapter model, i.e. the merged policy), and the step fails (``WeightProbeError``)
when the mean ``|server - trainer|`` logprob gap exceeds ``AgentGRPOConfig.weight_probe_tolerance``.

Tolerance, default 0.25 nats/token. Measured on the bundled SmolLM2-135M (47 scored tokens; vLLM CPU serving bf16,
the CPU trainer in fp32), mean gap (max): 0.034 (0.20) on the original weights; 0.04-0.05 (0.37) after syncing fp32
weights one sign-step of 1e-4 to 1e-3 away; 0.089 (0.42) after one real GRPO step at lr 1e-3; 0.094 (0.48) a
sign-step of 3e-3 away, of which rounding the weights to bf16 is 0.015: the rest is bf16 arithmetic, noisier on a
perturbed model. A server on other weights: 1.8 (down_proj + N(0, 0.05): "another run"), 0.31 (every weight times
1 + 3% noise). So the default is 2.7x the worst noise seen, 5-7x that at learning rates below 1e-3; the max gap is
logged, not checked (single tokens reach 0.5). GPU bf16 serving against a bf16 or fp32 trainer could not be
measured here (no GPU): the default assumes it is no noisier; raise the tolerance if the probe fires on weights
known to be right (its error says by how much). The probe finds a server on other weights; it cannot see one
step's drift at a typical learning rate (far below bf16 noise): that is the weight version's job. Relative to the
weights before the sync: once the policy has moved ``DECISIVE_SHIFT`` times the serving noise since the last
verified check, the server must be closer to the policy now than to that one, whatever the tolerance (a sync that
did nothing after a move of 0.15 nats/token passes the tolerance of 0.25, not this).

The sampling check: the temperature, top-p, top-k and max tokens per call that the server forces (``GET
/settings``) must be the config's, and its vLLM must apply no sampling default that alters them (a
``repetition_penalty`` of the model's ``generation_config.json``: ``aitlrt.serving.sampling_defaults``), else
``SamplingMismatchError`` at connect time.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from accelerate.utils import broadcast_object_list
from transformers import PreTrainedTokenizerBase, Trainer

from aitlrt.common.keys import admin_key, vllm_key
from aitlrt.serving.sampling_defaults import served_sampling_defaults
from aitlrt.training.config import AgentGRPOConfig
from aitlrt.training.weight_sync import proxy_request

log = logging.getLogger(__name__)

PROBE_TEXT = (
    "The quick brown fox jumps over the lazy dog. def add(a, b):\n"
    '    """Return the sum of a and b."""\n'
    "    return a + b\n"
    "Paris is the capital of France, and Berlin is the capital of Germany."
)
MAX_PROBE_TOKENS = 64


class WeightProbeError(RuntimeError):
    """The server's logprobs of the probe differ from the trainer's: it does not serve the trainer's policy."""


class SamplingMismatchError(RuntimeError):
    """The sampling that the server forces is not the trainer's config."""


@dataclass(frozen=True)
class ProbeGap:
    """``|server - trainer|`` logprob over the probe's scored tokens (nats/token); ``worst``: where it is largest
    (index into the scored tokens, i.e. token ``worst + 1`` of the probe)."""

    mean: float
    max: float
    worst: int


def probe_gap(server: Sequence[float], trainer: Sequence[float]) -> ProbeGap:
    gaps = [abs(s - t) for s, t in zip(server, trainer, strict=True)]
    worst = max(range(len(gaps)), key=gaps.__getitem__)
    return ProbeGap(statistics.fmean(gaps), gaps[worst], worst)


def probe_token_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """``PROBE_TEXT`` in the trainer's tokens (at most ``MAX_PROBE_TOKENS``)."""
    ids = list(tokenizer(PROBE_TEXT)["input_ids"])[:MAX_PROBE_TOKENS]
    if len(ids) < 2:
        raise ValueError(
            f"the tokenizer turns the weight probe's text into {len(ids)} token(s); at least 2 are needed "
            "(or turn the probe off: weight_probe=False)"
        )
    return ids


def policy_logprobs(trainer: Trainer, token_ids: list[int]) -> list[float]:
    """The policy's logprob of each token of ``token_ids`` after the ones before it (no grad, eval mode). Under
    ZeRO-3 every rank must call (the forward gathers the weights)."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    ids = torch.tensor([token_ids], device=trainer.accelerator.device)
    training = model.training
    model.eval()
    try:
        with torch.no_grad(), trainer.accelerator.autocast():
            logits = model(input_ids=ids).logits[0, :-1].float()
    finally:
        model.train(training)
    return torch.log_softmax(logits, -1).gather(1, ids[0, 1:].unsqueeze(1)).squeeze(1).tolist()


def server_logprobs(proxy_url: str, token_ids: list[int]) -> tuple[int, list[float]]:
    """The weight version that scored ``token_ids`` and the served model's logprob of each token after the first."""
    answer = proxy_request(proxy_url, "POST", "/weights/probe", json={"token_ids": token_ids}).json()
    return answer["weight_version"], answer["logprobs"]


NOISE_FLOOR = 0.034
"""The smallest serving noise assumed (nats/token): the mean gap of vLLM CPU bf16 against the fp32 trainer on the
bundled model's original weights, the quietest case measured (module docstring)."""
DECISIVE_SHIFT = 4.0
"""The relative check judges a sync only when the policy moved at least this many times the serving noise (the gap
of the last verified check, at least ``NOISE_FLOOR``): a server left on the old weights then reads ``shift``, one on
the new ones ``noise``, and noise up to 2.7x the last check's (0.034 -> 0.094 measured on perturbed weights) cannot
swap them. Smaller moves (one step at a typical learning rate: far below the noise) are the weight version's job."""


class WeightProbe:
    """Scores ``token_ids`` on the server and in the trainer and fails when they differ beyond ``tolerance``, or when
    the server is closer to the policy of the last verified check than to the policy now (a sync that did nothing).

    The absolute tolerance alone cannot see a sync that did nothing after a move smaller than it: every weight times
    1 + 3 % noise reads 0.31 nats/token, and a move of half that passes 0.25. The relative check compares the
    server with both policies, the one it served before (the trainer's logprobs at the last check that passed) and
    the one it should serve now."""

    def __init__(self, proxy_url: str, token_ids: list[int], tolerance: float) -> None:
        self.proxy_url, self.token_ids, self.tolerance = proxy_url, token_ids, tolerance
        self._verified: tuple[list[float], ProbeGap] | None = None  # the policy's logprobs and gap at the last pass

    def check(self, trainer: Trainer, weight_version: int) -> ProbeGap:
        """Every rank calls: every rank scores (ZeRO-3's forward is collective), the main process asks the server
        and compares, and every rank returns the same gap or raises the same ``WeightProbeError``."""
        mine = policy_logprobs(trainer, self.token_ids)
        outcome: ProbeGap | str | None = None
        if trainer.accelerator.is_main_process:
            try:
                served_version, served = server_logprobs(self.proxy_url, self.token_ids)
                gap = probe_gap(served, mine)
                if gap.mean > self.tolerance:
                    outcome = self._mismatch(gap, served, mine, served_version, weight_version)
                else:
                    outcome = self._stale(gap, served, mine, served_version, weight_version) or gap
            except Exception as exc:  # every rank must learn of it, not only this one
                outcome = f"the weight probe could not score the probe on the server at {self.proxy_url}: {exc}"
        outcome = broadcast_object_list([outcome])[0]
        if not isinstance(outcome, ProbeGap):
            raise WeightProbeError(f"{outcome} (trainer at step {trainer.state.global_step})")
        self._verified = (mine, outcome)
        log.debug("weight probe: mean gap %.4f, max %.4f nats/token", outcome.mean, outcome.max)
        return outcome

    def _stale(
        self, gap: ProbeGap, served: list[float], mine: list[float], served_version: int, weight_version: int
    ) -> str | None:
        """Why the server looks like it still serves the policy of the last verified check (None: it does not, or
        the policy moved too little since to tell)."""
        if self._verified is None:
            return None
        before, noise = self._verified
        shift = probe_gap(mine, before).mean
        to_before = probe_gap(served, before).mean
        if shift < DECISIVE_SHIFT * max(noise.mean, NOISE_FLOOR) or gap.mean < to_before:
            return None
        return (
            f"the weight sync did not reach the server: on the {len(mine)} scored tokens of a fixed probe, the server "
            f"(vLLM via {self.proxy_url}, weight version {served_version}) is {to_before:.3f} nats/token from the "
            f"policy it was verified to serve before and {gap.mean:.3f} from the trainer's policy now (weight "
            f"version {weight_version}), which moved {shift:.3f} since: it still serves the old weights, within "
            f"weight_probe_tolerance={self.tolerance} only because the policy moved less than that. Likely causes: a "
            "reload folder vLLM reads elsewhere, an incomplete NCCL transfer, LoRA weights merged under the wrong "
            "names"
        )

    def _mismatch(
        self, gap: ProbeGap, served: list[float], mine: list[float], served_version: int, weight_version: int
    ) -> str:
        return (
            f"the server does not serve the trainer's policy: on the {len(mine)} scored tokens of a fixed probe, "
            f"the logprobs of the server (vLLM via {self.proxy_url}, weight version {served_version}, mean logprob "
            f"{statistics.fmean(served):.3f}) and of the trainer (mean {statistics.fmean(mine):.3f}; it expects "
            f"weight version {weight_version}) differ by {gap.mean:.3f} nats/token on average "
            f"and {gap.max:.3f} at most (token {gap.worst + 1}: server {served[gap.worst]:.3f}, trainer "
            f"{mine[gap.worst]:.3f}), beyond weight_probe_tolerance={self.tolerance} (mean). Likely causes: the "
            "server serves another model or another run's weights (start aitlrt-serve on the trainer's model, or "
            "POST /weights/reload its weights); the weight sync did not reach vLLM (a reload folder vLLM reads "
            "elsewhere, an incomplete NCCL transfer, LoRA weights merged under the wrong names); precision noise "
            "above the tolerance (raise weight_probe_tolerance, or turn the probe off with weight_probe=False)"
        )


def make_weight_probe(args: AgentGRPOConfig, tokenizer: PreTrainedTokenizerBase) -> WeightProbe | None:
    """The probe ``args`` asks for (None with ``weight_probe=False``)."""
    if not args.weight_probe:
        return None
    return WeightProbe(args.proxy_url.rstrip("/"), probe_token_ids(tokenizer), args.weight_probe_tolerance)


# ---- the forced sampling ------------------------------------------------------------------------------------------
_SAMPLING = (  # (config field, key aitlrt-serve forces, its flag)
    ("temperature", "temperature", "--temperature"),
    ("top_p", "top_p", "--top-p"),
    ("top_k", "top_k", "--top-k"),
    ("max_completion_length", "max_tokens", "--max-tokens"),
)


def _normal(key: str, value: Any) -> Any:
    """Top-k 0 and -1 (and unset) all mean no top-k; unset max tokens means the agent's choice."""
    if key == "top_k":
        return -1 if value is None or value <= 0 else value
    return value


def check_sampling(
    args: AgentGRPOConfig,
    forced: dict[str, Any],
    proxy_url: str,
    server_defaults: Mapping[str, float] | None = None,
) -> None:
    """Raise ``SamplingMismatchError`` naming both values and the fixes unless ``forced`` (what aitlrt-serve forces
    on every call) is the sampling of ``args`` and ``server_defaults`` (what its vLLM applies to a field a call
    leaves unset: ``aitlrt.serving.sampling_defaults``; None: unknown) alter nothing that ``forced`` leaves unset."""
    differences, flags, settings = [], [], []
    for name, key, flag in _SAMPLING:
        ours, theirs = _normal(key, getattr(args, name)), _normal(key, forced.get(key))
        if ours is not None:
            flags.append(f"{flag} {ours}")
        if ours != theirs:
            served = f"{key}={theirs}" if theirs is not None else f"no {key} (the agent's own)"
            differences.append(f"it forces {served} where the config has {name}={getattr(args, name)}")
            settings.append(f"{name}: {'null' if theirs is None else 0 if key == 'top_k' and theirs < 0 else theirs}")
    if differences:
        raise SamplingMismatchError(
            f"aitlrt-serve at {proxy_url} does not sample as the trainer's config says: {'; '.join(differences)}. "
            f"Restart aitlrt-serve with {' '.join(flags)}"
            + ("" if args.max_completion_length is not None else " (and no --max-tokens)")
            + f", or set {', '.join(settings)} in the training config."
        )
    applied = {k: v for k, v in (server_defaults or {}).items() if k not in forced}
    if applied:
        listed = ", ".join(f"{k}={v:g}" for k, v in sorted(applied.items()))
        raise SamplingMismatchError(
            f"the vLLM behind aitlrt-serve at {proxy_url} applies sampling defaults that no call overrides: {listed} "
            "(from the model's generation_config.json: vLLM's default --generation-config auto). The sampler's "
            "logprobs include them, the trainer's do not, so every importance-sampling ratio would be off. Restart "
            "aitlrt-serve with --generation-config vllm (passed on to vLLM; serve: managed does so)."
        )


def check_server_sampling(args: AgentGRPOConfig, proxy_url: str) -> None:
    """``check_sampling`` against the server at ``proxy_url``: what aitlrt-serve forces (``GET /settings``) and the
    defaults of its vLLM (``args.vllm_url``, else the proxy's upstream; a warning where they cannot be read)."""
    forced = proxy_request(proxy_url, "GET", "/settings").json()["sampling"]
    upstream = args.vllm_url or proxy_request(proxy_url, "GET", "/weights").json()["upstream"]
    defaults = served_sampling_defaults(upstream.rstrip("/"), vllm_key(admin_key(proxy_url) or ""))
    if defaults is None:
        log.warning(
            "the sampling defaults of the vLLM behind %s could not be read: make sure it runs with "
            "--generation-config vllm, or a penalty of the model's generation_config.json applies to every call",
            proxy_url,
        )
    check_sampling(args, forced, proxy_url, defaults)
