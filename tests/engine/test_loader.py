"""Model loading: GGUF weights equal to transformers' bit for bit, the on-disk cache (cold/warm,
kill-safety, damage), Hugging Face directories, dummy weights, and one-line errors."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from lab.engine.model_config import PRESETS
from lab.engine.weights.loader import ModelLoadError, load_model, weight_shapes
from lab.engine.weights.tokenizer import BYTE_TO_CHAR, Tokenizer
from lab.engine.weights.weights_gguf import read_gguf

REPO = Path(__file__).resolve().parents[2]
CACHE_FILES = {"model.safetensors", "config.json", "tokenizer.json", "tokenizer_meta.json", "manifest.json"}


# -- the real model, through the cache ---------------------------------------------------------

@pytest.fixture(scope="module")
def killed_then_cold(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str], object]:
    """A first load killed while writing the cache, then a first load that completes.
    Returns (cache root, root entries seen right after the kill, the completed load)."""
    root = tmp_path_factory.mktemp("cache")
    code = ("import sys, torch; from lab.engine.weights.loader import load_model; "
            "load_model('smollm2-135m', torch.float32, cache_dir=sys.argv[1])")
    child = subprocess.Popen([sys.executable, "-c", code, str(root)], cwd=REPO)
    deadline = time.monotonic() + 300
    while not any(p.name.startswith(".tmp-") for p in root.iterdir()):
        assert child.poll() is None, "the first load ended before it started writing the cache"
        assert time.monotonic() < deadline
        time.sleep(0.005)
    child.send_signal(signal.SIGKILL)
    child.wait()
    after_kill = sorted(p.name for p in root.iterdir())
    loaded = load_model("smollm2-135m", torch.float32, cache_dir=root)
    return root, after_kill, loaded


@pytest.fixture(scope="module")
def cold(killed_then_cold):
    return killed_then_cold[2]


@pytest.fixture(scope="module")
def cache_root(killed_then_cold) -> Path:
    return killed_then_cold[0]


def test_gguf_weights_bit_identical_to_transformers(cold, hf_model) -> None:
    reference = hf_model.state_dict()
    assert set(reference) - set(cold.weights) == {"lm_head.weight"}  # tied: the model reuses the embedding
    assert set(cold.weights) <= set(reference)
    for name, tensor in cold.weights.items():
        assert tensor.dtype == torch.float32, name
        assert torch.equal(tensor, reference[name]), name
    assert torch.equal(reference["lm_head.weight"], cold.weights["model.embed_tokens.weight"])


def test_gguf_config_matches_transformers(cold, hf_model) -> None:
    hf = hf_model.config
    c = cold.config
    assert (c.architecture, c.vocab_size, c.hidden_size, c.intermediate_size, c.num_layers, c.num_heads,
            c.num_kv_heads, c.head_dim, c.max_position_embeddings, c.tie_word_embeddings) == \
        ("llama", hf.vocab_size, hf.hidden_size, hf.intermediate_size, hf.num_hidden_layers,
         hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim, hf.max_position_embeddings, True)
    assert np.float32(c.rms_norm_eps) == np.float32(hf.rms_norm_eps)
    assert c.rope_theta == hf.rope_parameters["rope_theta"] == 100000.0
    assert (c.bos_token_id, c.eos_token_ids, c.attention_bias, c.rope_scaling) == (1, (2,), False, None)
    assert c == PRESETS["smollm2-135m"]  # the dummy preset has exactly the real shape


def test_first_load_is_cold_and_killed_load_leaves_no_cache(killed_then_cold, smollm2_gguf: Path) -> None:
    root, after_kill, loaded = killed_then_cold
    assert after_kill and all(name.startswith(".tmp-") for name in after_kill)  # nothing under the final name
    assert loaded.cold is True
    assert loaded.source == str(smollm2_gguf.resolve())
    # The completed load removed the killed one's temporary directory and installed a whole cache.
    assert [p.name for p in root.iterdir()] == [loaded.source_hash[:16]]
    assert {p.name for p in (root / loaded.source_hash[:16]).iterdir()} == CACHE_FILES


def test_source_hash_is_the_file_sha256(cold, smollm2_gguf: Path) -> None:
    assert cold.source_hash == hashlib.sha256(smollm2_gguf.read_bytes()).hexdigest()


def test_warm_load_reads_only_the_cache(cache_root: Path, cold, monkeypatch: pytest.MonkeyPatch) -> None:
    # With the GGUF reading code unimportable, only a load that never touches the GGUF reader works.
    monkeypatch.setitem(sys.modules, "lab.engine.weights.weights_gguf", None)
    monkeypatch.setitem(sys.modules, "gguf", None)
    warm = load_model("smollm2-135m", torch.float32, cache_dir=cache_root)
    assert warm.cold is False
    assert warm.source_hash == cold.source_hash
    assert warm.config == cold.config
    assert warm.weights.keys() == cold.weights.keys()
    assert all(torch.equal(warm.weights[k], cold.weights[k]) for k in cold.weights)
    text = "<|im_start|>user\nhéllo 日本 🙂  12<|im_end|>"
    assert warm.tokenizer.encode(text) == cold.tokenizer.encode(text)
    messages = [{"role": "user", "content": "hi"}]
    assert warm.tokenizer.apply_chat_template(messages) == cold.tokenizer.apply_chat_template(messages)


def test_cache_root_from_environment(cache_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LAB_CACHE_DIR", str(cache_root))
    assert load_model("smollm2-135m", torch.float32).cold is False


def test_warm_load_time(benchmark, cache_root: Path, cold) -> None:
    """`pytest --benchmark-enable -k warm_load_time` measures the warm load (file hash + cached
    weights + tokenizer); with benchmarks disabled it runs once as a check."""
    loaded = benchmark(load_model, "smollm2-135m", torch.float32, cache_dir=cache_root)
    assert loaded.cold is False


def test_reduced_dtype_is_a_cast_of_float32(cache_root: Path, cold) -> None:
    bf16 = load_model("smollm2-135m", torch.bfloat16, cache_dir=cache_root)
    assert all(t.dtype == torch.bfloat16 for t in bf16.weights.values())
    name = "model.layers.3.self_attn.k_proj.weight"
    assert torch.equal(bf16.weights[name], cold.weights[name].to(torch.bfloat16))


# -- small GGUF files written here --------------------------------------------------------------

TINY_CONTROL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TINY_MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "Ġ Ġ", "ĠĠ ĠĠ", "1 2"]
TINY_TEXTS = ["the thin 12 345  12 a", "<|im_start|>the", "", "  the   12\n\n", "héllo 日本"]


def write_tiny_gguf(path: Path, arch: str = "llama", pre: str = "llama-bpe", add_bos: bool = True,
                    tied: bool = True, seed: int = 0) -> Path:
    """A two-layer model in every tensor type the loader must read (F32, F16, BF16, Q8_0, Q4_1),
    with a small byte-level vocabulary."""
    rng = np.random.default_rng(seed)
    hidden, ffn, layers, heads, kv, head_dim = 64, 96, 2, 4, 2, 16
    tokens = TINY_CONTROL + [BYTE_TO_CHAR[b] for b in range(256)] + [m.replace(" ", "") for m in TINY_MERGES]
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(layers)
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([3] * len(TINY_CONTROL) + [1] * (len(tokens) - len(TINY_CONTROL)))
    writer.add_token_merges(TINY_MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(add_bos)

    def put(name: str, shape: tuple[int, ...], qtype: Q, base: float = 0.0) -> None:
        values = (base + 0.02 * rng.standard_normal(shape)).astype(np.float32)
        raw = gguf.quants.quantize(values, qtype)
        writer.add_tensor(name, raw, raw_dtype=None if qtype in (Q.F32, Q.F16) else qtype)

    put("token_embd.weight", (len(tokens), hidden), Q.Q8_0)
    for i in range(layers):
        p = f"blk.{i}."
        put(p + "attn_norm.weight", (hidden,), Q.F32, 1.0)
        put(p + "attn_q.weight", (heads * head_dim, hidden), Q.F16)
        put(p + "attn_k.weight", (kv * head_dim, hidden), Q.BF16)
        put(p + "attn_v.weight", (kv * head_dim, hidden), Q.Q8_0)
        if arch == "qwen2":
            put(p + "attn_q.bias", (heads * head_dim,), Q.F32)
            put(p + "attn_k.bias", (kv * head_dim,), Q.F32)
            put(p + "attn_v.bias", (kv * head_dim,), Q.F32)
        put(p + "attn_output.weight", (hidden, heads * head_dim), Q.Q4_1)
        put(p + "ffn_norm.weight", (hidden,), Q.F32, 1.0)
        put(p + "ffn_gate.weight", (ffn, hidden), Q.F16)
        put(p + "ffn_up.weight", (ffn, hidden), Q.Q8_0)
        put(p + "ffn_down.weight", (hidden, ffn), Q.BF16)
    put("output_norm.weight", (hidden,), Q.F32, 1.0)
    if not tied:
        put("output.weight", (len(tokens), hidden), Q.Q4_1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("arch,pre,add_bos,tied", [("llama", "llama-bpe", True, True),
                                                   ("qwen2", "qwen2", False, False)])
def test_tiny_gguf_matches_transformers(tmp_path: Path, arch: str, pre: str, add_bos: bool, tied: bool) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = write_tiny_gguf(tmp_path / f"{arch}.gguf", arch, pre, add_bos, tied)
    loaded = load_model(str(path), torch.float32, cache_dir=tmp_path / "cache")
    reference = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name,
                                                     dtype=torch.float32).state_dict()
    assert set(loaded.weights) == set(reference) - ({"lm_head.weight"} if tied else set())
    for name, tensor in loaded.weights.items():
        assert torch.equal(tensor, reference[name]), name
    assert (loaded.config.architecture, loaded.config.attention_bias, loaded.config.tie_word_embeddings) == \
        (arch, arch == "qwen2", tied)
    hf_tokenizer = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    for text in TINY_TEXTS:
        assert loaded.tokenizer.encode(text) == hf_tokenizer(text)["input_ids"], text
    assert loaded.tokenizer.add_bos_token is add_bos


def test_damaged_cache_is_rebuilt(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "m.gguf")
    root = tmp_path / "cache"
    first = load_model(str(path), torch.float32, cache_dir=root)
    directory = root / first.source_hash[:16]
    damages = [
        lambda: (directory / "model.safetensors").write_bytes((directory / "model.safetensors").read_bytes()[:-100]),
        lambda: (directory / "tokenizer.json").write_text("{", "utf-8"),
        lambda: (directory / "manifest.json").unlink(),
        lambda: (directory / "config.json").write_text(json.dumps({"vocab_size": 3}), "utf-8"),
        lambda: _overwrite(directory / "model.safetensors", b"\xff" * 8),  # same size, bad header
    ]
    for damage in damages:
        damage()
        again = load_model(str(path), torch.float32, cache_dir=root)
        assert again.cold is True
        assert all(torch.equal(again.weights[k], first.weights[k]) for k in first.weights)
        assert load_model(str(path), torch.float32, cache_dir=root).cold is False


def _overwrite(path: Path, head: bytes) -> None:
    with open(path, "r+b") as f:
        f.write(head)


def test_cache_is_keyed_by_content_not_path(tmp_path: Path) -> None:
    original = write_tiny_gguf(tmp_path / "a.gguf")
    copy = tmp_path / "elsewhere" / "b.gguf"
    copy.parent.mkdir()
    shutil.copy(original, copy)
    root = tmp_path / "cache"
    assert load_model(str(original), torch.float32, cache_dir=root).cold is True
    assert load_model(str(copy), torch.float32, cache_dir=root).cold is False
    other = write_tiny_gguf(tmp_path / "c.gguf", seed=1)
    assert load_model(str(other), torch.float32, cache_dir=root).cold is True


def test_abandoned_build_of_a_dead_process_is_removed(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "m.gguf")
    root = tmp_path / "cache"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    abandoned = root / f".tmp-{digest[:16]}-{dead.pid}-x1y2"
    abandoned.mkdir(parents=True)
    (abandoned / "model.safetensors").write_bytes(b"half")
    assert load_model(str(path), torch.float32, cache_dir=root).cold is True
    assert [p.name for p in root.iterdir()] == [digest[:16]]


# -- Hugging Face directories -------------------------------------------------------------------

def _save_hf_model(directory: Path, kind: str, tokenizer: Tokenizer, template_file: bool = False,
                   **config_kwargs) -> dict[str, torch.Tensor]:
    """A small random model saved by transformers, with the SmolLM2 tokenizer beside it; the chat
    template in tokenizer_config.json, or in chat_template.jinja as transformers 5 writes it."""
    import transformers

    config_class, model_class = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }[kind]
    torch.manual_seed(0)
    config = config_class(vocab_size=tokenizer.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                          bos_token_id=1, eos_token_id=2, **config_kwargs)
    model = model_class(config)
    model.save_pretrained(directory, max_shard_size="1MB")
    tokenizer.save(directory)
    (directory / "tokenizer_meta.json").unlink()  # not part of the Hugging Face format
    tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|im_start|>",
                        "eos_token": "<|im_end|>", "unk_token": "<|endoftext|>"}
    if template_file:
        (directory / "chat_template.jinja").write_text(tokenizer.chat_template_source, "utf-8")
    else:
        tokenizer_config["chat_template"] = tokenizer.chat_template_source
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config), "utf-8")
    (directory / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": [2, 0]}), "utf-8")
    return model.state_dict()


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_gguf: Path) -> Tokenizer:
    return read_gguf(smollm2_gguf)[2]


LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 128}


@pytest.mark.parametrize("kind,extra", [
    ("llama", {"tie_word_embeddings": False, "rope_scaling": LLAMA3_SCALING}),
    ("qwen2", {"tie_word_embeddings": True, "rope_theta": 1000000.0}),
    ("mistral", {"tie_word_embeddings": False, "template_file": True}),
])
def test_hf_directory_round_trips(tmp_path: Path, smollm2_tokenizer: Tokenizer, kind: str, extra: dict) -> None:
    from transformers import AutoTokenizer

    # transformers writes into a rope_scaling dict it is given, so it gets a copy.
    reference = _save_hf_model(tmp_path, kind, smollm2_tokenizer, **json.loads(json.dumps(extra)))
    assert len(list(tmp_path.glob("*.safetensors"))) > 1  # sharded, with an index
    loaded = load_model(str(tmp_path), torch.float32)
    tied = extra["tie_word_embeddings"]
    assert loaded.tokenizer.chat_template_source == smollm2_tokenizer.chat_template_source
    assert set(loaded.weights) == set(reference) - ({"lm_head.weight"} if tied else set())
    for name, tensor in loaded.weights.items():
        assert torch.equal(tensor, reference[name]), name
    c = loaded.config
    assert (c.architecture, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, c.tie_word_embeddings) == \
        (kind, 2, 4, 2, 8, tied)
    assert c.attention_bias is (kind == "qwen2")
    assert c.eos_token_ids == (2, 0) and c.bos_token_id == 1
    assert loaded.cold is False and loaded.source == str(tmp_path.resolve())
    if kind == "llama":
        assert c.rope_scaling == LLAMA3_SCALING and c.rope_theta == 10000.0
    if kind == "qwen2":
        assert c.rope_scaling is None and c.rope_theta == 1000000.0

    reference_tokenizer = AutoTokenizer.from_pretrained(str(tmp_path))
    for text in ["Hello  world 12", "<|im_start|>日本 🙂<|im_end|>", ""]:
        assert loaded.tokenizer.encode(text) == reference_tokenizer(text)["input_ids"]
    messages = [{"role": "user", "content": "hi"}]
    assert loaded.tokenizer.apply_chat_template(messages) == \
        reference_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert loaded.tokenizer.eos_token_ids == (2, 0)


def test_hf_directory_in_bfloat16_and_hash_follows_content(tmp_path: Path, smollm2_tokenizer: Tokenizer) -> None:
    reference = _save_hf_model(tmp_path, "llama", smollm2_tokenizer)
    loaded = load_model(str(tmp_path), torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 for t in loaded.weights.values())
    name = "model.layers.1.mlp.down_proj.weight"
    assert torch.equal(loaded.weights[name], reference[name].to(torch.bfloat16))
    config = json.loads((tmp_path / "config.json").read_text())
    config["rms_norm_eps"] = 1e-5
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert load_model(str(tmp_path), torch.bfloat16).source_hash != loaded.source_hash


# -- dummy weights ------------------------------------------------------------------------------

def test_dummy_weights_are_seeded_and_shaped() -> None:
    a = load_model("dummy:tiny", torch.float32, seed=7)
    b = load_model("dummy:tiny", torch.float32, seed=7)
    c = load_model("dummy:tiny", torch.float32, seed=8)
    tiny = dataclasses.replace(PRESETS["tiny"], eos_token_ids=(511, 509))  # the dummy tokenizer's stop ids
    assert a.config == tiny and a.cold is False and a.source == "dummy:tiny"  # random weights: no cache
    assert {k: tuple(v.shape) for k, v in a.weights.items()} == weight_shapes(PRESETS["tiny"])
    assert all(torch.equal(a.weights[k], b.weights[k]) for k in a.weights)
    assert not torch.equal(a.weights["model.embed_tokens.weight"], c.weights["model.embed_tokens.weight"])
    assert a.source_hash == b.source_hash != c.source_hash
    assert torch.equal(a.weights["model.norm.weight"], torch.ones(128))
    std = a.weights["model.embed_tokens.weight"].std().item()
    assert 0.019 < std < 0.021


def test_dummy_biases_are_small_and_dtype_is_the_requested_one() -> None:
    qwen = load_model("dummy:qwen2.5-0.5b", torch.bfloat16)
    bias = qwen.weights["model.layers.0.self_attn.q_proj.bias"]
    assert bias.dtype == torch.bfloat16 and 0 < bias.float().abs().max().item() < 0.02
    assert all(t.dtype == torch.bfloat16 and t.device.type == "cpu" for t in qwen.weights.values())
    assert "lm_head.weight" not in qwen.weights  # tied preset


def test_dummy_8b_shape_is_made_on_the_target_device() -> None:
    loaded = load_model("dummy:llama3-8b", torch.bfloat16, device="meta")
    assert all(t.device.type == "meta" and t.dtype == torch.bfloat16 for t in loaded.weights.values())
    assert sum(t.numel() for t in loaded.weights.values()) == PRESETS["llama3-8b"].num_params
    assert loaded.tokenizer.vocab_size == 128256 and loaded.tokenizer.eos_token_ids == (128255, 128253)


# -- errors -------------------------------------------------------------------------------------

def _load_error(model: str, **kwargs) -> str:
    with pytest.raises(ModelLoadError) as info:
        load_model(model, torch.float32, **kwargs)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_unknown_preset_lists_the_presets() -> None:
    message = _load_error("dummy:llama-70b")
    assert "llama-70b" in message and all(name in message for name in PRESETS)


def test_missing_path(tmp_path: Path) -> None:
    assert "no such file" in _load_error(str(tmp_path / "nope.gguf"))


def test_directory_without_config(tmp_path: Path) -> None:
    assert "config.json" in _load_error(str(tmp_path))


def test_unsupported_hf_architecture(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    message = _load_error(str(tmp_path))
    assert "gpt2" in message and "llama" in message


def test_unsupported_gguf_architecture(tmp_path: Path) -> None:
    writer = gguf.GGUFWriter(tmp_path / "f.gguf", "falcon")
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    message = _load_error(str(tmp_path / "f.gguf"), cache_dir=tmp_path / "cache")
    assert "falcon" in message and "llama" in message


@pytest.mark.parametrize("keep", [0.5, 0.001])
def test_truncated_gguf(tmp_path: Path, smollm2_gguf: Path, keep: float) -> None:
    data = smollm2_gguf.read_bytes()
    truncated = tmp_path / "cut.gguf"
    truncated.write_bytes(data[: int(len(data) * keep)])
    message = _load_error(str(truncated), cache_dir=tmp_path / "cache")
    assert "truncated" in message
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())


def test_not_a_gguf_file(tmp_path: Path) -> None:
    path = tmp_path / "weights.bin"
    path.write_text("hello")
    assert "not a GGUF file" in _load_error(str(path))
