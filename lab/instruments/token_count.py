"""Token counts for streams that carried no `usage`, from the engine's own tokenizer endpoint.

Only where the capability probe checked that tokenizer against the engine's non-streamed `usage`
(lab/instruments/capabilities.py): then an answered receipt without usage gets the tokenizer's
count of its prompt (a completion prompt, or chat messages where the route applies the chat
template) and of its generated text (or, where the probe found the engine streams one token per
chunk, the stream's chunks: re-tokenizing text undercounts where the tokenizer merges what the model
generated as separate tokens), and `usage_counted_by` names the route. Cells built from such
receipts say so in their note. Generated special tokens (an EOS that `ignore_eos` ran past) have
no text, so they go uncounted: the probe checks only replies free of them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from lab.instruments.capabilities import chunks_are_tokens, count_note, ladder_tokenizer_name
from lab.instruments.client import COMPLETIONS
from lab.instruments.engine_extras import EngineExtras
from lab.instruments.receipt import Receipt


async def count_missing_usage(extras: EngineExtras, caps: dict[str, Any] | None, receipts: Iterable[Receipt]) -> str:
    """Fill in the counts of the receipts that lack usage; the note for their cells, or '' when
    the engine streams its own usage (or was not probed)."""
    note = count_note(caps)
    if not note:
        return ""
    assert caps is not None
    route = caps["token_count"]["via"]
    for receipt in receipts:
        if not receipt.ok or receipt.usage_present:
            continue
        if receipt.endpoint == COMPLETIONS:
            prompt = await extras.tokenize(prompt=receipt.payload["prompt"])
        else:
            prompt = await extras.tokenize(messages=receipt.payload["messages"])
        receipt.prompt_tokens = len(prompt) if prompt is not None else 0
        streamed = receipt.payload.get("stream", True)
        receipt.completion_tokens = (len(receipt.token_times_ns) if streamed and chunks_are_tokens(caps)
                                     else await extras.count_generated(receipt.text))
        receipt.usage_present = True
        receipt.usage_counted_by = route
    return note


def sized_note(extras: EngineExtras) -> str:
    """The note of a cell whose prompt was sized by the ladder's tokenizer (the engine counted its
    tokens in `usage`), or ''."""
    return f"prompt sized by {ladder_tokenizer_name(extras.local_name)}" if extras.local_name else ""
