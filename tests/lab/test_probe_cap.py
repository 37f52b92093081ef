"""`hygiene.probe_prompt_tokens`: each boot's readiness request is capped where the ladder's largest
request would take minutes to prefill (a 1M-token ladder), and the boot's capabilities say so;
the instruments still send their full-size requests. The real bundled engine, on `dummy:tiny`."""

from __future__ import annotations

import pytest
from sqlalchemy import select

from lab.instruments.capabilities import summary
from lab.store import models as m
from tests.instruments.ladder_run import run_ladder

pytestmark = pytest.mark.slow

LADDER = """\
    name: probecap
    engine:
      kind: bundled
      model: dummy:tiny
      flags: {device: cpu, max-model-len: 2048, kv-cache-memory-bytes: 67108864}
    windows:
      - name: W1
        control: C0ctl
        arms:
          - {name: A1, flags: {max-num-seqs: 4}}
    instruments:
      prefill: {lengths: [1500], reps: 1}
    keep:
      metrics:
        - {metric: prefill.prefill_tok_s_median, where: {length: 1500}}
    hygiene: {min_mem_available_gib: 1, probe_prompt_tokens: 200}
    """


def test_the_probe_is_capped_and_says_so_while_prefill_sends_its_full_length(tmp_path) -> None:
    store = run_ladder(tmp_path, LADDER, "probecap", timeout=300)
    with store.session() as s:
        boots = s.scalars(select(m.Boot).order_by(m.Boot.id)).all()
        cells = s.scalars(select(m.Cell).where(m.Cell.metric == "prefill_tok_s_median")).all()
        assert len(boots) == 3 and all(b.status == "done" for b in boots)
        for boot in boots:
            large = boot.capabilities["largest_prompt"]
            assert boot.capabilities["answered"] and large["tokens"] <= 200, large
            assert large["capped_from"] > 1500, large  # the prefill's 1,500 tokens and its reply
            assert "(capped; the ladder's largest is" in summary(boot.capabilities)
        assert len(cells) == 3 and all(c.valid and c.value > 0 for c in cells)
        prompts = s.scalars(select(m.Request.prompt_tokens).join(m.Step).where(m.Step.instrument == "prefill")).all()
        assert prompts and all(n == 1500 for n in prompts)
