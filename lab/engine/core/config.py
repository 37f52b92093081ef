"""The engine's knobs: one frozen object, settable by flag or environment, with a stable hash.

This module imports nothing heavy (no torch) so that the lab can validate a ladder's flags
against the engine's knobs without loading the engine.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

ENV_PREFIX = "LAB_ENGINE_"


class ConfigError(ValueError):
    """A knob value the engine cannot run with; the message is one actionable line."""


def _knob(default: Any, help: str, choices: tuple[str, ...] | None = None, hashed_at_default: bool = True) -> Any:
    """A knob; `hashed_at_default=False` (every knob added from now on) leaves it out of the config
    hash while it holds its default: the engine then computes what it did before the knob existed,
    so runs planned earlier still resume and series keyed by the hash stay one series."""
    return field(default=default, metadata={"help": help, "choices": choices, "hashed_at_default": hashed_at_default})


@dataclass(frozen=True)
class EngineConfig:
    """Everything that changes what the engine computes or how fast; hashed as a whole."""

    model: str = _knob("smollm2-135m", "model: smollm2-135m, a .gguf path, a Hugging Face directory, or dummy:<preset>")
    dtype: str = _knob("auto", "weights and activations dtype (auto = float32 on CPU, bfloat16 on CUDA)",
                       ("auto", "float32", "bfloat16", "float16"))
    device: str = _knob("auto", "where to run (auto = cuda when available)", ("auto", "cpu", "cuda"))
    seed: int = _knob(0, "seed for dummy weights and for requests that give no seed")
    max_model_len: int = _knob(0, "longest prompt+output in tokens (0 = the model's context length)")
    block_size: int = _knob(16, "tokens per KV-cache block")
    num_kv_blocks: int = _knob(0, "KV pool size in blocks (0 = derive from kv_cache_memory_bytes)")
    kv_cache_memory_bytes: int = _knob(0, "KV pool size in bytes (0 = 1 GiB on CPU, gpu_memory_utilization on CUDA)")
    gpu_memory_utilization: float = _knob(0.9, "fraction of GPU memory the engine may take (weights + KV + scratch)")
    kv_cache_dtype: str = _knob("auto", "KV-cache element type (auto = the model dtype)", ("auto", "fp8"))
    max_num_batched_tokens: int = _knob(2048, "token budget of one engine step (decodes + prefill chunks)")
    max_num_seqs: int = _knob(256, "most sequences running at once")
    long_prefill_token_threshold: int = _knob(0, "most prompt tokens one request may prefill in one step (0 = no cap)")
    max_parallel_prefills: int = _knob(0, "most requests prefilling in one step (0 = no cap)")
    lone_prefill_tokens: int = _knob(0, "token budget of a step whose only work is one prompt's prefill, when above "
                                     "max_num_batched_tokens: a lone long prompt goes in larger chunks (fewer "
                                     "passes over its cached prefix), and a request arriving meanwhile waits for "
                                     "that longer step (0 = off)", hashed_at_default=False)
    enable_prefix_caching: bool = _knob(True, "reuse KV blocks of identical prompt prefixes")
    prefix_cache_retention: int = _knob(-1, "cached blocks kept once no request uses them, LRU (-1 = all that fit)")
    kv_host_tier_bytes: int = _knob(0, "host-memory tier under the prefix cache: bytes of evicted KV blocks kept in "
                                    "RAM and copied back on a prefix hit instead of recomputed (0 = off)")
    kv_file_tier_bytes: int = _knob(0, "file tier under the prefix cache: bytes of KV blocks kept in a file that a "
                                    "restarted engine with the same model and config hash reads back (0 = off)")
    kv_file_tier_path: str = _knob("", "the file tier's file (empty = <LAB_CACHE_DIR or ~/.cache/lab>/kv-tiers/"
                                   "<config hash>.kvtier)")
    kv_file_tier_staging_bytes: int = _knob(0, "host memory for blocks waiting to be written to the file tier "
                                            "(allocated at start, pinned on CUDA); a block arriving when it is "
                                            "full is dropped rather than wait for the disk (0 = the file tier's "
                                            "size, at most 8 GiB on CUDA and 256 MiB on CPU, and a 16th of the "
                                            "host's memory)",
                                            hashed_at_default=False)
    kv_tier_write_policy: str = _knob("write-through", "when blocks reach the tiers: write-through = as soon as a "
                                      "prefix-cache block is full (a restart finds everything), on-evict = when "
                                      "the tier above evicts it", ("write-through", "on-evict"))
    schedule_policy: str = _knob("decode-first", "which work a step takes first", ("decode-first", "prefill-first"))
    max_waiting: int = _knob(1024, "requests allowed to wait for a slot; beyond it new requests get 503")
    attention_backend: str = _knob("auto", "attention implementation (auto = triton on CUDA, torch on CPU)",
                                   ("auto", "torch", "triton"))
    gemv_backend: str = _knob("auto", "matrix products of decode steps (at most 16 rows): auto = the Triton "
                              "skinny kernels when attention is triton, torch = cuBLAS", ("auto", "triton", "torch"))
    prefill_attention: str = _knob("auto", "PyTorch kernel for the attention of prefill chunks on CUDA (steps with "
                                   "a few prompts): cudnn is the fastest once running but builds a plan for every "
                                   "new query/key length, flash has nothing to build; auto = cudnn where the shape "
                                   "recurs (chunks of a whole step budget) or one use saves more than its plan "
                                   "costs, flash otherwise (chat-sized prompts)", ("auto", "cudnn", "flash"),
                                   hashed_at_default=False)
    pdl: bool = _knob(False, "launch decode steps' Triton kernels (skinny products, decode attention) with "
                      "programmatic dependent launch, overlapping each launch with the previous kernel's tail "
                      "(CUDA, sm_90 and newer; needs the triton backends)", hashed_at_default=False)
    cuda_graphs: bool = _knob(True, "capture decode steps as CUDA graphs (CUDA only)")
    cuda_graph_max_batch_size: int = _knob(256, "largest decode batch captured as a CUDA graph")
    overlap_decode: str = _knob("auto", "queue each decode step on the device before reading the previous "
                                "step's tokens, hiding host work (auto = on with CUDA)", ("auto", "on", "off"))
    prompt_lookup: bool = _knob(False, "speculative decoding by prompt lookup: draft the tokens that followed the "
                                "last n-gram's previous occurrence in the same sequence, verify them in one step")
    num_speculative_tokens: int = _knob(3, "prompt lookup: most draft tokens verified per sequence and step (k)")
    prompt_lookup_max: int = _knob(3, "prompt lookup: longest n-gram matched (tried first)")
    prompt_lookup_min: int = _knob(1, "prompt lookup: shortest n-gram matched")
    max_logprobs: int = _knob(20, "most top_logprobs a request may ask for")
    cpu_products: str = _knob("measured", "CPU products x @ w^T: measured = the layout timed fastest on this host for "
                              "each weight shape and row count (timed at the first load, cached per host), "
                              "linear = always F.linear", ("measured", "linear"))
    cpu_threads: int = _knob(0, "threads torch's CPU kernels use (intra-op and inter-op pools); 0 = "
                             "OMP_NUM_THREADS when set, else on the CPU the cores this process may use (its "
                             "affinity and cgroup CPU quota) less one, left to the server and the host's other "
                             "processes (on CUDA, torch's default)", hashed_at_default=False)
    gil_switch_interval_ms: float = _knob(5.0, "served engine: longest the HTTP event loop holds the GIL while the "
                                          "step loop waits for it (sys.setswitchinterval; Python's default is 5)")
    tokenize_piece_chars: int = _knob(0, "a long prompt is tokenized in pieces of this many characters on the "
                                      "tokenizers library's threads (byte-level BPE only; same ids); 0 = two "
                                      "pieces per usable core, of 512 to 4096; -1 = always whole",
                                      hashed_at_default=False)
    gc_freeze: bool = _knob(True, "served engine: freeze the start-up heap out of Python's garbage collector, so a "
                            "full pass does not walk it while a step waits")
    inject_step_delay_ms: float = _knob(0.0, "known cost for measuring the lab's power: every step that runs work "
                                        "takes this much longer (a host sleep on the CPU; on a GPU a spin kernel "
                                        "on the device's stream, plus a host sleep in overlapped decode steps, "
                                        "so overlap cannot hide it; 0 = off)")

    def __post_init__(self) -> None:
        validate(self)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def hash(self) -> str:
        return config_hash({name: value for name, value in self.to_dict().items()
                            if KNOBS[name].metadata["hashed_at_default"] or value != KNOBS[name].default})

    def replace(self, **changes: Any) -> "EngineConfig":
        return dataclasses.replace(self, **changes)


def config_hash(values: Mapping[str, Any]) -> str:
    """Stable 16-hex digest of a knob mapping; the lab recomputes it to check what booted."""
    blob = json.dumps(dict(values), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


KNOBS: dict[str, dataclasses.Field] = {f.name: f for f in dataclasses.fields(EngineConfig)}


def flag_name(knob: str) -> str:
    return "--" + knob.replace("_", "-")


def env_name(knob: str) -> str:
    return ENV_PREFIX + knob.upper()


def knob_from_flag(flag: str) -> str | None:
    """`max-num-batched-tokens` / `--max-num-batched-tokens` -> `max_num_batched_tokens`, or None."""
    name = flag.lstrip("-").replace("-", "_")
    return name if name in KNOBS else None


def knob_from_env(var: str) -> str | None:
    if not var.startswith(ENV_PREFIX):
        return None
    name = var[len(ENV_PREFIX):].lower()
    return name if name in KNOBS else None


def parse_bool(text: str | bool) -> bool:
    if isinstance(text, bool):
        return text
    value = str(text).strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"expected true or false, got {text!r}")


def coerce(knob: str, value: Any) -> Any:
    """Convert a flag/env/YAML value to the knob's type, or raise ConfigError naming the knob."""
    f = KNOBS[knob]
    kind = type(f.default)
    try:
        if kind is bool:
            return parse_bool(value)
        if kind is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(str(value).replace("_", "")) if isinstance(value, str) else int(value)
        if kind is float:
            return float(value)
        return str(value)
    except (ValueError, ConfigError):
        raise ConfigError(f"{flag_name(knob)}: expected {kind.__name__}, got {value!r}") from None


def validate(cfg: EngineConfig) -> None:
    for name, f in KNOBS.items():
        choices = f.metadata.get("choices")
        value = getattr(cfg, name)
        if choices and value not in choices:
            raise ConfigError(f"{flag_name(name)}: {value!r} is not one of {', '.join(choices)}")
    positive = ("block_size", "max_num_batched_tokens", "max_num_seqs", "max_logprobs", "cuda_graph_max_batch_size",
                "num_speculative_tokens", "prompt_lookup_min")
    for name in positive:
        if getattr(cfg, name) <= 0:
            raise ConfigError(f"{flag_name(name)} must be positive, got {getattr(cfg, name)}")
    non_negative = ("max_model_len", "num_kv_blocks", "kv_cache_memory_bytes", "long_prefill_token_threshold",
                    "max_parallel_prefills", "lone_prefill_tokens", "max_waiting", "kv_host_tier_bytes",
                    "kv_file_tier_bytes", "kv_file_tier_staging_bytes", "cpu_threads")
    for name in non_negative:
        if getattr(cfg, name) < 0:
            raise ConfigError(f"{flag_name(name)} must be >= 0, got {getattr(cfg, name)}")
    if not 0 <= cfg.inject_step_delay_ms < 60_000:  # also refuses NaN and inf, which would hang a step
        raise ConfigError(f"--inject-step-delay-ms must be >= 0 and < 60000, got {cfg.inject_step_delay_ms}")
    if cfg.block_size & (cfg.block_size - 1):
        raise ConfigError(f"--block-size must be a power of two, got {cfg.block_size}")
    if not 0.0 < cfg.gil_switch_interval_ms <= 1000.0:
        raise ConfigError(f"--gil-switch-interval-ms must be in (0, 1000], got {cfg.gil_switch_interval_ms}")
    if not 0.0 < cfg.gpu_memory_utilization <= 1.0:
        raise ConfigError(f"--gpu-memory-utilization must be in (0, 1], got {cfg.gpu_memory_utilization}")
    if (cfg.kv_host_tier_bytes or cfg.kv_file_tier_bytes) and not cfg.enable_prefix_caching:
        raise ConfigError("--kv-host-tier-bytes / --kv-file-tier-bytes need --enable-prefix-caching true")
    if (cfg.kv_file_tier_path or cfg.kv_file_tier_staging_bytes) and not cfg.kv_file_tier_bytes:
        raise ConfigError("--kv-file-tier-path / --kv-file-tier-staging-bytes are set but --kv-file-tier-bytes is 0 "
                          "(the file tier is off)")
    if cfg.prompt_lookup_max < cfg.prompt_lookup_min:
        raise ConfigError(f"--prompt-lookup-max ({cfg.prompt_lookup_max}) must be >= --prompt-lookup-min "
                          f"({cfg.prompt_lookup_min})")
    if cfg.num_speculative_tokens > 64:
        raise ConfigError(f"--num-speculative-tokens must be at most 64, got {cfg.num_speculative_tokens}")
    if cfg.tokenize_piece_chars < -1:
        raise ConfigError(f"--tokenize-piece-chars must be -1 (whole), 0 (by the host's cores) or a size, "
                          f"got {cfg.tokenize_piece_chars}")
    if cfg.prefix_cache_retention < -1:
        raise ConfigError(f"--prefix-cache-retention must be -1 (all) or >= 0, got {cfg.prefix_cache_retention}")


def from_sources(flags: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None) -> EngineConfig:
    """Build the effective config: flags override LAB_ENGINE_* variables, which override defaults.

    `flags` maps knob or flag names (`max-num-batched-tokens`) to values. Unknown names raise.
    """
    values: dict[str, Any] = {}
    for var, raw in (environ or {}).items():
        knob = knob_from_env(var)
        if knob is None:
            if var.startswith(ENV_PREFIX):
                raise ConfigError(f"{var}: no such engine knob")
            continue
        values[knob] = coerce(knob, raw)
    for name, raw in (flags or {}).items():
        knob = knob_from_flag(name)
        if knob is None:
            raise ConfigError(f"{flag_name(name.lstrip('-').replace('_', '-'))}: no such engine flag")
        values[knob] = coerce(knob, raw)
    return EngineConfig(**values)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add one `--knob VALUE` option per knob; bools also accept a bare `--knob`."""
    group = parser.add_argument_group("engine knobs (also LAB_ENGINE_<NAME>)")
    for name, f in KNOBS.items():
        kind = type(f.default)
        extra: dict[str, Any] = {}
        if kind is bool:
            extra = {"nargs": "?", "const": "true", "metavar": "BOOL"}
        group.add_argument(flag_name(name), dest=f"knob_{name}", default=None,
                           help=f"{f.metadata['help']} [default: {f.default}]", **extra)


def from_namespace(ns: argparse.Namespace, environ: Mapping[str, str] | None = None) -> EngineConfig:
    flags = {name: getattr(ns, f"knob_{name}") for name in KNOBS if getattr(ns, f"knob_{name}", None) is not None}
    return from_sources(flags, os.environ if environ is None else environ)
