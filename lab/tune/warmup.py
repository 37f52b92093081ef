"""Whether a study boots its base configuration once, unmeasured, before a `lab tune`'s first trial.

A fresh host's first boot pays for what later boots reuse (compiled kernels, weight caches, the
page cache), so without a warm-up the first trial reads slow and the sampler learns the host, not
the knobs. The tune file decides with `hygiene.warmup_boot`; by default it is on where the engine
runs on CUDA (where kernels compile), off on the CPU. Either way, a trial whose boot still comes up
cold is booted again (`lab.tune.trial.boot`).
"""

from __future__ import annotations

import os

from lab.ladder.engines import env_value, kind_of
from lab.runner import fingerprint
from lab.tune.spec import TuneFile


def wanted(tune: TuneFile) -> tuple[bool, str]:
    """(warm up?, why), the why as a person reads it after "warm-up boot: on/off ("."""
    if tune.hygiene.warmup_boot is not None:
        return tune.hygiene.warmup_boot, f"hygiene.warmup_boot: {str(tune.hygiene.warmup_boot).lower()}"
    env = {k: env_value(v) for k, v in tune.engine.env.items()}
    device = kind_of(tune.engine).config(dict(tune.engine.flags), env)[0].get("device")
    if device == "cuda":
        return True, "the engine runs on CUDA"
    if device == "cpu":
        return False, "the engine runs on the CPU; hygiene.warmup_boot: true turns it on"
    if os.environ.get("CUDA_VISIBLE_DEVICES", "unset").strip() in ("", "-1") or not fingerprint.collect()["gpus"]:
        return False, "no GPU on this host; hygiene.warmup_boot: true turns it on"
    return True, "a GPU is on this host, so the engine runs on CUDA"
