"""``weight_sync=nccl``: the trainer's side of an NCCL sync against a real ``aitlrt-serve``.

The NCCL transfer itself (trl's ``VLLMClient`` into vLLM's weight-transfer engine) needs CUDA on both sides; here a
recording client stands in for it, so what is checked is everything around it: the proxy holds new calls while
the weights stream, learns the new version afterwards, says where vLLM is, and a failed transfer leaves the proxy
serving (on the old version) and the error raised. Against the real vLLM CPU server, the weight probe after the
sync finds a transfer that never reached vLLM, although the proxy took the version the trainer declared.
"""

from __future__ import annotations

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.conftest import admin


class RecordingClient:
    """Stands in for trl's ``VLLMClient`` after ``init_communicator``: records what would be streamed."""

    def __init__(self, proxy_url: str, fail: bool = False) -> None:
        self.proxy_url, self.fail = proxy_url, fail
        self.metadata: list[tuple[str, str, list[int]]] = []
        self.paused_during: bool | None = None
        self.prefix_cache_reset = False

    def update_named_params(self, metadata, named_params) -> None:
        self.paused_during = httpx.get(f"{self.proxy_url}/weights", headers=admin(self.proxy_url)).json()["paused"]
        if self.fail:
            raise RuntimeError("NCCL timeout (injected)")
        self.metadata = metadata
        for (name, _, shape), (streamed, tensor) in zip(metadata, named_params, strict=True):
            assert name == streamed and list(tensor.shape) == shape

    def reset_prefix_cache(self) -> None:
        self.prefix_cache_reset = True


def nccl(proxy_url: str, client: RecordingClient):
    """An NCCL sync streaming through ``client`` (the config refuses ``weight_sync=nccl`` without CUDA; this needs
    none)."""
    from aitlrt.training.weight_sync import NcclSync

    sync = NcclSync(proxy_url, "", 51216)
    sync.client = client
    return sync


@pytest.fixture
def trainer(scripted_upstream, start_proxy, model_dir, tokenizer, tmp_path):
    from datasets import Dataset

    from aitlrt.training.config import AgentGRPOConfig
    from aitlrt.training.trainer import AgentGRPOTrainer

    proxy = start_proxy(scripted_upstream)
    config = AgentGRPOConfig(
        output_dir=str(tmp_path / "run"),
        proxy_url=proxy.url,
        per_device_train_batch_size=2,
        num_generations=2,
        report_to=[],
        weight_probe=False,  # the scripted upstream is no model to probe
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    trainer = AgentGRPOTrainer(
        model=model,
        reward_funcs=[lambda **k: [0.0] * len(k["prompts"])],
        args=config,
        processing_class=tokenizer,
        train_dataset=Dataset.from_list([{"prompt": "p", "instance_id": "x", "problem_statement": "p"}]),
        agent=object(),
    )
    yield trainer, proxy.url, scripted_upstream


def test_nccl_sync_holds_calls_while_streaming_and_bumps_the_version(trainer):
    trainer, url, upstream = trainer
    assert (
        httpx.get(f"{url}/weights", headers=admin(url)).json()["upstream"] == upstream
    )  # where the NCCL client connects
    before = httpx.get(f"{url}/weights", headers=admin(url)).json()["weight_version"]
    trainer.weight_sync = nccl(url, client := RecordingClient(url))
    trainer.sync_weights()
    assert trainer.weight_version == before + 1

    assert client.paused_during is True and client.prefix_cache_reset
    names = [name for name, _, _ in client.metadata]
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names  # tied: sent once
    assert len(names) == len(set(names)) and set(names) == set(trainer.model.state_dict()) - {"lm_head.weight"}
    assert {dtype for _, dtype, _ in client.metadata} == {"float32"}
    after = httpx.get(f"{url}/weights", headers=admin(url)).json()
    assert after["weight_version"] == before + 1 and not after["paused"]


def test_a_failed_nccl_transfer_reopens_the_proxy_on_the_old_version_and_raises(trainer):
    trainer, url, _ = trainer
    before = httpx.get(f"{url}/weights", headers=admin(url)).json()["weight_version"]
    trainer.weight_sync = nccl(url, RecordingClient(url, fail=True))
    with pytest.raises(RuntimeError, match="NCCL timeout"):
        trainer.sync_weights()
    after = httpx.get(f"{url}/weights", headers=admin(url)).json()
    assert after == {**after, "weight_version": before, "paused": False}


def test_nccl_sync_is_refused_without_cuda_with_the_alternative_named(tmp_path):
    from aitlrt.training.config import AgentGRPOConfig

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: weight_sync=nccl is allowed")
    with pytest.raises(ValueError, match=r"needs CUDA on the trainer.*use weight_sync=reload"):
        AgentGRPOConfig(output_dir=str(tmp_path), proxy_url="http://x", weight_sync="nccl")


def test_an_nccl_sync_that_never_reached_vllm_fails_the_weight_probe(served, tokenizer, tmp_path):
    """On NCCL the new weight version is what the trainer declares: only the probe sees the weights themselves."""
    from datasets import Dataset

    from aitlrt.training.config import AgentGRPOConfig
    from aitlrt.training.probe import WeightProbeError
    from aitlrt.training.trainer import AgentGRPOTrainer

    config = AgentGRPOConfig(
        output_dir=str(tmp_path), proxy_url=served.url, per_device_train_batch_size=2, num_generations=2, report_to=[]
    )
    trainer = AgentGRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(served.model_dir, dtype=torch.float32),
        reward_funcs=[lambda **k: [0.0] * len(k["prompts"])],
        args=config,
        processing_class=tokenizer,
        train_dataset=Dataset.from_list([{"prompt": "p", "instance_id": "x", "problem_statement": "p"}]),
        agent=object(),
    )
    trainer.weight_sync = nccl(served.url, RecordingClient(served.url))  # streams nothing into vLLM
    trainer.model.train()  # as in a training step: the probe's gap goes to the train metrics
    before = httpx.get(f"{served.url}/weights", headers=admin(served.url)).json()["weight_version"]
    trainer.sync_weights()  # the policy is still the served model: the probe after resume passes
    (gap,) = trainer._metrics["train"]["weight_probe/mean_gap"]
    assert 0 < gap < config.weight_probe_tolerance

    with torch.no_grad():  # an update the "transfer" then never delivers
        gen = torch.Generator().manual_seed(0)
        for name, param in trainer.model.named_parameters():
            if name.endswith("mlp.down_proj.weight"):
                param.add_(0.05 * torch.randn(param.shape, generator=gen))
    with pytest.raises(WeightProbeError, match=f"weight version {before + 2}.*expects weight version {before + 2}"):
        trainer.sync_weights()
    assert httpx.get(f"{served.url}/weights", headers=admin(served.url)).json() == {
        "weight_version": before + 2,  # the proxy took the declared version and reopened
        "paused": False,
        "inflight": 0,
        "upstream": served.vllm_url,
    }
