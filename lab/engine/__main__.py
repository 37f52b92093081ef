"""`python -m lab.engine serve|bench` (also `lab engine serve|bench`)."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from lab.engine.core import config as knobs
from lab.engine.serve import cors

log = logging.getLogger("lab.engine")


def _serve(ns: argparse.Namespace) -> int:
    import uvicorn

    from lab.engine.serve.async_engine import build_engine
    from lab.engine.serve.cors import from_namespace as cors_policy
    from lab.engine.serve.server import Server, build_app

    cfg = knobs.from_namespace(ns)
    log.info("effective config %s hash=%s", json.dumps(cfg.to_dict(), sort_keys=True), cfg.hash)
    engine = build_engine(cfg)
    runner = engine.runner
    log.info("KV pool: %d blocks x %d tokens = %d tokens, %.1f MiB (%s)", runner.num_blocks, cfg.block_size,
             runner.num_blocks * cfg.block_size, runner.kv_pool_bytes / 2**20,
             str(runner.kv_dtype).removeprefix("torch."))
    server = Server(engine, ns.served_model_name or cfg.model, ns.api_key)
    app = build_app(server, cors_policy(ns))
    log.info("serving %s on http://%s:%d", server.served_model_name, ns.host, ns.port)
    uvicorn.run(app, host=ns.host, port=ns.port, log_level=ns.log_level.lower(), timeout_graceful_shutdown=2,
                access_log=False)
    return 0


def _bench(ns: argparse.Namespace) -> int:
    from lab.engine.tools.bench import BenchOptions, ServerError, run_bench

    if ns.reference == "hf" and not _has_transformers():
        print("lab engine bench: error: --reference hf needs transformers: pip install -e '.[bench]', "
              "or pass --reference none", file=sys.stderr)
        return 2
    cfg = knobs.from_namespace(ns)
    opts = BenchOptions(
        prefill_lengths=[int(x) for x in ns.prefill_lengths.split(",") if x],
        decode_tokens=ns.decode_tokens, decode_temperature=ns.decode_temperature, concurrency=ns.concurrency,
        prompt_tokens=ns.prompt_tokens,
        reference=ns.reference, repeats=ns.repeats, throughput=[int(x) for x in ns.throughput.split(",") if x],
        throughput_tokens=ns.throughput_tokens, reference_prefill_max=ns.reference_prefill_max, json_out=ns.json,
        served=ns.served, server_log=ns.server_log, server_timeout_s=ns.server_timeout)
    try:
        return run_bench(cfg, opts)
    except ServerError as exc:
        print(f"lab engine bench: error: {exc}", file=sys.stderr)
        return 2


def _has_transformers() -> bool:
    try:
        import transformers  # noqa: F401  (the `bench` extra)
    except ImportError:
        return False
    return True


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lab engine", description="The bundled inference engine.")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="start the OpenAI-compatible server",
                           description="Start the OpenAI-compatible HTTP server. Every knob is also "
                                       "settable as LAB_ENGINE_<NAME>; flags win.")
    serve.add_argument("--host", default="127.0.0.1", help="bind address [default: 127.0.0.1]")
    serve.add_argument("--port", type=int, default=8000, help="port [default: 8000]")
    serve.add_argument("--served-model-name", default=None, help="model name clients use [default: --model]")
    serve.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` on /v1 routes")
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    cors.add_arguments(serve)
    knobs.add_arguments(serve)
    serve.set_defaults(func=_serve)

    bench = sub.add_parser("bench", help="offline (and served) benchmark against Hugging Face transformers",
                           description="Prefill tok/s, batch-1 decode tok/s and aggregate decode tok/s at a "
                                       "concurrency, for this engine and for transformers on the same weights. "
                                       "With --served, the same decode workloads also run through the engine's "
                                       "own server (booted with the same knobs on a free loopback port, stopped "
                                       "at the end), and the table shows served figures and served / offline.")
    bench.add_argument("--prefill-lengths", default="512,2048", help="comma-separated prompt lengths")
    bench.add_argument("--decode-tokens", type=int, default=64, help="tokens generated per decode measurement")
    bench.add_argument("--decode-temperature", type=float, default=0.0,
                       help="offline decode figures sample at this temperature, seeded per prompt (0 = greedy); "
                            "on random weights a temperature of 1 makes prompt lookup's drafts miss")
    bench.add_argument("--prompt-tokens", type=int, default=128, help="prompt length for decode measurements")
    bench.add_argument("--concurrency", type=int, default=8, help="sequences for the aggregate decode figure")
    bench.add_argument("--repeats", type=int, default=3, help="repeats per figure (median reported)")
    bench.add_argument("--reference", default="hf", choices=["hf", "none"],
                       help="also run Hugging Face transformers on the same weights")
    bench.add_argument("--throughput", default="", help="comma-separated request counts for a throughput run "
                                                        "(e.g. 64,256)")
    bench.add_argument("--throughput-tokens", type=int, default=1024,
                       help="prompt and output tokens per throughput request")
    bench.add_argument("--reference-prefill-max", type=int, default=32768,
                       help="longest prompt given to transformers (eager attention's score matrix grows "
                            "with the square of the length)")
    bench.add_argument("--served", action="store_true",
                       help="also run the decode workloads through `lab engine serve` as a subprocess: streamed "
                            "/v1/completions with ignore_eos and token-id prompts, timed by the client "
                            "(batch 1: per-stream tok/s; the concurrency batch: aggregate tok/s)")
    bench.add_argument("--server-log", default=None,
                       help="with --served: write the server's output here [default: a new temporary file]")
    bench.add_argument("--server-timeout", type=float, default=600.0,
                       help="with --served: seconds to wait for the server's /health [default: 600]")
    bench.add_argument("--json", default=None, help="also write the figures to this JSON file")
    bench.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    knobs.add_arguments(bench)
    bench.set_defaults(func=_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    logging.basicConfig(level=getattr(logging, ns.log_level.upper()),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from lab.engine.weights.loader import ModelLoadError

    try:
        return ns.func(ns)
    except (knobs.ConfigError, ModelLoadError) as exc:
        print(f"lab engine: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
