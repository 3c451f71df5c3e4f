"""Weight sync: how the policy reaches the server after an update.

One protocol, ``WeightSync`` (after trl's async GRPO ``WeightTransferProtocol``), with three implementations:
``ReloadSync`` (safetensors + ``POST /weights/reload`` on the proxy; CPU, a filesystem the server sees),
``NcclSync`` (trl's ``VLLMClient`` straight into vLLM over NCCL, while the proxy holds new calls between
``POST /weights/pause`` and ``/weights/resume``) and ``NoSync``; ``make_weight_sync`` picks one from
``AgentGRPOConfig.weight_sync``. Every rank calls ``sync``: the main process sends, and under ZeRO-3 the other
ranks join its reads of the weights (gathers are collectives). LoRA runs send the merged weights (``lora_weights``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

import httpx
import torch
from accelerate.utils import gather_object
from transformers import Trainer

from aitlrt.common.keys import admin_headers, admin_key, bearer, vllm_key
from aitlrt.training.config import AgentGRPOConfig

if TYPE_CHECKING:
    from trl.generation.vllm_client import VLLMClient


class WeightSync(Protocol):
    def sync(self, trainer: Trainer) -> int | None:
        """Push ``trainer``'s policy to the server (every rank calls); the server's new weight version, the same on
        every rank, or None when nothing was pushed."""
        ...


def proxy_request(proxy_url: str, method: str, path: str, **kw: Any) -> httpx.Response:
    """An admin request to ``aitlrt-serve``, with its admin key (``aitlrt.common.keys.admin_key``; 10-minute
    timeout: a reload waits for vLLM); raises on an error status."""
    headers = admin_headers(proxy_url)
    return httpx.request(method, f"{proxy_url}{path}", headers=headers, timeout=600, **kw).raise_for_status()


def _once(items: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Each storage once, under its first name: a tied ``lm_head`` is left out (as ``save_pretrained`` does and
    vLLM expects), so it is neither copied nor sent twice."""
    seen: set[int] = set()
    for name, tensor in items:
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            yield name, tensor


def lora_weights(peft_model: torch.nn.Module, merge: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """The weights vLLM loads for a PEFT model, one at a time, under the base model's names, each storage once.

    With ``merge``, the active LoRA adapters are added in out of place where the layer lives, one layer at a time: no
    full copy of the model is made, and unlike merge/unmerge the model's own weights are never touched, so repeated
    syncs cannot accumulate rounding drift into a bf16 base. Plain LoRA adds ``get_delta_weight`` (and the LoRA bias
    of ``lora_bias=True``); DoRA rescales ``W + delta`` by its magnitude vector column by column, as peft's merge
    does; a module of ``modules_to_save`` is sent as its trained copy. What cannot be served that way (other LoRA
    variants, DoRA stacked with other adapters, a trained copy of a weight tied to another) raises ValueError
    naming it: a sync that sent the base weights instead would serve another policy than the one trained. Without
    ``merge``: the base weights (the same names, shapes and dtypes). Unmerged tensors are the model's own: copy what
    you keep.
    """
    from peft.tuners.lora import LoraLayer

    def base_name(name: str) -> str:
        return name.removeprefix("base_model.model.").replace(".base_layer", "").replace(".original_module", "")

    layers: dict[str, Any] = {}  # LoraLayer's concrete subclasses (Linear, Embedding, ...) define get_delta_weight
    for name, module in peft_model.named_modules():
        if isinstance(module, LoraLayer) and not module.merged:
            if (
                merge
                and getattr(module.get_base_layer(), "bias", None) is None
                and any(module.lora_bias.get(a, False) for a in module.active_adapters)
            ):
                raise ValueError(
                    f"{base_name(name)}: lora_bias=True on a layer without a bias, which the served model has no "
                    "tensor for; train without lora_bias"
                )
            layers[base_name(f"{name}.base_layer.weight")] = module
            layers[base_name(f"{name}.base_layer.bias")] = module
    state = [(base_name(k), v) for k, v in peft_model.state_dict().items() if not _adapter_key(k)]
    trained = _modules_to_save(peft_model, base_name) if merge else {}
    sharing: dict[int, list[str]] = {}
    for name, value in state:
        sharing.setdefault(value.data_ptr(), []).append(name)
    if tied := [names for names in sharing.values() if len(names) > 1 and set(names) & set(trained)]:
        raise ValueError(
            f"LoRA modules_to_save trains a copy of a weight tied to another ({tied}): vLLM loads one tensor for "
            "both, the trainer's model then uses two; untie them (tie_word_embeddings=False) or leave the module "
            "out of modules_to_save"
        )
    for name, value in _once(state):
        tensor, layer = value.detach(), layers.get(name)
        if name in trained:
            tensor = trained[name]
        elif merge and layer is not None:
            tensor = _merged(layer, name, tensor)
        yield name, tensor


def _adapter_key(key: str) -> bool:
    """A PEFT state-dict key of the adapter's own tensors (LoRA matrices, DoRA magnitudes, trained module copies)."""
    return "lora_" in key or ".modules_to_save." in key


def _modules_to_save(peft_model: torch.nn.Module, base_name: Callable[[str], str]) -> dict[str, torch.Tensor]:
    """The trained copies of ``modules_to_save`` (their active adapter's), under the base model's names."""
    from peft.utils import ModulesToSaveWrapper

    out = {}
    for name, module in peft_model.named_modules():
        if not isinstance(module, ModulesToSaveWrapper) or module.disable_adapters:
            continue
        active = [a for a in module.active_adapters if a in module.modules_to_save]
        if len(active) > 1:
            raise ValueError(f"{name}: {len(active)} active modules_to_save adapters; the sync serves one")
        for adapter in active:
            for key, tensor in module.modules_to_save[adapter].state_dict().items():
                out[base_name(f"{name}.{key}")] = tensor.detach()
    return out


def _merged(layer: Any, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` (the weight or bias ``name`` of LoRA layer ``layer``) with its active adapters merged in."""
    from peft.tuners.lora.variants import DoraLinearVariant
    from peft.utils.other import transpose

    active = [a for a in layer.active_adapters if a in layer.lora_A]
    variants = {a: v for a, v in getattr(layer, "lora_variant", {}).items() if a in active}
    if variants and (len(active) > 1 or not all(isinstance(v, DoraLinearVariant) for v in variants.values())):
        kinds = sorted({type(v).__name__ for v in variants.values()})
        raise ValueError(
            f"{name}: LoRA variant(s) {kinds} with {len(active)} active adapter(s): the weight sync merges plain LoRA "
            "and a single DoRA adapter on linear layers; merge the adapter (merge_and_unload) and train without it"
        )
    with torch.no_grad():
        for adapter in active:
            if name.endswith(".bias"):
                if layer.lora_bias.get(adapter, False):
                    tensor = tensor + (layer.lora_B[adapter].bias * layer.scaling[adapter]).to(tensor.dtype)
                continue
            delta = layer.get_delta_weight(adapter)
            if adapter in variants:  # DoRA: m * (W + delta) / ||W + delta||, the norm taken per output row
                base = tensor.to(delta.dtype)
                magnitude = layer.lora_magnitude_vector[adapter]
                norm = magnitude.get_weight_norm(base, transpose(delta, layer.fan_in_fan_out), scaling=1)
                scale = transpose((magnitude.weight / norm).view(-1, 1), layer.fan_in_fan_out)
                tensor = (scale * (base + delta)).to(tensor.dtype)
            else:
                tensor = tensor + delta.to(tensor.dtype)
    return tensor


def zero3(trainer: Trainer) -> bool:
    return trainer.is_deepspeed_enabled and trainer.accelerator.state.deepspeed_plugin.zero_stage == 3


def policy_weights(trainer: Trainer, merge: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of the weights vLLM serves, each storage once, lazily where they live (``lora_weights`` for
    LoRA). The model's own tensors: copy what you keep. Under ZeRO-3 every rank must iterate: the engine gathers
    the 16-bit weights (``zero3_save_16bit_model``) and LoRA layers are gathered to merge."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    if hasattr(model, "merge_adapter"):
        if zero3(trainer):
            import deepspeed

            with deepspeed.zero.GatheredParameters(list(model.parameters())):
                yield from lora_weights(model, merge)
        else:
            yield from lora_weights(model, merge)
        return
    engine = trainer.model_wrapped if trainer.is_deepspeed_enabled else trainer.model  # accelerate needs the engine
    state = trainer.accelerator.get_state_dict(engine)  # ZeRO-3: a gather every rank joins, None but on rank 0
    yield from _once(state.items() if state is not None else ())


def host_state_dict(trainer: Trainer) -> dict[str, torch.Tensor]:
    """What the reload sync saves: the served weights in host memory (main process; ZeRO-3: every rank calls)."""
    return {name: tensor.to("cpu").contiguous() for name, tensor in policy_weights(trainer)}


def _sent_by_main(trainer: Trainer, send: Callable[[], int], reads: int) -> int:
    """``send()`` on the main process, which reads the weights ``reads`` times; under ZeRO-3 the other ranks join
    those reads. The new weight version, on every rank."""
    version = None
    if trainer.accelerator.is_main_process:
        version = send()
    elif zero3(trainer):
        for _ in range(reads):
            for _ in policy_weights(trainer):
                pass
    return gather_object([version])[0]


class ReloadSync:
    """Save the policy as ``FOLDER/model.safetensors`` and have the proxy reload vLLM from it."""

    def __init__(self, proxy_url: str, folder: Path) -> None:
        self.proxy_url, self.folder = proxy_url, folder

    def sync(self, trainer: Trainer) -> int | None:
        return _sent_by_main(trainer, lambda: self._send(trainer), reads=1)

    def _send(self, trainer: Trainer) -> int:
        from safetensors.torch import save_file

        self.folder.mkdir(parents=True, exist_ok=True)
        save_file(host_state_dict(trainer), str(self.folder / "model.safetensors"))
        response = proxy_request(self.proxy_url, "POST", "/weights/reload", json={"path": str(self.folder)})
        return response.json()["weight_version"]


class NcclSync:
    """Stream the policy into vLLM with trl's ``VLLMClient`` (connected at the first sync) while the proxy holds new
    calls. ``vllm_url``: vLLM as the trainer sees it (empty: the proxy's upstream)."""

    def __init__(self, proxy_url: str, vllm_url: str, group_port: int) -> None:
        self.proxy_url, self.vllm_url, self.group_port = proxy_url, vllm_url, group_port
        self.client: VLLMClient | None = None

    def sync(self, trainer: Trainer) -> int | None:
        return _sent_by_main(trainer, lambda: self._send(trainer), reads=2)

    def _send(self, trainer: Trainer) -> int:
        meta = [(n, str(t.dtype).removeprefix("torch."), list(t.shape)) for n, t in policy_weights(trainer, False)]
        device = trainer.accelerator.device  # ZeRO-3 consolidates on the host; NCCL sends from the GPU
        if self.client is None:
            url = self.vllm_url or proxy_request(self.proxy_url, "GET", "/weights").json()["upstream"]
            self.client = keyed_vllm_client(url, vllm_key(admin_key(self.proxy_url) or ""), self.group_port)
            self.client.init_communicator(device=device)
        version = proxy_request(self.proxy_url, "POST", "/weights/pause").json()["weight_version"]
        try:
            weights = ((n, t.to(device).contiguous()) for n, t in policy_weights(trainer))
            self.client.update_named_params(meta, weights)
            self.client.reset_prefix_cache()
        except BaseException:  # the old weights may be half-replaced: say so loudly
            proxy_request(self.proxy_url, "POST", "/weights/resume", json={})
            raise
        resumed = proxy_request(self.proxy_url, "POST", "/weights/resume", json={"version": version + 1})
        return resumed.json()["weight_version"]


def keyed_vllm_client(url: str, key: str, group_port: int) -> VLLMClient:
    """trl's ``VLLMClient`` for vLLM at ``url``, sending vLLM's ``key`` (``aitlrt.common.keys.vllm_key``): trl sends
    none, and vLLM checks it on ``/v1`` (the client's ``/v1/models``), not on the weight-transfer routes."""
    from trl.generation.vllm_client import VLLMClient

    headers = bearer(key)

    class KeyedClient(VLLMClient):
        def _get(self, url: str, **kwargs: Any) -> dict:
            return super()._get(url, headers=headers, **kwargs)

        def _post(self, url: str, **kwargs: Any) -> dict:
            return super()._post(url, headers=headers, **kwargs)

    return KeyedClient(base_url=url, group_port=group_port, connection_timeout=60)


class NoSync:
    """``weight_sync=none``: the server keeps the weights it serves."""

    def sync(self, trainer: Trainer) -> int | None:
        return None


def make_weight_sync(args: AgentGRPOConfig) -> WeightSync:
    """The sync that ``args.weight_sync`` names (reload, nccl or none)."""
    proxy_url = args.proxy_url.rstrip("/")
    if args.weight_sync == "reload":
        return ReloadSync(proxy_url, Path(args.weight_sync_dir or Path(cast(str, args.output_dir)) / "sync"))
    if args.weight_sync == "nccl":
        return NcclSync(proxy_url, args.vllm_url, args.vllm_group_port)
    return NoSync()
