"""The offline API: `LLM(model, **knobs).generate(prompts, params)`."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Sequence as Seq

from lab.engine.core.config import EngineConfig, from_sources
from lab.engine.core.llm_engine import LLMEngine
from lab.engine.core.output_processor import RequestOutput
from lab.engine.core.sampling_params import SamplingParams
from lab.engine.core.sequence import TokenLogprob
from lab.engine.weights.loader import LoadedModel


@dataclass
class Completion:
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None


class LLM:
    """Runs the engine in this process, step by step, until every prompt is done."""

    def __init__(self, model: str = "smollm2-135m", loaded: LoadedModel | None = None,
                 config: EngineConfig | None = None, **knobs: Any) -> None:
        self.config = config or from_sources({"model": model, **knobs}, environ={})
        self.engine = LLMEngine(self.config, loaded)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def encode(self, prompt: str | list[int]) -> list[int]:
        return list(prompt) if not isinstance(prompt, str) else self.tokenizer.encode(prompt)

    def generate(self, prompts: str | list[int] | Seq[str | list[int]],
                 params: SamplingParams | Seq[SamplingParams] | None = None) -> list[Completion]:
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params = params or SamplingParams()
        per_prompt = list(params) if isinstance(params, Seq) else [params] * len(prompts)
        if len(per_prompt) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(per_prompt)} sampling parameter sets")
        results: dict[str, Completion] = {}
        order = []
        for prompt, p in zip(prompts, per_prompt):
            rid = f"offline-{next(self._ids)}"
            ids = self.encode(prompt)
            self.engine.add_request(rid, ids, p)
            results[rid] = Completion(prompt_token_ids=ids)
            order.append(rid)
        while self.engine.has_unfinished():
            for out in self.engine.step():
                self._accumulate(results[out.request_id], out)
        self.engine.flush_tiers()  # an engine built after this call finds every block in the file
        return [results[r] for r in order]

    @staticmethod
    def _accumulate(c: Completion, out: RequestOutput) -> None:
        c.token_ids.extend(out.new_token_ids)
        c.text += out.new_text
        c.logprobs.extend(out.new_logprobs)
        c.num_cached_tokens = out.num_cached_tokens
        if out.prompt_logprobs is not None:
            c.prompt_logprobs = out.prompt_logprobs
        if out.finished:
            c.finish_reason = out.finish_reason

    def chat(self, messages: list[dict[str, str]], params: SamplingParams | None = None) -> Completion:
        prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        # The template writes its own BOS where the model wants one.
        return self.generate([self.tokenizer.encode(prompt, add_special_tokens=False)], params)[0]
