"""How long one full pass of Python's garbage collector stalls a served engine's process, with
its start-up heap left to the collector and then frozen (what `lab engine serve` does with
`--gc-freeze`, its default).

    PYTHONPATH=. python benchmarks/gc_pause.py [--model dummy:smollm2-135m]
"""

from __future__ import annotations

import argparse
import gc
import time

from lab.engine.core import config as knobs
from lab.engine.serve.async_engine import build_engine
from lab.engine.serve.gc_pauses import freeze_startup_heap
from lab.engine.serve.server import Server, build_app


def full_pass_ms() -> float:
    started = time.perf_counter()
    gc.collect()
    return 1000 * (time.perf_counter() - started)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="dummy:smollm2-135m")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    cfg = knobs.from_sources({"model": args.model, "device": args.device, "max_model_len": "2048"}, environ={})
    engine = build_engine(cfg)
    build_app(Server(engine, args.model))
    tracked = len(gc.get_objects())
    before = [full_pass_ms() for _ in range(3)]
    frozen = freeze_startup_heap()
    after = [full_pass_ms() for _ in range(3)]
    print(f"{args.model} on {args.device}: {tracked} tracked objects; a full pass {min(before):.1f}-{max(before):.1f} ms, "
          f"with {frozen} frozen {min(after):.2f}-{max(after):.2f} ms")


if __name__ == "__main__":
    main()
