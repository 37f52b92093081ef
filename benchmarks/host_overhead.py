"""Host-side cost of one engine decode step: scheduling, step inputs, sampling and output
processing, with the model's forward pass and LM head replaced by constant tensors, so only the
work the CPU does around the GPU is timed.

    python benchmarks/host_overhead.py 1 32 256
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from lab.engine.core.sampling_params import SamplingParams
from lab.engine.serve.llm import LLM


def host_ms_per_step(num_seqs: int, prompt_tokens: int = 512, steps: int = 40) -> float:
    llm = LLM("dummy:tiny", max_num_seqs=256, max_model_len=2048, num_kv_blocks=40000)
    engine = llm.engine
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=1400, temperature=0, ignore_eos=True, detokenize=False)
    for i in range(num_seqs):
        engine.add_request(f"r{i}", torch.randint(3, 250, (prompt_tokens,), generator=gen).tolist(), params)
    while engine.scheduler.waiting or any(s.is_prefill for s in engine.scheduler.running):
        engine.step()
    model = engine.runner.model
    vocab = model.config.vocab_size
    model.forward = lambda ids, pos, meta, kv: torch.zeros(ids.shape[0], 1)
    model.logits = lambda hidden: torch.zeros(hidden.shape[0], vocab)
    for _ in range(5):
        engine.step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


if __name__ == "__main__":
    for n in [int(a) for a in sys.argv[1:]] or [1, 32, 256]:
        print(f"{n:4d} sequences: {host_ms_per_step(n):.2f} ms host work per decode step (median of 40)")
