"""Issue 53, part 5: ``--quantization auto`` picks, among the exact modes, the one the kernel self-test measured
fastest for the rows each target pass holds (1 for plain decoding, K + 1 with speculation), and logs it.

No kernels are built here: the self-test is replaced by fake measured costs."""

from __future__ import annotations

import logging

import pytest
import torch

from draftwise.config import SpeculativeConfig
from draftwise.models import auto_quantization, loading
from draftwise.models.auto_quantization import (
    ModeTiming,
    busy_load,
    choose_quantization,
    interpolate_seconds,
    measure_mode,
    target_rows_per_pass,
)
from draftwise.models.loading import resolve_quantization

# shaped like the Zen4 measurement of Qwen2.5-Coder-1.5B: q4k wins one-row passes, int8 wins 5 rows and more
INT8 = ModeTiming("int8", {1: 0.060, 2: 0.060, 4: 0.060, 8: 0.062, 16: 0.080})
Q4K = ModeTiming("q4k", {1: 0.039, 2: 0.045, 4: 0.058, 8: 0.090, 16: 0.150})


def llama_config(hidden: int = 256, intermediate: int = 512):
    """A config only (no weights): widths that are multiples of Q4_K's 256 unless given otherwise."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=32, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=1,
                       num_attention_heads=2)


# ------------------------------------------------------------------------------------------- the pure choice
def test_plain_decoding_picks_the_one_row_winner():
    choice = choose_quantization([INT8, Q4K], rows=1)
    assert choice.mode == "q4k"
    assert list(choice.pass_seconds) == ["q4k", "int8"]  # fastest first
    assert choice.pass_seconds["q4k"] == pytest.approx(0.039)


def test_speculation_picks_the_k_plus_one_row_winner():
    choice = choose_quantization([INT8, Q4K], rows=5)  # K = 4: between the timed 4 and 8 rows
    assert choice.mode == "int8"
    assert choice.pass_seconds["q4k"] == pytest.approx(0.058 + (0.090 - 0.058) / 4)
    assert choice.pass_seconds["int8"] == pytest.approx(0.0605)


def test_a_failed_candidate_is_dropped_with_its_reason():
    failed = ModeTiming("q4k", failure="self-test failed (KernelError: no usable kernel)")
    choice = choose_quantization([INT8, failed], rows=1)
    assert choice.mode == "int8" and list(choice.pass_seconds) == ["int8"]
    assert "KernelError" in choice.dropped["q4k"]
    assert "q4k left out: self-test failed (KernelError" in choice.describe()


def test_nothing_measured_falls_back_to_int8():
    choice = choose_quantization([ModeTiming("int8", failure="x"), ModeTiming("q4k", failure="y")], rows=3)
    assert choice.mode == "int8" and not choice.pass_seconds and set(choice.dropped) == {"int8", "q4k"}
    with pytest.raises(ValueError):
        choose_quantization([INT8], rows=0)


def test_interpolation_between_measured_rows_and_beyond_the_largest():
    seconds = {1: 1.0, 2: 2.0, 4: 3.0, 8: 5.0, 16: 9.0}
    assert interpolate_seconds(seconds, 4) == 3.0
    assert interpolate_seconds(seconds, 6) == pytest.approx(4.0)
    assert interpolate_seconds(seconds, 24) == pytest.approx(13.0)  # along the line through 8 and 16
    assert interpolate_seconds({8: 2.0}, 3) == 2.0  # a single timing: the nearest
    with pytest.raises(ValueError):
        interpolate_seconds(seconds, 0)


def test_rows_per_pass_of_the_speculative_configs():
    assert target_rows_per_pass(None) == 1
    assert target_rows_per_pass(SpeculativeConfig(method="ngram", num_speculative_tokens=4)) == 5
    assert target_rows_per_pass(SpeculativeConfig(method="draft_model", model="d", num_speculative_tokens=6,
                                                  k_policy="auto")) == 7  # the largest K auto may pick
    assert target_rows_per_pass(SpeculativeConfig(method="draft_model", model="d", num_speculative_tokens=4,
                                                  tree_width=2)) == 9
    assert target_rows_per_pass(SpeculativeConfig(method="draft_model", model="d", num_speculative_tokens=4,
                                                  tree_width=3, tree_budget=6)) == 7
    assert target_rows_per_pass(SpeculativeConfig(method="suffix", num_speculative_tokens=3,
                                                  suffix_decoding_tree_width=2)) == 7


# ------------------------------------------------------------------------------------------- the measurement
class _FakeTrial:
    name = "fake-kernel"

    def total_seconds(self, m, shapes):
        return m * 0.001 * len(shapes)


class _FakeChoice:
    shapes = ("a", "b")
    trial = _FakeTrial()
    load_average = (0.5, 0.5, 0.5)


def test_measure_mode_reads_the_self_tests_summed_pass_time(monkeypatch):
    import draftwise.backends.lean.linear as lean_linear

    monkeypatch.setattr(lean_linear, "select_lean_kernel", lambda mode, config: _FakeChoice())
    timing = measure_mode("int8", object())
    assert timing.failure is None and timing.seconds == {1: 0.002, 2: 0.004, 4: 0.008, 8: 0.016, 16: 0.032}


def test_timings_from_a_busy_machine_are_flagged_in_the_log_line():
    assert busy_load((0.9, 1.0, 1.0), 2) is None and busy_load(None, 2) is None
    assert busy_load((2.48, 1.7, 1.3), 2) == 2.48
    busy = ModeTiming("int8", dict(INT8.seconds), busy_load=2.48)
    text = choose_quantization([busy, Q4K], rows=1).describe()
    assert "; self-test started at load int8 2.48 on " in text and "may be inflated: delete their entries" in text
    assert "load" not in choose_quantization([INT8, Q4K], rows=1).describe()


def test_measure_mode_turns_a_self_test_failure_into_a_dropped_candidate(monkeypatch):
    import draftwise.backends.lean.linear as lean_linear
    from draftwise.backends.kernels import KernelError

    def fail(mode, config):
        raise KernelError("no usable kernel: q4k-cpp (896x896: cannot run)\nmore")

    monkeypatch.setattr(lean_linear, "select_lean_kernel", fail)
    timing = measure_mode("q4k", object())
    assert timing.seconds == {} and timing.failure == ("self-test failed (KernelError: no usable kernel: q4k-cpp "
                                                       "(896x896: cannot run))")


def test_the_lean_runtime_and_auto_share_one_self_test_call(monkeypatch):
    """select_lean_kernel is what both measure: the int8 kernels of one numerics, every q4k kernel, the lean
    model's fused shapes (so auto's measurement is the cache entry the lean build reads)."""
    import draftwise.backends.kernels as kernels
    from draftwise.backends.kernels import llama_linear_shapes
    from draftwise.backends.lean.linear import select_lean_kernel
    from draftwise.backends.lean.model import lean_config_from_hf

    calls = []
    monkeypatch.setattr(kernels, "select_linear_kernel", lambda mode, **kw: calls.append((mode, kw)))
    config = lean_config_from_hf(llama_config(hidden=16, intermediate=32))
    select_lean_kernel("int8", config)
    select_lean_kernel("q4k", config)
    assert [k.name for k in calls[0][1]["candidates"]] == ["fbgemm-int8", "onednn-int8"]
    assert [k.name for k in calls[1][1]["candidates"]] == ["q4k-cpp"]
    assert calls[0][1]["shapes"] == llama_linear_shapes(hidden=16, heads=2, kv_heads=2, intermediate=32, vocab=32,
                                                        layers=1, head_dim=8)


# ----------------------------------------------------------------------------------- resolve_quantization
@pytest.fixture
def cpu_with_int8(monkeypatch):
    """A CPU where int8 runs, with the q4k kernels available; measuring fails the test unless a test fakes it."""
    import draftwise.backends.kernels.q4k as q4k

    monkeypatch.setattr(loading, "int8_usable", lambda: True)
    monkeypatch.setattr(q4k, "q4k_available", lambda: None)

    def unexpected(mode, config):
        raise AssertionError(f"measured {mode} where nothing should be measured")

    monkeypatch.setattr(auto_quantization, "measure_mode", unexpected)


def _fake_measurement(monkeypatch, *timings):
    by_mode = {t.mode: t for t in timings}
    monkeypatch.setattr(auto_quantization, "measure_mode", lambda mode, config: by_mode[mode])


def test_auto_logs_the_measured_choice_for_plain_decoding(cpu_with_int8, monkeypatch, caplog):
    _fake_measurement(monkeypatch, INT8, Q4K)
    with caplog.at_level(logging.INFO, logger="draftwise.models.loading"):
        mode = resolve_quantization("auto", device="cpu", dtype=torch.float32, config=llama_config(),
                                    name="qwen2.5-coder-1.5b", source="/models/q.gguf")
    assert mode == "q4k"
    assert caplog.messages[-1] == ("qwen2.5-coder-1.5b: quantization auto -> q4k (measured for 1-row passes: q4k "
                                   "39.0 ms, int8 60.0 ms of linear layers; --quantization to force)")


def test_auto_for_a_speculative_target_sizes_for_k_plus_one_rows(cpu_with_int8, monkeypatch, caplog):
    _fake_measurement(monkeypatch, INT8, Q4K)
    with caplog.at_level(logging.INFO, logger="draftwise.models.loading"):
        mode = resolve_quantization("auto", device="cpu", dtype=torch.float32, config=llama_config(),
                                    source="/models/q.gguf", rows_per_pass=5)
    assert mode == "int8" and "auto -> int8 (measured for 5-row passes: int8 60.5 ms, q4k 66.0 ms" in caplog.text


def test_auto_drops_a_candidate_whose_measurement_failed(cpu_with_int8, monkeypatch, caplog):
    _fake_measurement(monkeypatch, INT8, ModeTiming("q4k", failure="self-test failed (KernelError: boom)"))
    with caplog.at_level(logging.INFO, logger="draftwise.models.loading"):
        mode = resolve_quantization("auto", device="cpu", dtype=torch.float32, config=llama_config(),
                                    source="/models/q.gguf")
    assert mode == "int8" and "q4k left out: self-test failed (KernelError: boom)" in caplog.text


def test_a_float_checkpoint_never_gets_q4k_and_measures_nothing(cpu_with_int8, caplog):
    with caplog.at_level(logging.INFO, logger="draftwise.models.loading"):
        for source in (None, "/models/qwen-dir", "/models/model.safetensors"):
            assert resolve_quantization("auto", device="cpu", dtype=torch.float32, config=llama_config(),
                                        source=source) == "int8"
    assert "q4k not a candidate: not a .gguf file" in caplog.text


def test_a_gguf_with_widths_q4k_cannot_serve_stays_on_int8(cpu_with_int8, caplog):
    with caplog.at_level(logging.INFO, logger="draftwise.models.loading"):
        assert resolve_quantization("auto", device="cpu", dtype=torch.float32, config=llama_config(hidden=896),
                                    source="/models/q.gguf") == "int8"
    assert "input widths 896 are not multiples of Q4_K's 256" in caplog.text


def test_a_gguf_without_the_q4k_kernels_stays_on_int8(cpu_with_int8, monkeypatch, caplog):
    import draftwise.backends.kernels.q4k as q4k

    monkeypatch.setattr(q4k, "q4k_available", lambda: "no C++ compiler")
    with caplog.at_level(logging.INFO, logger="draftwise.models.loading"):
        assert resolve_quantization("auto", device="cpu", dtype=torch.float32, config=llama_config(),
                                    source="/models/q.gguf") == "int8"
    assert "its kernels are not available here (no C++ compiler)" in caplog.text


def test_off_the_lean_runtime_auto_stays_none_even_for_a_gguf(cpu_with_int8):
    from transformers import GPT2Config

    config = llama_config()
    for device, dtype, cfg in (("cuda", torch.float32, config), ("cpu", torch.bfloat16, config),
                               ("cpu", torch.float32, GPT2Config())):
        assert resolve_quantization("auto", device=device, dtype=dtype, config=cfg, source="/m/q.gguf",
                                    rows_per_pass=5) == "none"


def test_without_int8_kernels_auto_is_none(cpu_with_int8, monkeypatch):
    monkeypatch.setattr(loading, "int8_usable", lambda: False)
    assert resolve_quantization("auto", device="cpu", dtype=torch.float32, config=llama_config(),
                                source="/m/q.gguf") == "none"


def test_explicit_modes_are_returned_as_given(cpu_with_int8):
    for mode in ("none", "int8", "q4k"):
        assert resolve_quantization(mode, device="cpu", dtype=torch.float32, config=llama_config(),
                                    source="/m/q.gguf", rows_per_pass=9) == mode


# ---------------------------------------------------------------------------------------------- threading
class _Loaded(Exception):
    pass


def test_build_engine_loads_the_target_for_its_verify_rows(monkeypatch):
    import draftwise.builder as builder

    seen = []

    def fake_load(spec, **kwargs):
        seen.append(kwargs["rows_per_pass"])
        raise _Loaded

    monkeypatch.setattr(builder, "load_model", fake_load)
    for config, rows in ((None, 1), (SpeculativeConfig(method="ngram", num_speculative_tokens=4), 5)):
        with pytest.raises(_Loaded):
            builder.build_engine("target", config, device="cpu", dtype=None, quantization="auto")
    assert seen == [1, 5]
