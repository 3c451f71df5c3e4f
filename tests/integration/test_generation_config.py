"""A model whose ``generation_config.json`` sets a repetition penalty (as Qwen2.5 checkpoints do), served by the
managed server: vLLM starts with neutral sampling defaults, the trainer's sampling check passes, and the sampled
tokens' logprobs are the trainer's (vLLM's default would have applied the penalty to every call)."""

from __future__ import annotations

import json
import os
import shutil
import statistics

import httpx
import torch

from aitlrt.common.keys import vllm_key
from aitlrt.serving.process import managed_server
from aitlrt.serving.sampling_defaults import served_sampling_defaults, vllm_sampling_defaults
from aitlrt.training.config import AgentGRPOConfig
from aitlrt.training.probe import check_server_sampling
from aitlrt.training.weight_sync import proxy_request
from tests.conftest import chat, trace
from tests.integration.test_train import trainer_logprobs

# a prompt the bundled model answers by repeating itself: the penalty would change most of the sampled logprobs
PROMPT = "Repeat this list five times: apple, pear, apple, pear, apple, pear."


def test_a_penalty_in_the_models_generation_config_does_not_reach_the_sampler(model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    model = tmp_path / "penalised"
    shutil.copytree(model_dir, model, copy_function=os.symlink)  # the weights linked, not copied
    config = json.loads((model_dir / "generation_config.json").read_text())
    (model / "generation_config.json").unlink()
    (model / "generation_config.json").write_text(json.dumps({**config, "repetition_penalty": 1.1}))

    run = tmp_path / "serve"
    with managed_server(
        model, run, temperature=1.0, top_p=1.0, top_k=-1, max_tokens=40, extra_args=["--enforce-eager"]
    ) as serve:
        started = next(line for line in (run / "serve.log").read_text().splitlines() if "starting vLLM:" in line)
        assert "--generation-config vllm" in started, started
        check_server_sampling(
            AgentGRPOConfig(output_dir=str(tmp_path), proxy_url=serve.url, max_completion_length=40, report_to=[]),
            serve.url,
        )
        # what the check reads: vLLM's own config, naming the flag and the model folder it would read otherwise
        upstream = proxy_request(serve.url, "GET", "/weights").json()["upstream"]
        info = httpx.get(
            f"{upstream}/server_info", params={"config_format": "json"}, headers=serve.headers, timeout=120
        ).json()["vllm_config"]["model_config"]
        assert info["generation_config"] == "vllm" and vllm_sampling_defaults(info) == {}
        assert vllm_sampling_defaults({**info, "generation_config": "auto"}) == {"repetition_penalty": 1.1}
        assert served_sampling_defaults(upstream, vllm_key(serve.api_key)) == {}
        assert chat(serve.url, "penalty-1", PROMPT, seed=3).status_code == 200
        (call,) = trace(serve.url, "penalty-1")

    ids, completion = call["prompt_token_ids"], call["completion_token_ids"]
    policy = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    mine = trainer_logprobs(policy, ids + completion)[len(ids) - 1 :]
    gaps = [abs(a - b) for a, b in zip(call["logprobs"], mine, strict=True)]
    # served in fp32 (or bf16 where native: 0.034 mean measured); a penalty of 1.1 moves repeated tokens ~0.1-1 nat
    assert len(gaps) >= 10 and statistics.fmean(gaps) < 0.05 and max(gaps) < 0.3, gaps
