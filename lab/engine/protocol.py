"""OpenAI-compatible request bodies (pydantic) and their translation to SamplingParams."""

from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, model_validator

from lab.engine.sampling_params import BadRequestError, SamplingParams

Number = Union[StrictInt, float]


def _lone_surrogate(value: Any) -> str | None:
    """The first lone UTF-16 surrogate in `value`'s strings, escaped. JSON lets a client send one
    (`"\\ud800"`, e.g. text cut in half by UTF-16 length), but it is not text and no tokenizer takes it."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            return value[exc.start].encode("unicode_escape").decode("ascii")
        return None
    if isinstance(value, BaseModel):
        value = dict(value)
    if isinstance(value, dict):
        value = [*value, *value.values()]
    if isinstance(value, list):
        return next((bad for item in value if (bad := _lone_surrogate(item)) is not None), None)
    return None


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="after")
    def _text_is_unicode(self) -> "_Body":
        for name, value in self:
            bad = _lone_surrogate(value)
            if bad is not None:
                raise ValueError(f"{name} holds a lone UTF-16 surrogate ({bad}), which is not text")
        return self


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool = False


class _Common(_Body):
    model: str | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    top_k: StrictInt | None = None
    n: StrictInt = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[StrictInt] | None = None
    seed: StrictInt | None = None
    ignore_eos: StrictBool = False
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None
    logit_bias: dict[str, Number] | None = None
    user: str | None = None

    def check_unsupported(self) -> None:
        if self.n != 1:
            raise BadRequestError(f"n must be 1 (this engine returns one choice per prompt), got {self.n}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if value not in (None, 0, 0.0):
                raise BadRequestError(f"{name} is not supported (only 0), got {value}")
        if self.logit_bias:
            raise BadRequestError("logit_bias is not supported")
        if self.stream_options is not None and not self.stream:
            raise BadRequestError("stream_options is only allowed with stream=true")

    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def sampling(self, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None = None) -> SamplingParams:
        self.check_unsupported()
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else float(self.temperature),
            top_p=1.0 if self.top_p is None else float(self.top_p),
            top_k=0 if self.top_k is None else self.top_k,
            seed=self.seed,
            stop=self.stops(),
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Common):
    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]
    max_tokens: StrictInt | None = 16
    logprobs: StrictInt | None = None
    echo: StrictBool = False
    best_of: StrictInt | None = None
    suffix: str | None = None

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise BadRequestError("prompt must not be empty")
        if isinstance(p[0], int):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.best_of not in (None, 1):
            raise BadRequestError(f"best_of must be 1, got {self.best_of}")
        if self.suffix:
            raise BadRequestError("suffix is not supported")


class ChatContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ChatContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None
    add_generation_prompt: StrictBool = True

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def plain_messages(self) -> list[dict[str, str]]:
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in self.messages]


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: StrictBool = True


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[StrictInt]
