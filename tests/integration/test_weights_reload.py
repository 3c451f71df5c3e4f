"""``POST /weights/reload`` on the real vLLM CPU server: perturbed weights change the output, the
originals bring it back bit for bit, and every record carries the version it was sampled under."""

from __future__ import annotations

import shutil

import httpx
import torch
from safetensors.torch import load_file, save_file

from tests.conftest import admin, chat, trace


def _reload(url: str, path) -> dict:
    resp = httpx.post(f"{url}/weights/reload", headers=admin(url), json={"path": str(path)}, timeout=300)
    assert resp.status_code == 200, resp.text
    return resp.json()


def _sample(url: str, rollout: str) -> dict:
    resp = chat(url, rollout, "Name a prime number.", seed=7, max_tokens=16)
    assert resp.status_code == 200, resp.text
    return trace(url, rollout)[-1]


def test_reload_changes_output_and_restores_it_bit_for_bit(served, tmp_path):
    perturbed = tmp_path / "perturbed"
    shutil.copytree(served.model_dir, perturbed)
    weights = load_file(perturbed / "model.safetensors")
    gen = torch.Generator().manual_seed(0)
    for name, w in weights.items():
        if name.endswith("mlp.down_proj.weight"):
            weights[name] = (w.float() + 0.05 * torch.randn(w.shape, generator=gen)).to(w.dtype)
    save_file(weights, perturbed / "model.safetensors", metadata={"format": "pt"})

    v0 = httpx.get(f"{served.url}/weights", headers=admin(served.url)).json()["weight_version"]
    before = _sample(served.url, "reload-before")
    assert before["weight_version"] == v0

    assert _reload(served.url, perturbed)["weight_version"] == v0 + 1
    changed = _sample(served.url, "reload-perturbed")
    assert changed["weight_version"] == v0 + 1
    assert changed["logprobs"] != before["logprobs"]

    assert _reload(served.url, served.model_dir)["weight_version"] == v0 + 2
    after = _sample(served.url, "reload-restored")
    assert after["weight_version"] == v0 + 2
    assert after["completion_token_ids"] == before["completion_token_ids"]
    assert after["logprobs"] == before["logprobs"]

    text = httpx.get(f"{served.url}/metrics", headers=admin(served.url)).text
    assert f"aitlrt_weight_version {float(v0 + 2)}" in text


def test_reload_of_a_path_without_weights_fails_clearly_and_keeps_the_version(served, tmp_path):
    v0 = httpx.get(f"{served.url}/weights", headers=admin(served.url)).json()["weight_version"]
    for path in ("/nonexistent/weights", str(tmp_path)):
        resp = httpx.post(f"{served.url}/weights/reload", headers=admin(served.url), json={"path": path}, timeout=120)
        assert resp.status_code == 400
        assert "no *.safetensors" in resp.json()["error"]["message"]
    state = httpx.get(f"{served.url}/weights", headers=admin(served.url)).json()
    assert state == {"weight_version": v0, "paused": False, "inflight": 0, "upstream": served.vllm_url}
    assert chat(served.url, "after-failed-reload", "Hi", max_tokens=2).status_code == 200
