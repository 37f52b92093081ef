"""llama.cpp's own prompt-eval timing of given prompts, in process: the reference the lab's
prefill figures on llama-cpp-python's server are checked against.

Run with the engine's interpreter (it imports llama_cpp, which the lab's venv lacks):

    .venv-engines/llamacpp/bin/python benchmarks/llamacpp_prompt_eval.py MODEL.gguf --n_threads 2 < prompts.jsonl

Each input line is a JSON string (a completion prompt); each output line is
`{"tokens": N, "ms": T}`: the prompt tokens llama.cpp evaluated for it and the time its perf
counters (`llama_perf_context`) give to that evaluation, with no prefix reused from the last one.
"""

from __future__ import annotations

import argparse
import json
import sys

from llama_cpp import Llama, llama_cpp


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--n_threads", type=int, default=2)
    parser.add_argument("--n_batch", type=int, default=512)
    parser.add_argument("--n_ctx", type=int, default=4096)
    args = parser.parse_args()
    llm = Llama(model_path=args.model, n_ctx=args.n_ctx, n_threads=args.n_threads, n_batch=args.n_batch,
                verbose=False)
    for line in sys.stdin:
        llm.reset()  # a cold prompt, as the lab's salted prompts are on the server
        before = llama_cpp.llama_perf_context(llm.ctx)
        llm.create_completion(json.loads(line), max_tokens=1, temperature=0)
        after = llama_cpp.llama_perf_context(llm.ctx)
        print(json.dumps({"tokens": after.n_p_eval - before.n_p_eval, "ms": after.t_p_eval_ms - before.t_p_eval_ms}),
              flush=True)


if __name__ == "__main__":
    main()
