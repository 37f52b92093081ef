"""One set of prompts for every engine of a window: an engine arm is sent the prompt texts its
window's control was sent, word for word, rather than texts sized again by its own tokenizer.

The control's boot and the arm's share their prompt seed (`lab.ladder.render.prompt_seed`), so a
request of the arm has the salt of the control's request it must repeat; the control sized that
text to the ladder's length with its own tokenizer. The arm's engine counts the same text with
its tokenizer: where the two tokenize alike the counts agree, and where they do not the cell keeps
the ladder's length as its parameter and says both counts.
"""

from __future__ import annotations

from collections.abc import Callable

from lab.instruments.base import BootContext
from lab.instruments.engine_extras import EngineExtras
from lab.instruments.prompts import Fitted, fit_prompt, salt_line


def control_prompt(ctx: BootContext, instrument: str, salt: str) -> tuple[str, int | None] | None:
    """The completion prompt of this salt that the control `ctx.prompts_of` was sent by `instrument`,
    with the control's count of its tokens; None where this boot sizes its own prompts or the
    control sent none (it failed before this request, or ran another instrument set)."""
    if ctx.prompts_of is None:
        return None
    if instrument not in ctx.control_prompts:
        requests = ctx.stored.boot_slot_steps(ctx.prompts_of, instrument).requests
        ctx.control_prompts[instrument] = [(prompt, r.prompt_tokens) for r in requests
                                           if isinstance(prompt := (r.payload or {}).get("prompt"), str)]
    head = salt_line(salt) + " "
    return next(((p, n) for p, n in ctx.control_prompts[instrument] if p.startswith(head)), None)


async def window_prompt(ctx: BootContext, extras: EngineExtras, instrument: str, salt: str, target: int,
                        render: Callable[[int, str], str], max_words: int) -> tuple[Fitted[str], str]:
    """The completion prompt to send for `target` tokens, and a note for its cells ("" when there is
    nothing to say): the control's text where this boot shares its prompts, counted by this engine;
    else one fitted to `target` tokens by this engine's tokenizer."""
    shared = control_prompt(ctx, instrument, salt)
    if shared is None:
        return await fit_prompt(extras, target, render, max_words), ""
    text, theirs = shared
    ids = await extras.tokenize(prompt=text)
    if ids is None:
        return Fitted(text, theirs or target, exact=False), "the window's control's prompt text"
    note = "" if len(ids) == theirs else (f"the window's control's prompt text: the control counted {theirs} "
                                          f"tokens in it, this engine {len(ids)}")
    return Fitted(text, len(ids), exact=True), note
