"""Host-side cost of one engine decode step, the model's forward pass and LM head stubbed out.

Scheduling, step inputs, sampling and output processing are timed with the forward pass and the
LM head replaced by constant tensors, so only the work the CPU does around the GPU is timed, on
`dummy:tiny` on the CPU.

    python benchmarks/host_overhead.py --sequences 1 32 256
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from lab.engine.core.sampling_params import SamplingParams
from lab.engine.serve.llm import LLM


def host_ms_per_step(num_seqs: int, prompt_tokens: int = 512, steps: int = 40) -> float:
    """Median milliseconds of one decode step of `num_seqs` sequences, over `steps` steps."""
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, nargs="+", default=[1, 32, 256], help="decoding sequences per step")
    parser.add_argument("--prompt-tokens", type=int, default=512, help="each sequence's prompt")
    parser.add_argument("--steps", type=int, default=40, help="timed decode steps")
    args = parser.parse_args()
    for n in args.sequences:
        print(f"{n:4d} sequences: {host_ms_per_step(n, args.prompt_tokens, args.steps):.2f} ms host work per decode "
              f"step (median of {args.steps})", flush=True)


if __name__ == "__main__":
    main()
