"""A vLLM that applies the model's generation config (a Qwen-style ``repetition_penalty``) to every call samples from
another distribution than the trainer's logprobs: the managed server turns it off, and the sampling check refuses a
server that applies it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from aitlrt.serving.process import managed_args
from aitlrt.serving.sampling_defaults import model_sampling_defaults, vllm_sampling_defaults
from aitlrt.training.config import AgentGRPOConfig
from aitlrt.training.probe import SamplingMismatchError, check_sampling

QWEN_STYLE = {"bos_token_id": 1, "eos_token_id": [2, 3], "repetition_penalty": 1.1, "temperature": 0.7, "top_p": 0.8}


@pytest.fixture
def model(tmp_path) -> Path:
    (tmp_path / "generation_config.json").write_text(json.dumps(QWEN_STYLE))
    return tmp_path


def test_the_managed_server_starts_vllm_with_neutral_sampling_defaults(model, tmp_path):
    args = managed_args(model, tmp_path / "serve", temperature=1.0, extra_args=["--enforce-eager"])
    assert args[args.index("--generation-config") + 1] == "vllm" and args[-1] == "--enforce-eager"
    mine = managed_args(model, tmp_path, extra_args=["--generation-config", str(model)])  # the user's own choice
    assert mine.count("--generation-config") == 1 and mine[-1] == str(model)


def test_only_the_fields_the_proxy_does_not_force_count_and_only_off_their_neutral_value(model, tmp_path):
    assert model_sampling_defaults(model) == {"repetition_penalty": 1.1}  # temperature, top_p: always forced
    assert model_sampling_defaults(tmp_path / "no-such-model") is None  # neither a folder nor in the Hub cache
    (tmp_path / "plain").mkdir()
    assert model_sampling_defaults(tmp_path / "plain") == {}  # no generation_config.json: vLLM's neutral values


@pytest.mark.parametrize(
    ("model_config", "applied"),
    [
        ({"generation_config": "auto"}, {"repetition_penalty": 1.1}),  # vLLM's default
        ({"generation_config": "vllm"}, {}),
        ({"generation_config": "auto", "override_generation_config": {"repetition_penalty": 1.0}}, {}),
        ({"generation_config": "vllm", "override_generation_config": {"min_p": 0.05}}, {"min_p": 0.05}),
    ],
)
def test_what_vllm_applies_follows_its_generation_config_flags(model, model_config, applied):
    assert vllm_sampling_defaults({"model": str(model), **model_config}) == applied


def config(tmp_path, **kw) -> AgentGRPOConfig:
    return AgentGRPOConfig(output_dir=str(tmp_path), proxy_url="http://x", report_to=[], **kw)


FORCED = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_tokens": 512}  # AgentGRPOConfig's defaults


def test_a_server_applying_a_penalty_no_call_overrides_is_refused_with_the_flag_that_fixes_it(tmp_path):
    with pytest.raises(SamplingMismatchError) as err:
        check_sampling(config(tmp_path), FORCED, "http://serve", {"repetition_penalty": 1.1})
    for part in ("applies sampling defaults that no call overrides: repetition_penalty=1.1",
                 "generation_config.json", "Restart aitlrt-serve with --generation-config vllm"):  # fmt: skip
        assert part in str(err.value), (part, str(err.value))
    check_sampling(config(tmp_path), FORCED, "u", {})
    check_sampling(config(tmp_path), FORCED, "u", None)  # unknown: the caller warns
    # a penalty the proxy forces itself replaces the default on every call (a flag the user chose)
    check_sampling(config(tmp_path), {**FORCED, "repetition_penalty": 1.0}, "u", {"repetition_penalty": 1.1})
