"""Decode attention at small batch on a GPU: split count x tile config, graph time of one step in
microseconds (Llama-3-8B shapes, bf16 cache; lab.engine.kernels.bench_kernels.DecodeCase).
It measured what a graph sized for max_model_len (33 splits at batch 1 on an H200) costs a short
context against the split count its own length would get; since 24bac7a the engine's graphs are
captured per context bound (cuda_graphs).

    python benchmarks/attention_splits.py
"""
import torch
from kernels.bench_kernels import DecodeCase

CONFIGS = {
    "n128w4s2": None,
    "n64w4s2": {"BLOCK_N": 64, "num_warps": 4, "num_stages": 2},
    "n32w4s2": {"BLOCK_N": 32, "num_warps": 4, "num_stages": 2},
    "n64w2s2": {"BLOCK_N": 64, "num_warps": 2, "num_stages": 2},
    "n16w2s2": {"BLOCK_N": 16, "num_warps": 2, "num_stages": 2},
}
torch.manual_seed(0)
print(f"{'batch':>5} {'ctx':>6} {'splits':>6} " + " ".join(f"{n:>9}" for n in CONFIGS), flush=True)
for batch, context, split_list in ((1, 1024, (9, 17, 33, 64)), (1, 4096, (17, 33, 64)), (1, 32768, (33, 64)),
                                   (4, 1024, (4, 8, 16)), (4, 8192, (8, 16))):
    case = DecodeCase(batch, context, torch.bfloat16)
    for splits in split_list:
        cells = []
        for name, config in CONFIGS.items():
            try:
                cells.append(f"{case.time(splits, config, eager=False, rep=100)[0]:>9.2f}")
            except Exception as error:  # a config that does not compile is a result too
                cells.append(f"{'err':>9}")
                print("  ", name, type(error).__name__, str(error)[:120], flush=True)
        print(f"{batch:>5} {context:>6} {splits:>6} " + " ".join(cells), flush=True)
    del case
    torch.cuda.empty_cache()
