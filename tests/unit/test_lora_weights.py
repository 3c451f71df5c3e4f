"""What the weight sync sends for a PEFT model is the policy the trainer trains: a plain model loaded with it scores
as the adapter model does, for DoRA, a LoRA bias and ``modules_to_save`` too; what cannot be served is refused."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

from aitlrt.training.weight_sync import lora_weights

PROBE = torch.tensor([[1, 5, 9, 14, 3, 27]])


def tiny_llama(tied: bool = False) -> LlamaForCausalLM:
    """A randomly initialised 2-layer Llama of width 32 with biased attention projections (as Qwen2's), seeded."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
        attention_bias=True,
        tie_word_embeddings=tied,
    )
    return LlamaForCausalLM(config)


def trained(config: LoraConfig, tied: bool = False) -> tuple[torch.nn.Module, set[str]]:
    """A tiny Llama under ``config`` with every adapter tensor moved away from its initial value (as training does),
    and the base model's weight names."""
    base = tiny_llama(tied)
    names = set(base.state_dict())
    model = get_peft_model(base, config)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():
            if param.requires_grad:
                param.add_(torch.randn(param.shape, generator=gen) * 0.05)
    return model, names


def served_logits(model: torch.nn.Module) -> torch.Tensor:
    """The logits of a plain model (what vLLM loads) given ``lora_weights(model)``."""
    plain = tiny_llama()
    sent = dict(lora_weights(model))
    missing, unexpected = plain.load_state_dict(sent, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    with torch.no_grad():
        return plain(PROBE).logits


@pytest.mark.parametrize(
    "config",
    [
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], use_dora=True),
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_bias=True),
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], modules_to_save=["lm_head"]),
    ],
    ids=["dora", "lora_bias", "modules_to_save"],
)
def test_the_weights_sent_score_as_the_adapter_model_does(config):
    model, names = trained(config)
    with torch.no_grad():
        policy = model(PROBE).logits
    assert {name for name, _ in lora_weights(model)} == names  # the base model's names, nothing else
    assert torch.allclose(served_logits(model), policy, atol=1e-5)
    with torch.no_grad():  # and the adapter model itself was not touched
        assert torch.equal(model(PROBE).logits, policy)


def test_dora_is_merged_as_peft_merges_it():
    model, _ = trained(LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], use_dora=True))
    sent = {name: tensor.clone() for name, tensor in lora_weights(model)}
    merged = model.merge_and_unload().state_dict()
    for name, tensor in sent.items():
        assert torch.allclose(tensor, merged[name], atol=1e-6), name


def test_a_trained_copy_of_a_tied_weight_is_refused_naming_both():
    model, _ = trained(LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["embed_tokens"]), tied=True)
    with pytest.raises(ValueError, match=r"tied to another.*embed_tokens.*lm_head.*tie_word_embeddings=False"):
        list(lora_weights(model))


def test_a_lora_bias_on_a_layer_without_a_bias_is_refused():
    model, _ = trained(LoraConfig(r=4, target_modules=["q_proj", "up_proj"], lora_bias=True))
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.up_proj: lora_bias=True on a layer without a bias"):
        list(lora_weights(model))


def test_an_unmerged_read_gives_the_base_weights_under_the_same_names():
    model, names = trained(LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"], use_dora=True))
    base = dict(lora_weights(model, merge=False))
    merged = dict(lora_weights(model))
    assert set(base) == set(merged) == names
    assert all(base[k].shape == merged[k].shape and base[k].dtype == merged[k].dtype for k in base)
