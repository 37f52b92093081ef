"""Arms render to exactly the argv, environment and expected config a boot uses."""

from __future__ import annotations

import sys
import textwrap

from lab.engine import settings as engine_settings
from lab.ladder.engines import kind_of
from lab.ladder.render import plan
from lab.ladder.validate import parse_ladder
from lab.runner.boot import child_env


def ladder(text: str):
    return parse_ladder(textwrap.dedent(text), "t.yaml")


BUNDLED = """\
    name: b
    engine:
      kind: bundled
      model: smollm2-135m
      flags: {device: cpu, max-num-batched-tokens: 2048, enable-prefix-caching: true}
      env: {LAB_ENGINE_SEED: 7, OMP_NUM_THREADS: 2}
    windows:
      - name: W1
        control: C0ctl
        arms:
          - {name: C1, flags: {max-num-batched-tokens: 512}}
          - {name: C2, env: {LAB_ENGINE_MAX_NUM_SEQS: 8}}
      - name: W2
        arms:
          - {name: D1, flags: {enable-prefix-caching: false}}
    hygiene: {warmup_boot: true}
    """


def test_windows_bracket_each_arm_with_controls_after_one_warmup() -> None:
    p = plan(ladder(BUNDLED))
    assert [(s.idx, s.arm, s.role, s.position, s.window) for s in p.slots] == [
        (0, "C0ctl", "warmup", "warmup", None),
        (1, "C0ctl", "control", "open", "W1"),
        (2, "C1", "arm", "arm", "W1"),
        (3, "C2", "arm", "arm", "W1"),
        (4, "C0ctl", "control", "close", "W1"),
        (5, "W2ctl", "control", "open", "W2"),
        (6, "D1", "arm", "arm", "W2"),
        (7, "W2ctl", "control", "close", "W2"),
    ]


def test_repeats_interleave_every_arm_with_controls() -> None:
    p = plan(ladder(BUNDLED.replace("hygiene: {warmup_boot: true}", "repeats: 2")))
    assert [(s.arm, s.position) for s in p.slots if s.window == "W1"] == [
        ("C0ctl", "open"), ("C1", "arm"), ("C2", "arm"), ("C0ctl", "between"), ("C1", "arm"), ("C2", "arm"),
        ("C0ctl", "close")]
    assert len([a for a in p.arms if a.name == "C1"]) == 1  # one arm, booted twice


def test_a_window_with_no_arms_boots_its_control_once_or_repeats_times() -> None:
    armless = BUNDLED.replace("""        arms:
          - {name: D1, flags: {enable-prefix-caching: false}}
""", "")
    p = plan(ladder(armless))
    assert [(s.arm, s.role, s.position) for s in p.slots if s.window != "W1"] == [
        ("C0ctl", "warmup", "warmup"), ("W2ctl", "control", "open")]
    p = plan(ladder(armless.replace("hygiene: {warmup_boot: true}", "repeats: 3")))
    assert [(s.arm, s.position) for s in p.slots if s.window == "W2"] == [
        ("W2ctl", "open"), ("W2ctl", "between"), ("W2ctl", "close")]
    assert [(s.arm, s.position) for s in p.slots if s.window == "W1"][-1] == ("C0ctl", "close")


def test_a_warmup_list_boots_each_named_config_once_before_the_first_window() -> None:
    p = plan(ladder(BUNDLED.replace("warmup_boot: true", "warmup_boot: [C0ctl, D1]")))
    assert [(s.arm, s.role, s.window) for s in p.slots[:3]] == [
        ("C0ctl", "warmup", None), ("D1", "warmup", None), ("C0ctl", "control", "W1")]
    assert [s.arm for s in p.slots if s.role == "warmup"] == ["C0ctl", "D1"]


def test_bundled_arm_is_base_plus_its_change_and_hash_is_the_engines() -> None:
    lad = ladder(BUNDLED)
    p = plan(lad)
    c1 = p.arm("C1")
    assert c1.change == {"flags": {"max-num-batched-tokens": 512}, "env": {}}
    assert c1.flags == {"device": "cpu", "max-num-batched-tokens": 512, "enable-prefix-caching": True}
    expected = engine_settings.from_sources({"device": "cpu", "max_num_batched_tokens": 512,
                                             "enable_prefix_caching": True, "model": "smollm2-135m"},
                                            {"LAB_ENGINE_SEED": "7"})
    assert c1.config_hash == expected.hash
    c2 = p.arm("C2")
    assert c2.env == {"LAB_ENGINE_SEED": "7", "OMP_NUM_THREADS": "2", "LAB_ENGINE_MAX_NUM_SEQS": "8"}
    assert c2.config["max_num_seqs"] == 8
    assert p.arm("C0ctl").config_hash == p.arm("W2ctl").config_hash != c1.config_hash

    spec = launch_of(lad, c1, 8123)
    assert spec.argv == [sys.executable, "-m", "lab.engine", "serve", "--host", "127.0.0.1", "--port", "8123",
                         "--model", "smollm2-135m", "--device", "cpu", "--max-num-batched-tokens", "512",
                         "--enable-prefix-caching", "true"]
    assert spec.api_base == "http://127.0.0.1:8123/v1" and spec.expected_config_hash == c1.config_hash


def test_inherited_engine_variables_never_reach_the_child() -> None:
    env, removed = child_env({"LAB_ENGINE_SEED": "7"}, base={"PATH": "/bin", "LAB_ENGINE_MAX_NUM_SEQS": "1",
                                                            "LAB_ENGINE_SEED": "3"})
    assert env == {"PATH": "/bin", "LAB_ENGINE_SEED": "7"}
    assert removed == ["LAB_ENGINE_MAX_NUM_SEQS", "LAB_ENGINE_SEED"]


COMMAND = """\
    name: c
    engine:
      kind: command
      command: [vllm, serve, "{model}", --port, "{port}", --compilation-config, '{"level": 3}']
      model: org/model
      served_model_name: m
      bool_style: negatable
      flags: {max-num-seqs: 16, enable-prefix-caching: true, cudagraph-capture-sizes: [1, 2, 4],
              speculative-config: {method: ngram, k: 3}}
      env: {VLLM_USE_V1: true}
    windows:
      - name: W1
        arms:
          - {name: A1, flags: {enable-prefix-caching: false}}
    """


def test_command_engine_renders_a_list_argv_with_placeholders_filled() -> None:
    lad = ladder(COMMAND)
    spec = launch_of(lad, plan(lad).arm("A1"), 9000)
    assert spec.argv == ["vllm", "serve", "org/model", "--port", "9000", "--compilation-config", '{"level": 3}',
                         "--max-num-seqs", "16", "--no-enable-prefix-caching", "--cudagraph-capture-sizes", "1", "2",
                         "4", "--speculative-config", '{"method":"ngram","k":3}']
    assert spec.env == {"VLLM_USE_V1": "1"}
    assert (spec.base_url, spec.api_base, spec.model) == ("http://127.0.0.1:9000", "http://127.0.0.1:9000/v1", "m")


def test_flag_styles() -> None:
    lad = ladder(COMMAND.replace("bool_style: negatable", "bool_style: switch")
                 .replace('served_model_name: m', 'flag_style: "--{name}={value}"'))
    argv = launch_of(lad, plan(lad).arm("A1"), 1).argv
    assert argv[7:] == ["--max-num-seqs=16", "--cudagraph-capture-sizes=1,2,4",
                        '--speculative-config={"method":"ngram","k":3}']  # switch style: false is left out
    lad = ladder(COMMAND.replace("bool_style: negatable", "bool_style: value"))
    assert "--enable-prefix-caching" in (argv := launch_of(lad, plan(lad).arm("A1"), 1).argv)
    assert argv[argv.index("--enable-prefix-caching") + 1] == "false"


def launch_of(lad, arm, port):
    return kind_of(lad.engine).launch(arm, port)
