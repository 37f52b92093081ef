"""Bad input gets one clear line naming the limit, and never breaks the engine."""

from __future__ import annotations

import pytest

from lab.engine.core.config import ConfigError, EngineConfig, from_sources
from lab.engine.core.sampling_params import BadRequestError, SamplingParams
from lab.engine.serve.llm import LLM


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("smollm2-135m", max_model_len=256)


@pytest.mark.parametrize("params, words", [
    (SamplingParams(temperature=-1), "temperature"),
    (SamplingParams(top_p=0), "top_p"),
    (SamplingParams(top_p=1.5), "top_p"),
    (SamplingParams(top_k=-5), "top_k"),
    (SamplingParams(max_tokens=0), "max_tokens"),
    (SamplingParams(logprobs=50), r"logprobs must be in \[0, 20\], got 50"),
    (SamplingParams(stop=[""]), "stop"),
    (SamplingParams(stop_token_ids=[10**9]), "stop_token_ids"),
])
def test_impossible_sampling_parameters(llm: LLM, params: SamplingParams, words: str) -> None:
    with pytest.raises(BadRequestError, match=words) as err:
        llm.engine.add_request("bad", [1, 2, 3], params)
    assert "\n" not in str(err.value)


def test_prompt_over_the_context_names_the_limit(llm: LLM) -> None:
    with pytest.raises(BadRequestError, match=r"300 tokens; this model's context is 256"):
        llm.engine.add_request("long", [7] * 300, SamplingParams())
    with pytest.raises(BadRequestError, match=r"prompt \(200 tokens\) \+ max_tokens \(100\) = 300 exceeds .* 256"):
        llm.engine.add_request("long2", [7] * 200, SamplingParams(max_tokens=100))
    with pytest.raises(BadRequestError, match="outside the vocabulary"):
        llm.engine.add_request("vocab", [49152], SamplingParams())
    with pytest.raises(BadRequestError, match="empty"):
        llm.engine.add_request("empty", [], SamplingParams())


def test_engine_still_serves_after_bad_requests(llm: LLM) -> None:
    for params in (SamplingParams(temperature=-1), SamplingParams(max_tokens=10**6)):
        with pytest.raises(BadRequestError):
            llm.generate("Hello", params)
    out = llm.generate("The capital of France is", SamplingParams(max_tokens=3, temperature=0))[0]
    assert out.token_ids and out.finish_reason == "length"
    assert not llm.engine.has_unfinished() and llm.engine.blocks.num_used_blocks == 0


def test_kv_pool_smaller_than_one_request() -> None:
    with pytest.raises(ConfigError, match=r"KV pool holds 64 tokens \(4 blocks of 16\), less than one "
                                          r"full-length request of 8192") as err:
        LLM("smollm2-135m", num_kv_blocks=4)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("flags, words", [
    ({"block-size": "12"}, "power of two"),
    ({"max-num-seqs": "0"}, "must be positive"),
    ({"dtype": "float8"}, "not one of"),
    ({"max-num-batched-tokens": "lots"}, "expected int"),
    ({"no-such-knob": "1"}, "no such engine flag"),
])
def test_bad_knobs(flags: dict, words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        from_sources(flags, {})


def test_env_and_flag_precedence_and_hash() -> None:
    env = {"LAB_ENGINE_MAX_NUM_BATCHED_TOKENS": "512", "LAB_ENGINE_ENABLE_PREFIX_CACHING": "false", "PATH": "/x"}
    cfg = from_sources({"max-num-batched-tokens": 1024}, env)
    assert cfg.max_num_batched_tokens == 1024 and cfg.enable_prefix_caching is False
    assert cfg.hash == EngineConfig(max_num_batched_tokens=1024, enable_prefix_caching=False).hash
    assert cfg.hash != EngineConfig().hash
    with pytest.raises(ConfigError, match="LAB_ENGINE_TYPO: no such engine knob"):
        from_sources({}, {"LAB_ENGINE_TYPO": "1"})


def test_programmatic_dependent_launch_on_the_cpu_is_refused_in_one_line() -> None:
    with pytest.raises(ConfigError, match="--pdl needs --attention-backend triton on a CUDA GPU") as err:
        LLM("smollm2-135m", device="cpu", pdl=True)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("kernel", ["cudnn", "flash"])
def test_a_prefill_attention_kernel_on_the_cpu_is_refused_in_one_line(kernel: str) -> None:
    with pytest.raises(ConfigError, match=f"--prefill-attention {kernel} needs --attention-backend triton") as err:
        LLM("smollm2-135m", device="cpu", prefill_attention=kernel)
    assert "\n" not in str(err.value)


def test_a_knob_added_later_leaves_existing_config_hashes_unchanged() -> None:
    """Stored runs resume only when their arms' hashes are re-derived, and nightly series are
    keyed by the control's hash: these two were computed before the `pdl` knob existed."""
    assert EngineConfig().hash == "4922fd059c13b7a9"
    assert EngineConfig(model="dummy:llama3-8b-1m", kv_cache_dtype="fp8").hash == "6fb57256967e0d22"
    assert EngineConfig(pdl=True).hash != EngineConfig().hash
    assert EngineConfig(prefill_attention="cudnn").hash != EngineConfig().hash
