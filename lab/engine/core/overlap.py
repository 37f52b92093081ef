"""Overlapped decode: while the device runs decode step N, the host schedules step N+1 and queues
it behind N, reading N's sampled tokens only then; the host's work (scheduling, inputs, outputs,
SSE chunks) hides behind the device's instead of adding to it.

The pieces, and where they live:
- the policy (this module): whether a step may overlap, which sequences to leave out of it, and
  the step in flight (`InflightStep`) whose tokens are still on the device;
- the step loop (`LLMEngine.step`): launch, or collect the step in flight first when this one
  cannot overlap;
- a sequence's pending tokens (`Sequence.add_pending` / `resolve_pending` / `drop_pending`): its
  next input is known only on the device;
- the launch (`ModelRunner.launch_decode`): it takes each pending token from the previous step's
  tokens on the device and alternates between two sets of input buffers (one parity, owned by the
  runner), since step N+1 fills its inputs while step N still reads its own; the CUDA graphs keep
  one set per parity (`DecodeGraphs.run`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lab.engine.core.config import EngineConfig
from lab.engine.core.scheduler import SchedulerOutput
from lab.engine.core.sequence import Sequence


def overlap_enabled(config: EngineConfig, device: torch.device) -> bool:
    """`--overlap-decode auto` overlaps on CUDA only: on the CPU the host is the device."""
    if config.overlap_decode == "auto":
        return device.type == "cuda"
    return config.overlap_decode == "on"


@dataclass
class InflightStep:
    """A decode step launched on the device whose sampled tokens have not been read yet."""
    seqs: list[Sequence]
    tokens: torch.Tensor  # [n] sampled on the device; the next step's inputs are read from here
    host_tokens: torch.Tensor  # [n] on the host, filled by a non-blocking copy of `tokens`
    event: torch.cuda.Event | None  # recorded after that copy (None on the CPU)
    rows: dict[int, int]  # seq_id -> row in `tokens`

    def read_tokens(self) -> list[int]:
        if self.event is not None:
            self.event.synchronize()
        return self.host_tokens.tolist()


def overlappable(plan: SchedulerOutput) -> bool:
    """A pure decode step whose outputs need nothing but the sampled token (and whose logits
    need no processing: penalties and grammars read the tokens still pending on the device).
    With prompt lookup, the engine also asks whether drafting in it would pay more than the
    overlap: a draft is read off the sequence's tokens, which an overlapped step leaves pending."""
    return not plan.preempted and all(
        s.num_tokens == 1 and s.seq.num_computed_tokens >= s.seq.num_prompt_tokens and s.samples
        and s.seq.params.logprobs is None and not s.seq.wants_prompt_logprobs
        and not s.seq.params.needs_processing for s in plan.scheduled)


def trim_certain_finishers(plan: SchedulerOutput, max_model_len: int) -> None:
    """Leave out of an overlapped step the sequences whose pending token is certain to be
    their last (max_tokens or the context reached): their rows would be computed for nothing."""
    plan.scheduled = [s for s in plan.scheduled if not s.seq.num_pending or (
        s.seq.num_tokens - s.seq.num_prompt_tokens < s.seq.params.max_tokens
        and s.seq.num_tokens < max_model_len)]
