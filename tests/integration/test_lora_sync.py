"""LoRA weight sync sends merged weights under the base model's names and never touches the model's own weights."""

from __future__ import annotations

from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from aitlrt.training.weight_sync import lora_weights
from tests.conftest import admin


def test_lora_weights_match_the_base_names_and_the_merged_values(model_dir):
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    names = set(base.state_dict())
    original = {k: v.clone() for k, v in base.state_dict().items()}
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    for name, param in model.named_parameters():
        if "lora_B" in name:  # PEFT starts B at zero: make the adapter do something
            torch.nn.init.normal_(param, std=0.02)
    with torch.no_grad():
        probe = torch.tensor([[1, 2, 3, 4, 5]])
        with_adapter = model(probe).logits

    merged = {name: tensor.clone() for name, tensor in lora_weights(model)}
    assert set(merged) == names - {"lm_head.weight"}  # tied to the embeddings: sent once
    unmerged = dict(lora_weights(model, merge=False))
    assert list(unmerged) == list(merged)
    assert all(unmerged[k].shape == merged[k].shape and unmerged[k].dtype == merged[k].dtype for k in merged)
    q = "model.layers.0.self_attn.q_proj.weight"
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    delta = (layer.lora_B["default"].weight @ layer.lora_A["default"].weight) * layer.scaling["default"]
    assert torch.allclose(merged[q], original[q] + delta, atol=1e-6)
    assert torch.equal(merged["model.layers.0.mlp.up_proj.weight"], original["model.layers.0.mlp.up_proj.weight"])

    # A plain model loaded with the merged weights behaves like the adapter model...
    plain = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    plain.load_state_dict(merged, strict=False)
    with torch.no_grad():
        assert torch.allclose(plain(probe).logits, with_adapter, atol=1e-3)  # logits ~10: fp32 rounding
        # ...and the PEFT model is unmerged again: its base weights are the originals, its output unchanged.
        assert torch.equal(layer.base_layer.weight, original[q])
        assert torch.allclose(model(probe).logits, with_adapter, atol=1e-6)


def test_a_lora_trainer_syncs_merged_weights_into_the_server(served, tokenizer, tmp_path, restore_weights):
    """Through the trainer's own sync: the server then scores a probe like the merged model does."""
    import httpx
    from datasets import Dataset

    from aitlrt.training.config import AgentGRPOConfig
    from aitlrt.training.trainer import AgentGRPOTrainer
    from tests.integration.test_train import probe_logprobs, trainer_logprobs

    model = AutoModelForCausalLM.from_pretrained(served.model_dir, dtype=torch.float32)
    config = AgentGRPOConfig(
        output_dir=str(tmp_path), proxy_url=served.url, per_device_train_batch_size=2, num_generations=2, report_to=[]
    )
    trainer = AgentGRPOTrainer(
        model=model,
        reward_funcs=[lambda **k: [0.0] * len(k["prompts"])],
        args=config,
        processing_class=tokenizer,
        train_dataset=Dataset.from_list([{"prompt": "p", "instance_id": "x", "problem_statement": "p"}]),
        peft_config=LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "up_proj"]),
        agent=object(),
    )
    for name, param in trainer.model.named_parameters():
        if "lora_B" in name:  # as if trained: a clearly different policy
            torch.nn.init.normal_(param, std=0.1)
    probe = tokenizer("def add(a, b):\n    return a + b\n")["input_ids"]
    before = probe_logprobs(served, probe)
    version = httpx.get(f"{served.url}/weights", headers=admin(served.url)).json()["weight_version"]
    trainer.sync_weights()  # and probes: the server against the adapter model
    assert (
        trainer.weight_version
        == httpx.get(f"{served.url}/weights", headers=admin(served.url)).json()["weight_version"]
        == version + 1
    )
    (probed,) = trainer._metrics["train"]["weight_probe/mean_gap"]
    assert 0 < probed < config.weight_probe_tolerance
    after = probe_logprobs(served, probe)
    with torch.no_grad():
        expected = trainer_logprobs(trainer.model, probe)  # the adapter model itself (fp32)
    moved = sum(abs(a - b) for a, b in zip(after, before, strict=True)) / len(probe)
    gap = sum(abs(a - e) for a, e in zip(after, expected, strict=True)) / len(probe)
    assert moved > 0.1, moved  # the server really serves the new policy ...
    print(f"LoRA sync: server moved {moved:.3f} nats/token, gap to the adapter model {gap:.3f}")
    # ... and scores like the LoRA model: within vLLM's bf16-vs-fp32 noise (~0.04 nats/token mean here), well
    # below how far the policy moved.
    assert gap < 0.1 and gap < moved / 2, (gap, moved)


def test_an_adapter_folder_resolves_to_its_merged_model(model_dir, tmp_path):
    """What a ``--use_peft`` run saves (an adapter, no model) is served and evaluated as the merged model, made once
    in float32 and made again when the adapter changes."""
    import os

    from aitlrt.common.model import resolve_model

    probe = torch.tensor([[1, 2, 3, 4, 5]])
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        without_adapter = base(probe).logits
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.02)
    adapter = tmp_path / "adapter"
    model.save_pretrained(adapter)
    with torch.no_grad():
        with_adapter = model(probe).logits

    merged = Path(resolve_model(str(adapter)))
    assert merged == adapter / "merged" and (merged / "tokenizer_config.json").is_file()
    plain = AutoModelForCausalLM.from_pretrained(merged)
    assert plain.dtype == torch.float32
    with torch.no_grad():
        assert torch.allclose(plain(probe).logits, with_adapter, atol=1e-3)
        assert not torch.allclose(without_adapter, with_adapter, atol=1e-3)  # the adapter does change the output

    made = (merged / ".aitlrt-prepared").stat().st_mtime_ns
    assert resolve_model(str(adapter)) == str(merged)
    assert (merged / ".aitlrt-prepared").stat().st_mtime_ns == made  # reused
    weights = adapter / "adapter_model.safetensors"
    os.utime(weights, (weights.stat().st_atime + 60, weights.stat().st_mtime + 60))
    assert resolve_model(str(adapter)) == str(merged)
    assert (merged / ".aitlrt-prepared").stat().st_mtime_ns > made  # the adapter is newer: merged again
    assert resolve_model(str(model_dir)) == str(model_dir)  # a full model passes through
