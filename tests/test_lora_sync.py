"""LoRA weight sync sends merged weights under the base model's names and never touches the model's own weights."""

from __future__ import annotations

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from aitlrt.trainer import merged_state_dict


def test_merged_state_dict_matches_the_base_names_and_the_merged_values(model_dir):
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

    merged = merged_state_dict(model)
    assert set(merged) == names
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
