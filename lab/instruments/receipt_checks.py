"""Why a receipt cannot back a speed figure. Token counts come from `usage` only, so a response
without it backs no figure; a prefill figure also needs a cold prompt of the length it claims."""

from __future__ import annotations

from lab.instruments.receipt import Receipt


def failure(receipt: Receipt) -> str | None:
    """Why the request gave no usable timing and counts, or None."""
    if receipt.error is not None:
        return receipt.error
    if not receipt.usage_present:
        return "the response carried no usage"
    if receipt.t_first_token_ns is None or receipt.t_sent_ns is None:
        return "no token arrived"
    return None


def prefill_problem(receipt: Receipt, exact_tokens: int | None) -> str | None:
    """Why `prompt_tokens / TTFT` of this receipt is not a cold prefill figure, or None.
    `exact_tokens` is the length `/tokenize` counted, when the engine could count it."""
    why = failure(receipt)
    if why is not None:
        return why
    if receipt.cached_tokens:
        return (f"{receipt.cached_tokens} of {receipt.prompt_tokens} prompt tokens came from the prefix cache: "
                "not a cold prefill")
    if exact_tokens is not None and receipt.prompt_tokens != exact_tokens:
        return f"usage.prompt_tokens is {receipt.prompt_tokens}, /tokenize counted {exact_tokens}"
    return None


def prefill_tok_s(receipt: Receipt) -> float:
    """Prompt tokens per second of time to first token; call only when `failure` is None."""
    assert receipt.ttft_ns is not None
    return receipt.prompt_tokens * 1e9 / receipt.ttft_ns


def cache_note(receipt: Receipt) -> str:
    """What the cached-token check rests on, for a cell's note."""
    if not receipt.usage_present:
        return ""
    if not receipt.cached_tokens_present:
        return "the engine does not report cached tokens, so coldness rests on the salt alone"
    return f"{receipt.prompt_tokens} prompt tokens, {receipt.cached_tokens} cached"
