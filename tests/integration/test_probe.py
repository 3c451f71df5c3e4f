"""The weight probe and the sampling check end to end: ``POST /weights/probe`` against the real vLLM CPU server, a
training run whose server serves its policy passes the probe at every step, and the step after its server was given
other weights behind its back fails; ``GET /settings`` and a trainer whose server forces other sampling, which
fails at connect."""

from __future__ import annotations

import shutil

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from aitlrt.training.probe import SamplingMismatchError, WeightProbeError, probe_token_ids
from aitlrt.training.weight_sync import ReloadSync, proxy_request
from tests.conftest import admin
from tests.helpers.multirank_run import tiny_trainer
from tests.integration.test_train import probe_logprobs

ONE_RANK = {"per_device_train_batch_size": 4}


def test_the_probe_route_answers_vllms_prompt_logprobs_under_the_current_version(served, tokenizer):
    ids = probe_token_ids(tokenizer)
    assert 32 <= len(ids) <= 64
    resp = httpx.post(f"{served.url}/weights/probe", headers=admin(served.url), json={"token_ids": ids}, timeout=120)
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert (
        body["weight_version"] == httpx.get(f"{served.url}/weights", headers=admin(served.url)).json()["weight_version"]
    )
    assert body["model"] == httpx.get(f"{served.url}/v1/models", headers=admin(served.url)).json()["data"][0]["id"]
    assert body["logprobs"] == pytest.approx(probe_logprobs(served, ids), abs=1e-5)

    for bad in ({"token_ids": [5]}, {"token_ids": [5, "x"]}, {"token_ids": [5, -1]}, {}):
        resp = httpx.post(f"{served.url}/weights/probe", headers=admin(served.url), json=bad, timeout=30)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "token_ids", (bad, resp.text)


def test_a_probe_upstream_cannot_answer_is_a_clear_502(scripted_upstream, start_proxy):
    proxy = start_proxy(scripted_upstream)
    resp = httpx.post(f"{proxy.url}/weights/probe", headers=admin(proxy.url), json={"token_ids": [1, 2, 3]}, timeout=30)
    assert resp.status_code == 502
    assert resp.json()["error"]["code"] == "probe_failed"
    assert "lacks the prompt logprobs" in resp.json()["error"]["message"]


class SabotagedSync(ReloadSync):
    """A reload sync whose second and later syncs leave the server on ``other`` weights, reporting the server's own
    (new) version as a real sync does: the weight version check cannot tell."""

    def __init__(self, proxy_url: str, folder, other) -> None:
        super().__init__(proxy_url, folder)
        self.other, self.syncs = other, 0

    def _send(self, trainer) -> int:
        version = super()._send(trainer)
        self.syncs += 1
        if self.syncs < 2:
            return version
        return proxy_request(self.proxy_url, "POST", "/weights/reload", json={"path": str(self.other)}).json()[
            "weight_version"
        ]


def test_the_probe_passes_while_the_server_serves_the_policy_and_fails_the_step_once_it_does_not(
    served, tokenizer, make_repo, tmp_path, restore_weights
):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    from aitlrt.tasks.task import task_from_row
    from aitlrt.training.config import AgentGRPOConfig
    from aitlrt.training.trainer import AgentGRPOTrainer

    other = tmp_path / "other"  # another run's weights: the served ones with noise on the MLPs
    shutil.copytree(served.model_dir, other)
    weights = load_file(other / "model.safetensors")
    gen = torch.Generator().manual_seed(0)
    for name, w in weights.items():
        if name.endswith("mlp.down_proj.weight"):
            weights[name] = (w.float() + 0.05 * torch.randn(w.shape, generator=gen)).to(w.dtype)
    save_file(weights, other / "model.safetensors", metadata={"format": "pt"})

    repo = make_repo({"hello.py": "print('hello')\n"})
    row = task_from_row({"instance_id": "probe-0", "problem_statement": "Say hi.", "repo_path": str(repo)}).as_row()
    config = AgentGRPOConfig(
        output_dir=str(tmp_path / "run"),
        proxy_url=served.url,
        agent="aider-warm",  # the real agent, end to end
        max_steps=3,
        per_device_train_batch_size=2,
        num_generations=2,
        learning_rate=1e-3,
        top_p=0.95,  # the served fixture's sampling
        max_completion_length=48,
        rollout_concurrency=2,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=0,
    )
    trainer = AgentGRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(served.model_dir, dtype=torch.float32),
        reward_funcs=[lambda prompts, **k: [float(i % 2) for i in range(len(prompts))]],  # never a tie: it trains
        args=config,
        processing_class=tokenizer,
        train_dataset=Dataset.from_list([{"prompt": row["problem_statement"], **row}]),
    )
    trainer.weight_sync = SabotagedSync(served.url, tmp_path / "sync", other)
    with pytest.raises(WeightProbeError) as err:
        try:
            trainer.train()
        finally:
            trainer.close()
    # Steps 1 (probed before the first generation) and 2 (after a real sync of the updated policy) passed ...
    logged = [e for e in trainer.state.log_history if "weight_probe/mean_gap" in e]
    assert [e["step"] for e in logged] == [1, 2]
    print("probe gaps (mean, max):", [(e["weight_probe/mean_gap"], e["weight_probe/max_gap"]) for e in logged])
    assert all(e["weight_probe/mean_gap"] < config.weight_probe_tolerance for e in logged)
    assert all(e["weight_probe/max_gap"] >= e["weight_probe/mean_gap"] > 0 for e in logged)
    # ... and step 3's sync left the server on other weights under a version the trainer accepted: the probe failed.
    assert (
        trainer.state.global_step == 2
        and trainer.weight_version
        == httpx.get(f"{served.url}/weights", headers=admin(served.url)).json()["weight_version"]
    )
    message = str(err.value)
    assert "the server does not serve the trainer's policy" in message
    assert "beyond weight_probe_tolerance=0.25 (mean)" in message and "(trainer at step 2)" in message


def test_a_server_forcing_other_sampling_fails_at_connect_naming_both_values(
    scripted_upstream, start_proxy, make_repo, tmp_path
):
    proxy = start_proxy(scripted_upstream, "--temperature", "0.7", "--max-tokens", "64")
    forced = httpx.get(f"{proxy.url}/settings", headers=admin(proxy.url)).json()
    assert forced == {"sampling": {"temperature": 0.7, "top_p": 1.0, "top_k": -1, "max_tokens": 64}}
    repo = str(make_repo({"README": "tiny\n"}))

    trainer = tiny_trainer(proxy.url, repo, str(tmp_path / "a"), max_steps=1, **ONE_RANK)
    with pytest.raises(SamplingMismatchError) as err:
        trainer.train()
    message = str(err.value)
    assert "it forces temperature=0.7 where the config has temperature=1.0" in message
    assert "it forces max_tokens=64 where the config has max_completion_length=None" in message
    assert "Restart aitlrt-serve with --temperature 1.0 --top-p 1.0 --top-k -1 (and no --max-tokens)" in message
    assert "or set temperature: 0.7, max_completion_length: 64 in the training config" in message
    assert not httpx.get(f"{proxy.url}/rollouts", headers=admin(proxy.url)).json()[
        "rollouts"
    ]  # failed before any rollout

    agreeing = tiny_trainer(
        proxy.url, repo, str(tmp_path / "b"), max_steps=1, temperature=0.7, max_completion_length=64, **ONE_RANK
    )
    agreeing.train()
    assert agreeing.state.global_step == 1
