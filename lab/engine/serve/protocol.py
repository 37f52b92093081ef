"""OpenAI- and vLLM-compatible request bodies (pydantic) and their translation to SamplingParams.

The contract (docs/server.md): every field of OpenAI's and vLLM's request schemas is either
honoured or, when a request sets it to anything but its default, refused with a 400 that names
it. Fields in neither schema are accepted and reported back: logged as a warning and listed in
the response's `x-ignored-fields` header, as vLLM does, so clients that add a field of their own
keep working and nobody is left guessing what took effect."""

from __future__ import annotations

from typing import Any, ClassVar, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, model_validator

from lab.engine.core.sampling_params import BadRequestError, SamplingParams

Number = Union[StrictInt, float]
MAX_N = 16  # choices per prompt; each is a sequence in the engine


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
                # A ValueError for pydantic, which keeps it in the error's context: the server
                # answers with its message and param.
                raise BadRequestError(f"{name} holds a lone UTF-16 surrogate ({bad}), which is not text", param=name)
        return self


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False  # vLLM's: usage so far on every chunk


# Fields of OpenAI's or vLLM's schema that this engine does not honour, with the value that
# means "not asked for" (None always does too). Any other value is a 400 naming the field.
REFUSED_COMMON: dict[str, Any] = {
    "use_beam_search": False, "length_penalty": 1.0, "skip_special_tokens": True,
    "spaces_between_special_tokens": True, "truncate_prompt_tokens": None, "prompt_logprobs": None,
    "bad_words": [], "guided_json": None, "guided_regex": None, "guided_choice": None,
    "guided_grammar": None, "guided_decoding_backend": None, "guided_whitespace_pattern": None,
    "structured_outputs": None, "priority": 0, "logits_processors": None,
    "return_tokens_as_token_ids": False, "return_token_ids": False, "cache_salt": None,
    "kv_transfer_params": None, "vllm_xargs": None, "request_id": None, "prompt_embeds": None,
}
REFUSED_COMPLETION: dict[str, Any] = {**REFUSED_COMMON, "suffix": ""}
REFUSED_CHAT: dict[str, Any] = {
    **REFUSED_COMMON, "tools": [], "tool_choice": "none", "parallel_tool_calls": True, "functions": [],
    "function_call": "none", "audio": None, "modalities": ["text"], "prediction": None, "store": False,
    "metadata": None, "reasoning_effort": None, "include_reasoning": True, "web_search_options": None,
    "verbosity": None, "service_tier": "auto", "echo": False, "continue_final_message": False,
    "documents": None, "chat_template": None, "chat_template_kwargs": None, "mm_processor_kwargs": None,
    "media_io_kwargs": None,
}


class GenerationRequest(_Body):
    # Unknown fields are kept so the server can name them (see the module docstring).
    model_config = ConfigDict(extra="allow")
    refused: ClassVar[dict[str, Any]] = {}

    model: str | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    top_k: StrictInt | None = None
    min_p: Number | None = None
    n: StrictInt | None = 1
    best_of: StrictInt | None = None
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[StrictInt] | None = None
    include_stop_str_in_output: StrictBool | None = False
    seed: StrictInt | None = None
    ignore_eos: StrictBool | None = False
    min_tokens: StrictInt | None = 0
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None
    repetition_penalty: Number | None = None
    logit_bias: dict[str, Number] | None = None
    allowed_token_ids: list[StrictInt] | None = None
    response_format: dict[str, Any] | None = None
    # Identifiers a client attaches for its own bookkeeping: accepted, with no effect on the output.
    user: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None

    def unknown_fields(self) -> list[str]:
        """Fields in neither schema; they have no effect."""
        return sorted(k for k in (self.model_extra or {}) if k not in self.refused)

    def check_unsupported(self) -> None:
        """A 400 naming the first field set to something this engine does not do."""
        extra = self.model_extra or {}
        for name, default in self.refused.items():
            value = extra.get(name)
            if value is not None and value != default:
                raise BadRequestError(f"{name} is not supported by this engine (got {_short(value)})", param=name)
        n = self.choices_per_prompt
        if not 1 <= n <= MAX_N:
            raise BadRequestError(f"n must be in [1, {MAX_N}], got {n}", param="n")
        if self.best_of is not None and self.best_of != n:
            raise BadRequestError(f"best_of must equal n ({n}): ranking extra samples is not supported, "
                                  f"got {self.best_of}", param="best_of")
        if self.stream_options is not None:
            if not self.stream:
                raise BadRequestError("stream_options is only allowed with stream=true", param="stream_options")
        if self.ignore_eos and self.grammar_requested:
            raise BadRequestError("ignore_eos cannot be combined with a JSON response_format "
                                  "(the grammar ends the output with EOS)", param="ignore_eos")
        if self.min_tokens and self.grammar_requested:
            raise BadRequestError("min_tokens cannot be combined with a JSON response_format "
                                  "(it would mask the EOS that ends the JSON)", param="min_tokens")

    @property
    def grammar_requested(self) -> bool:
        return bool(self.response_format) and self.response_format.get("type") != "text"

    @property
    def choices_per_prompt(self) -> int:
        return 1 if self.n is None else self.n

    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def _logit_bias(self) -> dict[int, float]:
        out = {}
        for key, value in (self.logit_bias or {}).items():
            try:
                out[int(key)] = float(value)
            except ValueError:
                raise BadRequestError(f"logit_bias keys must be token ids, got {key!r}", param="logit_bias") from None
        return out

    def sampling(self, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None = None) -> SamplingParams:
        """The engine's parameters for one choice; `check_unsupported` has passed."""
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else float(self.temperature),
            top_p=1.0 if self.top_p is None else float(self.top_p),
            top_k=0 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else float(self.min_p),
            seed=self.seed,
            stop=self.stops(),
            stop_token_ids=list(self.stop_token_ids or []),
            include_stop_str_in_output=bool(self.include_stop_str_in_output),
            ignore_eos=bool(self.ignore_eos),
            min_tokens=self.min_tokens or 0,
            repetition_penalty=1.0 if self.repetition_penalty is None else float(self.repetition_penalty),
            frequency_penalty=float(self.frequency_penalty or 0.0),
            presence_penalty=float(self.presence_penalty or 0.0),
            logit_bias=self._logit_bias(),
            allowed_token_ids=list(self.allowed_token_ids) if self.allowed_token_ids is not None else None,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class CompletionRequest(GenerationRequest):
    refused: ClassVar[dict[str, Any]] = REFUSED_COMPLETION
    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]
    max_tokens: StrictInt | None = 16
    logprobs: StrictInt | None = None
    echo: StrictBool | None = False
    add_special_tokens: StrictBool | None = True

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise BadRequestError("prompt must not be empty", param="prompt")
        if isinstance(p[0], int):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class ChatContentPart(BaseModel):
    """Any part is parsed, so that one this engine cannot read (`image_url`, `input_audio`, ...)
    is refused by name rather than by the shape of a schema mismatch."""
    model_config = ConfigDict(extra="ignore")
    type: str
    text: str | None = None


# Message fields that only make sense with tool calling, which this engine refuses.
TOOL_MESSAGE_FIELDS = ("tool_calls", "tool_call_id", "function_call", "audio", "refusal")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ChatContentPart] | None = None
    name: str | None = None

    def check(self, i: int) -> None:
        """A 400 naming the part of `messages[i]` this engine cannot take."""
        extra = self.model_extra or {}
        bad = next((f for f in TOOL_MESSAGE_FIELDS if extra.get(f) not in (None, [], "")), None)
        if bad is not None:
            raise BadRequestError(f"messages[{i}].{bad} is not supported (this engine has no tool calling)",
                                  param=f"messages[{i}].{bad}")
        if self.content is None:
            raise BadRequestError(f"messages[{i}].content must be a string or a list of text parts, not null",
                                  param=f"messages[{i}].content")
        if isinstance(self.content, list):
            for j, part in enumerate(self.content):
                where = f"messages[{i}].content[{j}]"
                if part.type != "text":
                    raise BadRequestError(f"{part.type[:40]} content is not supported (this engine reads text "
                                          "parts only)", param=f"{where}.type")
                if part.text is None:
                    raise BadRequestError(f"{where}.text is required in a text part", param=f"{where}.text")

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text or "" for part in self.content)


class ChatCompletionRequest(GenerationRequest):
    refused: ClassVar[dict[str, Any]] = REFUSED_CHAT
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool | None = False
    top_logprobs: StrictInt | None = None
    add_generation_prompt: StrictBool | None = True
    add_special_tokens: StrictBool | None = False

    def check_unsupported(self) -> None:
        super().check_unsupported()
        for i, m in enumerate(self.messages):
            m.check(i)

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
