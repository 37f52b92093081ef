"""Per-stream decode speed of the served CPU engine by `--cpu-threads`, on a quiet host and beside
a busy process (one that spins on one core, pinned there, as another tenant's job would).

One engine is booted per setting (`default`: no flag, the engine's own choice; a number:
`--cpu-threads N`), all at once, and each measurement is one streamed greedy completion of
`--tokens` tokens (ignore_eos): its decode rate is the tokens after the first over the time
after the first. Settings are interleaved round by round, so a change in the host's load
touches them alike; each condition's figure is the median of `--rounds`. The host's CPU and its
load average at each condition's start are printed with the table, since other processes on the
host make the "quiet" condition only as quiet as they allow.

    PYTHONPATH=. python benchmarks/cpu_threads.py                      # default, 1 and 2 threads
    PYTHONPATH=. python benchmarks/cpu_threads.py --settings 2,default --rounds 1 --conditions busy
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Iterator

import httpx

from lab.runner.boot import EngineProcess, child_env, free_port


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def decode_rate(url: str, tokens: int) -> float:
    """Tokens per second after the first, of one streamed greedy completion."""
    body = {"prompt": "Once upon a time", "max_tokens": tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    first = None
    count = 0
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=3600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            for choice in json.loads(line[6:])["choices"]:
                if choice.get("text"):
                    count += 1
                    if first is None:
                        first, first_count = time.perf_counter(), count
    end = time.perf_counter()
    return (count - first_count) / (end - first) if first is not None and end > first else float("nan")


class Engine:
    def __init__(self, setting: str, model: str, workdir: Path) -> None:
        self.setting = setting
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        flags = ["--model", model, "--max-model-len", "1024"]
        if setting != "default":
            flags += ["--cpu-threads", setting]
        env, _ = child_env({})
        env.pop("OMP_NUM_THREADS", None)
        self.proc = EngineProcess([sys.executable, "-m", "lab.engine", "serve", "--port", str(self.port), *flags],
                                  env, workdir / f"engine-{setting}.log")
        self.model = model

    def __enter__(self) -> "Engine":
        self.proc.start()
        ready = self.proc.wait_ready(f"{self.url}/v1", self.model, None, timeout_s=1800)
        if not ready.ok:
            raise SystemExit(f"engine not ready: {ready.reason}\n{self.proc.log_tail()}")
        self.threads = httpx.get(f"{self.url}/v1/stats", timeout=30).json()["cpu_threads"]
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.stop(grace_s=30)


@contextmanager
def busy_core(core: int) -> Iterator[None]:
    """A process spinning on `core`, pinned there."""
    proc = subprocess.Popen([sys.executable, "-c", f"import os\nos.sched_setaffinity(0, {{{core}}})\nwhile True: pass"])
    try:
        time.sleep(1.0)
        yield
    finally:
        proc.kill()
        proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--settings", default="default,1,2", help="comma-separated: default or a thread count")
    ap.add_argument("--conditions", default="quiet,busy", help="comma-separated: quiet, busy")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--busy-core", type=int, default=max(os.sched_getaffinity(0)))
    ap.add_argument("--json", default=None, help="also write the figures here")
    args = ap.parse_args()
    settings = args.settings.split(",")
    figures: dict[str, dict[str, list[float]]] = {}
    loads: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        engines = [stack.enter_context(Engine(s, args.model, Path(tmp))) for s in settings]
        for e in engines:
            decode_rate(e.url, 8)  # warm: the first request of a process pays one-time costs
        for condition in args.conditions.split(","):
            with busy_core(args.busy_core) if condition == "busy" else ExitStack():
                loads[condition] = os.getloadavg()[0]
                for _ in range(args.rounds):
                    for e in engines:
                        figures.setdefault(condition, {}).setdefault(e.setting, []).append(
                            decode_rate(e.url, args.tokens))
        threads = {e.setting: e.threads for e in engines}
    print(f"{cpu_model()}, {len(os.sched_getaffinity(0))} usable cores; {args.model}, {args.tokens} tokens "
          f"per request, median of {args.rounds}")
    print(f"{'setting':<10} {'threads':>7}  " + "  ".join(f"{c + ' tok/s':>12}" for c in figures))
    for s in settings:
        row = "  ".join(f"{statistics.median(figures[c][s]):>12.2f}" for c in figures)
        print(f"{s:<10} {threads[s]['intra_op']:>7}  {row}    ({threads[s]['source']})")
    print("load average (1 min) at each condition's start: "
          + ", ".join(f"{c} {v:.2f}" for c, v in loads.items()))
    if args.json:
        Path(args.json).write_text(json.dumps({"cpu": cpu_model(), "model": args.model, "tokens": args.tokens,
                                               "threads": threads, "figures": figures, "load": loads}, indent=1))


if __name__ == "__main__":
    main()
