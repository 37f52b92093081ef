"""What the engine reports about itself at `/v1/stats`: the effective config and its hash, the KV
pool, memory, prefix-cache and scheduling counters. The lab checks the hash to assert that what
booted is what an arm asked for."""

from __future__ import annotations

import resource
import time
from typing import Any

import psutil
import torch

from lab.engine.core.llm_engine import LLMEngine


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


def memory_report(device: torch.device) -> dict[str, int]:
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        reserved_peak = int(torch.cuda.max_memory_reserved(device))
        allocator = torch.cuda.memory_stats(device)
        return {"peak_memory_bytes": peak_memory_bytes(device), "free_memory_bytes": int(free),
                "total_memory_bytes": int(total), "free_at_peak_bytes": int(total) - reserved_peak,
                "memory_kind": "cuda",
                # The caching allocator going back to the driver (cudaMalloc/cudaFree, each a device
                # sync) after start-up is a stall inside whatever request caused it; a retry means it
                # freed its whole cache first. Read before and after a measurement to see if it did.
                "allocator": {"device_allocs": int(allocator.get("num_device_alloc", 0)),
                              "device_frees": int(allocator.get("num_device_free", 0)),
                              "alloc_retries": int(allocator.get("num_alloc_retries", 0))}}
    vm = psutil.virtual_memory()
    return {"peak_memory_bytes": peak_memory_bytes(device), "free_memory_bytes": int(vm.available),
            "total_memory_bytes": int(vm.total), "rss_bytes": int(psutil.Process().memory_info().rss),
            "memory_kind": "host"}


def spec_report(engine: LLMEngine) -> dict[str, Any] | None:
    """Prompt lookup's counters, acceptance (accepted / drafted tokens), mean tokens emitted per
    verify step (1 + accepted / drafts), the decode steps that gave up overlapping to draft, the
    verify steps that replayed a CUDA graph, and its cost model: the step times measured at load
    per batch size and the break-even there (the tokens accepted per look, and the acceptance,
    above which drafting k tokens pays); None when it is off."""
    if engine.drafter is None:
        return None
    c = engine.drafter.counters
    return {"drafts": c.drafts, "draft_tokens": c.draft_tokens, "accepted_tokens": c.accepted_tokens,
            "accepted_per_position": list(c.accepted_per_position),
            "acceptance": c.accepted_tokens / c.draft_tokens if c.draft_tokens else None,
            "tokens_per_step": 1 + c.accepted_tokens / c.drafts if c.drafts else None,
            "sync_steps": c.sync_steps, "graph_verify_steps": c.graph_verify_steps,
            "costs": engine.drafter.costs.to_dict()}


def queue_report(engine: LLMEngine) -> dict[str, Any]:
    """The waiting queue: its length and bound, how long its head has waited, how many requests
    were refused because it was full, and how many times running work was preempted (its blocks
    freed, to be recomputed) for want of KV blocks. Read off the engine thread: a snapshot."""
    waiting = engine.scheduler.waiting
    try:
        head = waiting[0]
    except IndexError:
        head = None
    return {"waiting": len(waiting), "max_waiting": engine.config.max_waiting,
            "oldest_wait_s": time.monotonic() - head.arrival_time if head is not None else 0.0,
            "refused": engine.counters.requests_refused, "preemptions": engine.scheduler.num_preemptions}


def engine_stats(engine: LLMEngine, served_model_name: str, started_at: float) -> dict[str, Any]:
    runner = engine.runner
    blocks = engine.blocks
    c = engine.counters
    built = engine.caches.built()
    return {
        "config": engine.config.to_dict(),
        "config_hash": engine.config.hash,
        "model": engine.config.model,
        "served_model_name": served_model_name,
        "source": engine.loaded.source,
        "source_hash": engine.loaded.source_hash,
        # Cold: this boot built a cache that a later boot reuses, so it ran slower than that one will.
        # Kernels compiled while serving count, so a boot can turn cold after it answered first.
        "cold": any(entry["cold"] for entry in built),
        "caches_built": built,
        "random_weights": engine.loaded.random_weights,
        "dtype": str(engine.dtype).removeprefix("torch."),
        "kv_cache_dtype": str(runner.kv_dtype).removeprefix("torch."),
        "device": str(engine.device),
        "attention_backend": runner.attention.name,
        # Torch's CPU thread pools as the engine set them, and why (--cpu-threads, OMP_NUM_THREADS,
        # or the cores this process may use).
        "cpu_threads": engine.cpu_threads.to_dict(),
        "max_model_len": engine.max_model_len,
        "kv_pool": {"blocks": runner.num_blocks, "block_size": engine.config.block_size,
                    "tokens": runner.num_blocks * engine.config.block_size, "bytes": runner.kv_pool_bytes},
        "blocks_in_use": blocks.num_used_blocks,
        "kv_usage": blocks.num_used_blocks / max(1, blocks.num_blocks),
        "prefix_cache": {"queries": blocks.prefix_queries, "hits": blocks.prefix_hits,
                         "cached_blocks": len(blocks.hash_to_block),
                         # Hits by the tier that held the block: device, host memory, file.
                         "hits_by_tier": {t: {"blocks": n, "tokens": n * blocks.block_size}
                                          for t, n in blocks.tier_hit_blocks.items()},
                         "tiers": engine.tiers.stats() if engine.tiers is not None else None},
        "preemptions": engine.scheduler.num_preemptions,
        "running": engine.num_running,
        "waiting": engine.num_waiting,
        "queue": queue_report(engine),
        "prompt_tokens": c.prompt_tokens,
        "generation_tokens": c.generation_tokens,
        "requests_finished": c.requests_finished,
        "requests_aborted": c.requests_aborted,
        "steps": c.steps,
        "overlapped_steps": c.overlapped_steps,
        "spec_decode": spec_report(engine),
        "load_seconds": engine.load_seconds,
        "uptime_s": time.time() - started_at,
        **memory_report(engine.device),
    }
