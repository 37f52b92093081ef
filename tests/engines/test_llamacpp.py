"""llama.cpp's server (llama-cpp-python) measured end to end by `lab run`, beside the bundled engine
on the same GGUF with the same instruments: valid cells, verdicts, the capability probe's findings,
and prefill figures checked against llama.cpp's own timing of the same requests (the
`llama_perf_context_print` block its server logs after each one).

One thread for llama.cpp: on a 2-core host shared with other work, its two threads' spin barriers
made decode about 1 token/s."""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

from sqlalchemy import select

from lab.store import models as m
from lab.store.db import Store
from tests.instruments.ladder_run import run_ladder

INSTRUMENTS = """
instruments:
  agreement: {prompts: 2, max_tokens: 8}
  prefill: {lengths: [1024], reps: 2}       # two 512-token batches: see _against_llamacpp_timing
  decode: {levels: [1], max_tokens: 8}
  mixed: {long_tokens: 512, delay_s: 0.1, short_max_tokens: 4}
  memory:
keep:
  threshold_pct: 2
  metrics:
    - {metric: prefill.prefill_tok_s_median, where: {length: 1024}}
    - {metric: decode.agg_tok_s, where: {level: 1}}
  gates:
    - {metric: memory.host_mem_available_floor_gib, min: 0.5}
    - {metric: agreement.exact_match_rate, min: 1}
# A warm-up boot: a command engine's first boot of a run counts as cold, and agreement needs a
# warm opening control for its reference.
hygiene: {min_mem_available_gib: 1, warmup_boot: true}
"""

LLAMACPP = """
name: peer-llamacpp
engine:
  kind: command
  executable: @PYTHON@
  command: ["{executable}", -m, llama_cpp.server, --model, "{model}", --host, 127.0.0.1, --port, "{port}"]
  model: @GGUF@
  served_model_name: smollm2
  flag_style: "--{name} {value}"
  bool_style: value
  flags: {model_alias: smollm2, n_ctx: 2048, n_batch: 512, n_threads: 1, interrupt_requests: false}
  ready_timeout_s: 300
  stop_grace_s: 10
windows:
  - name: W1
    control: L0ctl
    arms:
      - {name: L1batch256, flags: {n_batch: 256}}
""" + INSTRUMENTS

BUNDLED = """
name: peer-bundled
engine:
  kind: bundled
  model: smollm2-135m
  flags: {device: cpu, dtype: float32, max-model-len: 2048, kv-cache-memory-bytes: 268435456}
windows:
  - name: W1
    control: B0ctl
    arms:
      - {name: B1mnbt256, flags: {max-num-batched-tokens: 256}}
""" + INSTRUMENTS

# Every measured boot must give these a valid value.
MEASURED = (("prefill", "prefill_tok_s_median"), ("decode", "agg_tok_s"), ("mixed", "short_ttft_behind_s"),
            ("agreement", "exact_match_rate"), ("memory", "host_mem_available_floor_gib"))


def test_llamacpp_server_measured_beside_the_bundled_engine(tmp_path: Path, llamacpp_python: Path,
                                                            smollm2_gguf: Path) -> None:
    ladder = LLAMACPP.replace("@PYTHON@", str(llamacpp_python)).replace("@GGUF@", str(smollm2_gguf))
    store = run_ladder(tmp_path, ladder, "llamacpp", timeout=1800)
    run_ladder(tmp_path, BUNDLED, "bundled", timeout=1800).close()
    try:
        check_runs(store, llamacpp_python)
    finally:
        store.close()


def check_runs(store: Store, llamacpp_python: Path) -> None:
    """What the two stored runs must show; prints the side-by-side figures and prefill ratios."""
    llama = _boots(store, "llamacpp")
    bundled = _boots(store, "bundled")
    for boot in llama:
        caps = boot.capabilities
        assert caps["answered"] and caps["largest_prompt"] == {"tokens": 1017, "exact": True}, caps
        assert (caps["streamed_usage"], caps["tokenizer"]) == (False, "/extras/tokenize"), caps
        assert caps["token_count"]["ok"], caps
        assert caps["ignore_eos"] in ("ignored", "unknown"), caps
        if caps["ignore_eos"] == "ignored":
            # llama.cpp's server honours OpenAI's logit_bias: the probe bans the EOS ids instead
            assert caps["eos_ban"]["ok"], caps
        assert boot.fingerprint["engine"] == {"name": "llama_cpp_python", "version": "0.3.36",
                                              "source": f"{llamacpp_python}'s package metadata"}
    for boot in bundled:
        caps = boot.capabilities
        assert (caps["streamed_usage"], caps["tokenizer"], caps["ignore_eos"]) == (True, "/tokenize",
                                                                                 "honoured"), caps
    figures = {}
    for name, boots in (("llamacpp", llama), ("bundled", bundled)):
        assert [b.status for b in boots] == ["done"] * 4  # warm-up, control, arm, control
        boots = boots[1:]
        cells = _cells(store, [b.id for b in boots])
        for boot in boots:
            for instrument, metric in MEASURED:
                if instrument == "agreement" and boot is boots[0]:
                    continue  # the opening control is agreement's reference: it stores no cells
                mine = [c for c in cells if (c.boot_id, c.instrument, c.metric) == (boot.id, instrument, metric)]
                assert mine and all(c.valid and c.value is not None for c in mine), \
                    (name, instrument, metric, [(c.valid, c.note) for c in mine])
        figures[name] = {f"{c.instrument}.{c.metric}": c.value for c in cells
                         if c.boot_id == boots[0].id and (c.instrument, c.metric) in MEASURED}
        verdicts = _verdicts(store, name)
        assert len(verdicts) == 1 and verdicts[0].decision in ("keep", "reject", "inconclusive"), verdicts
        assert not any("no value" in reason for reason in verdicts[0].reasons), verdicts[0].reasons
    counted = [c for c in _cells(store, [b.id for b in llama]) if (c.instrument, c.metric) == ("prefill", "prefill_tok_s")]
    assert counted and all("tokens counted by /extras/tokenize" in c.note for c in counted)
    for boot in llama[1:]:
        if (boot.capabilities.get("eos_ban") or {}).get("ok"):
            decode = [c for c in _cells(store, [boot.id]) if (c.instrument, c.metric) == ("decode", "agg_tok_s")]
            assert decode and all("EOS banned by logit_bias" in c.note for c in decode), [c.note for c in decode]
    ratios = _against_llamacpp_timing(store, llama[1:])
    print(f"\nllama.cpp's probe: ignore_eos {llama[1].capabilities['ignore_eos']}, "
          f"EOS ban {llama[1].capabilities.get('eos_ban')}")
    print(f"side by side, first control boot: {json.dumps(figures, indent=1)}")
    print(f"lab prefill tok/s over llama.cpp's own prompt-eval tok/s, per request: {ratios}")
    assert abs(statistics.median(ratios) - 1) <= 0.05, ratios


def _boots(store: Store, run: str) -> list[m.Boot]:
    with store.session() as s:
        return list(s.scalars(select(m.Boot).join(m.Run, m.Run.id == m.Boot.run_id).where(m.Run.name == run)
                              .order_by(m.Boot.id)).all())


def _cells(store: Store, boot_ids: list[int]) -> list[m.Cell]:
    with store.session() as s:
        return list(s.scalars(select(m.Cell).where(m.Cell.boot_id.in_(boot_ids))).all())


def _verdicts(store: Store, run: str) -> list[m.Verdict]:
    with store.session() as s:
        return list(s.scalars(select(m.Verdict).join(m.Run, m.Run.id == m.Verdict.run_id)
                              .where(m.Run.name == run)).all())


# The block llama.cpp's server logs after each request.
PROMPT_EVAL = re.compile(r"prompt eval time =\s*([\d.]+) ms /\s*(\d+) tokens")


def _against_llamacpp_timing(store: Store, boots: list[m.Boot]) -> list[float]:
    """Each valid prefill_tok_s over the tok/s llama.cpp's perf counters give the same request in
    the boot's log. The log's evaluations of over 900 tokens are the probe's 1017 (first) and then
    prefill's repeats, in order; prefill's count a few tokens less when the salt's opening words
    match the previous prompt's cached prefix. Prompts of more than one batch (n_batch 512) only:
    for a prompt of one batch this build's perf counters sometimes log a fraction of a millisecond
    (the batch's compute is not waited for inside the prompt-eval timer), seen at 512 tokens."""
    ratios = []
    for boot in boots:
        evals = [(float(ms), int(n)) for ms, n in PROMPT_EVAL.findall(Path(boot.log_path).read_text())
                 if int(n) > 900]
        cells = sorted((c for c in _cells(store, [boot.id]) if (c.instrument, c.metric) == ("prefill", "prefill_tok_s")),
                       key=lambda c: c.repeat)
        assert len(evals) == 1 + len(cells) and all(1000 <= n <= 1024 for _, n in evals[1:]), evals
        ratios += [round(c.value / (n * 1e3 / ms), 4) for c, (ms, n) in zip(cells, evals[1:])]
    return ratios
