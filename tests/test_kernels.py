"""Linear kernels and their self-test: the row-invariance check, the choice, its cache, forcing, the machine
figures (bandwidth, CPU line) and the integration with quantize_model and ``draftwise costs``."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from conftest import tiny_llama
from draftwise.backends import kernels as K
from draftwise.backends.kernels import selftest
from draftwise.backends.kernels import (
    KERNEL_ENV,
    KernelError,
    LinearKernel,
    LinearShape,
    check_row_invariance,
    linear_kernels,
    select_linear_kernel,
)
from draftwise.backends.quantization import Int8Linear, int8_kernels_available, quantize_model

SHAPES = [(96, 64, 2), (160, 128, 1)]  # small (out, in, count): the whole self-test takes well under a second
needs_fbgemm = pytest.mark.skipif(not int8_kernels_available(), reason="torch build without fbgemm int8 kernels")


def kernel(name: str) -> LinearKernel:
    return next(k for k in K.LINEAR_KERNELS if k.name == name)


class NoisyLinear(nn.Module):
    """Deliberately not row-invariant: adds 1e-7 * m to every output of an m-row call."""

    def __init__(self, weight, bias=None):
        super().__init__()
        self.weight = weight.float()

    def forward(self, x):
        return x @ self.weight.T + 1e-7 * x.shape[0]


class RowLoopLinear(nn.Module):
    """Row-invariant by construction: each row is computed by the same one-row matmul."""

    def __init__(self, weight, bias=None):
        super().__init__()
        self.weight = weight.float()

    def forward(self, x):
        return torch.cat([row[None] @ self.weight.T for row in x])


class SlowRowLoopLinear(RowLoopLinear):
    """RowLoopLinear that the fake timer reports slower."""


NOISY = LinearKernel("fake-noisy", "int8", "fake: + 1e-7 m", NoisyLinear)
ROWLOOP = LinearKernel("fake-rowloop", "int8", "fake: one row at a time", RowLoopLinear)
SLOW_ROWLOOP = LinearKernel("fake-rowloop-slow", "int8", "fake: one row at a time", SlowRowLoopLinear)


@pytest.fixture(autouse=True)
def no_forced_kernel(monkeypatch):
    monkeypatch.delenv(KERNEL_ENV, raising=False)


@pytest.fixture
def fake_timer(monkeypatch):
    """Timings by module type instead of the clock: NoisyLinear 0.1 ms, RowLoopLinear 0.2 ms,
    SlowRowLoopLinear 0.5 ms, others 1 ms per call; counts calls."""
    calls = []

    def timed(module, x, repeats):
        calls.append(type(module).__name__)
        return {NoisyLinear: 1e-4, RowLoopLinear: 2e-4, SlowRowLoopLinear: 5e-4}.get(type(module), 1e-3)

    monkeypatch.setattr(selftest, "_call_seconds", timed)
    return calls


# ------------------------------------------------------------------------------------------ invariance check
def test_invariance_check_catches_a_non_invariant_kernel():
    torch.manual_seed(0)
    x = torch.randn(40, 64)
    result = check_row_invariance(NoisyLinear(torch.randn(32, 64)), x)
    assert result.invariant is False
    assert "2-row call" in result.detail and result.checked_rows == (1,)


def test_invariance_check_passes_a_row_loop_and_checks_every_row_count():
    torch.manual_seed(0)
    result = check_row_invariance(RowLoopLinear(torch.randn(32, 64)), torch.randn(40, 64))
    assert result.invariant is True
    assert result.checked_rows == (*range(1, 18), 32)  # 64, 128, 512 exceed the 40 test rows


def test_invariance_check_compares_later_rows_of_large_calls():
    """A kernel that is wrong only from row 20 of calls over 17 rows is caught by the sampled rows."""
    torch.manual_seed(0)
    inner = RowLoopLinear(torch.randn(16, 32))

    def late_error(x):
        y = inner(x)
        if x.shape[0] > 17:
            y[20:] += 1.0
        return y

    result = check_row_invariance(late_error, torch.randn(64, 32))
    assert result.invariant is False and "32-row call" in result.detail


@needs_fbgemm
def test_fbgemm_int8_passes_the_invariance_check():
    torch.manual_seed(1)
    module = kernel("fbgemm-int8").build(torch.randn(160, 128) / 12, torch.randn(160))
    assert isinstance(module, Int8Linear)
    x = torch.randn(128, 128) * 10 ** (torch.rand(128, 1) * 4 - 2)
    assert check_row_invariance(module, x).invariant is True


def test_fp32_mkl_pad_with_the_found_row_multiple_passes_the_check(tmp_path):
    """Whatever R the self-test finds on this machine, a layer built with it passes the same check again."""
    choice = select_linear_kernel("none", SHAPES, cache_dir=tmp_path, candidates=[kernel("fp32-mkl-pad")])
    trial = choice.trial
    if not trial.invariant:
        pytest.skip(f"no row multiple in {K.PAD_ROWS} makes MKL row-invariant on this CPU: {trial.detail}")
    torch.manual_seed(2)
    for out_f, in_f, _ in SHAPES:
        pad_rows = trial.params[f"{out_f}x{in_f}"]["pad_rows"]
        assert pad_rows in K.PAD_ROWS
        module = choice.build(torch.randn(out_f, in_f), torch.randn(out_f))
        assert isinstance(module, K.PaddedFloatLinear) and module.pad_rows == pad_rows
        assert check_row_invariance(module, torch.randn(140, in_f)).invariant is True


@needs_fbgemm
@pytest.mark.parametrize("shape", [(96, 64), (300, 160)])
def test_onednn_int8_gives_fbgemm_int8_bits(shape):
    if not kernel("onednn-int8").available():
        pytest.skip("no oneDNN int8 in this torch build")
    torch.manual_seed(3)
    weight, bias = torch.randn(*shape) / shape[1] ** 0.5, torch.randn(shape[0])
    x = torch.randn(9, shape[1]) * 10 ** (torch.rand(9, 1) * 2 - 1)
    assert torch.equal(kernel("onednn-int8").build(weight, bias)(x), Int8Linear(weight, bias)(x))


@pytest.mark.parametrize("group_size", K.INT4_GROUP_SIZES)
def test_int4_is_its_dequantized_weight_and_row_invariant(group_size):
    k = kernel(f"int4-g{group_size}")
    if not k.available():
        pytest.skip(f"int4 weight-only kernel unavailable: {k.unavailable_reason()}")
    torch.manual_seed(4)
    weight, x = torch.randn(64, 256) / 16, torch.randn(20, 256)
    module = k.build(weight, None)
    q, scales_zeros = K.quantize_int4_groups(weight, group_size)
    scale = scales_zeros[..., 0].float().t().repeat_interleave(group_size, 1)  # [out, in]
    zero = scales_zeros[..., 1].float().t().repeat_interleave(group_size, 1)
    dequantized = (q.float() - 8) * scale + zero
    assert (dequantized - weight).abs().max() <= scale.max() / 2 + 1e-3  # nearest of 16 levels per group
    y, ref = module(x), x.bfloat16().float() @ dequantized.T
    assert (y - ref).norm() / ref.norm() < 0.01  # bf16 activations and accumulation order only
    assert check_row_invariance(module, x).invariant is True
    assert module.weight_bytes < weight.numel()  # about half a byte per weight


def test_unsupported_shape_is_reported_not_raised(tmp_path):
    k = kernel("int4-g128")
    if not k.available():
        pytest.skip("int4 weight-only kernel unavailable")
    choice = select_linear_kernel("int4", [(64, 256), (64, 96)], cache_dir=tmp_path, candidates=[k, kernel("int4-g32")])
    g128 = next(t for t in choice.trials if t.name == "int4-g128")
    assert not g128.available and "96" in g128.detail and choice.name == "int4-g32"


# --------------------------------------------------------------------------------------------- selection
def test_selection_refuses_the_faster_non_invariant_kernel(tmp_path, fake_timer):
    choice = select_linear_kernel("int8", SHAPES, cache_dir=tmp_path, candidates=[NOISY, ROWLOOP])
    assert choice.name == "fake-rowloop"
    noisy = next(t for t in choice.trials if t.name == "fake-noisy")
    assert noisy.invariant is False and "differs" in noisy.detail
    assert "refused: fake-noisy" in choice.reason
    rows = {r["kernel"]: r for r in choice.table_rows()}
    assert rows["fake-rowloop"]["chosen"] and rows["fake-rowloop"]["ms"][1] == pytest.approx(3 * 0.2)  # 3 layers
    assert rows["fake-noisy"]["ms"][1] == pytest.approx(3 * 0.1)  # refused kernels are still timed


def test_slower_kernels_are_left_unchecked_unless_check_all(tmp_path, fake_timer, monkeypatch):
    checked = []
    real_check = K.check_row_invariance
    monkeypatch.setattr(selftest, "check_row_invariance", lambda module, x, rows: checked.append(type(module)) or
                        real_check(module, x, rows))
    candidates = [NOISY, ROWLOOP, SLOW_ROWLOOP]
    choice = select_linear_kernel("int8", SHAPES, cache_dir=tmp_path, candidates=candidates)
    slow = next(t for t in choice.trials if t.name == "fake-rowloop-slow")
    assert choice.name == "fake-rowloop" and slow.invariant is None and "not checked" in slow.detail
    assert SlowRowLoopLinear not in checked
    full = select_linear_kernel("int8", SHAPES, cache_dir=tmp_path, candidates=candidates, check_all=True)
    assert full.name == "fake-rowloop" and [t.invariant for t in full.trials] == [False, True, True]


def switchable(weight, bias=None, exact=False):
    """Variant ``exact=False`` is a NoisyLinear, ``exact=True`` a RowLoopLinear (like fp32-mkl-pad's R)."""
    return RowLoopLinear(weight) if exact else NoisyLinear(weight)


@pytest.mark.parametrize("other_ms, chosen", [(0.5, "fake-switch"), (0.15, "fake-other")])
def test_a_variant_found_by_the_check_is_timed_again(tmp_path, monkeypatch, other_ms, chosen):
    """The invariant variant costs 0.2 ms where the first variant cost 0.1 ms: a kernel at 0.15 ms then wins."""
    class Other(RowLoopLinear):
        pass

    def timed(module, x, repeats):
        return {NoisyLinear: 1e-4, RowLoopLinear: 2e-4, Other: other_ms * 1e-3}[type(module)]

    monkeypatch.setattr(selftest, "_call_seconds", timed)
    switch = LinearKernel("fake-switch", "int8", "fake", switchable, ({"exact": False}, {"exact": True}))
    other = LinearKernel("fake-other", "int8", "fake", Other)
    choice = select_linear_kernel("int8", SHAPES, cache_dir=tmp_path, candidates=[switch, other])
    assert choice.name == chosen
    trial = next(t for t in choice.trials if t.name == "fake-switch")
    assert trial.invariant is True and trial.params == {"96x64": {"exact": True}, "160x128": {"exact": True}}
    assert trial.total_seconds(1, choice.shapes) == pytest.approx(3 * 2e-4)  # timed again with the variant


def test_timing_stops_for_kernels_far_slower_than_an_invariant_one(tmp_path, monkeypatch):
    """Cut-off relative to the fastest row-invariant kernel: a fast non-invariant one sets no cut-off."""
    calls = []

    def timed(module, x, repeats):
        calls.append((type(module), x.shape[0]))
        return {NoisyLinear: 1e-5, RowLoopLinear: 1e-4, SlowRowLoopLinear: 1e-3}[type(module)]

    monkeypatch.setattr(selftest, "_call_seconds", timed)
    choice = select_linear_kernel("int8", SHAPES, cache_dir=tmp_path, candidates=[NOISY, ROWLOOP, SLOW_ROWLOOP])
    assert choice.name == "fake-rowloop"  # 10x the noisy kernel, not cut off by it
    slow = next(t for t in choice.trials if t.name == "fake-rowloop-slow")
    assert slow.cost(choice.shapes) is None and "timing stopped" in slow.detail and slow.invariant is None
    assert sum(1 for kind, _ in calls if kind is SlowRowLoopLinear) == 1  # 10x slower at m=1: stopped at once
    assert "fake-rowloop-slow (timing stopped)" in choice.reason
    assert next(r for r in choice.table_rows() if r["kernel"] == "fake-rowloop-slow")["ms"][1] is None


def test_draft_needs_no_invariance(tmp_path, fake_timer):
    choice = select_linear_kernel("int8", SHAPES, cache_dir=tmp_path, candidates=[NOISY, ROWLOOP],
                                  require_invariant=False)
    assert choice.name == "fake-noisy" and all(t.invariant is None for t in choice.trials)


def test_weighted_cost_prefers_decode_time(tmp_path, monkeypatch):
    """A kernel fast at m = 1 but slower at m = 16 beats one that is the reverse (decode weighs most)."""
    def timed(module, x, repeats):
        m = x.shape[0]
        if isinstance(module, NoisyLinear):
            return 1e-3 if m == 1 else 2e-3
        return 2e-3 if m == 1 else 1e-3

    monkeypatch.setattr(selftest, "_call_seconds", timed)
    choice = select_linear_kernel("int8", SHAPES, cache_dir=tmp_path, candidates=[NOISY, ROWLOOP],
                                  require_invariant=False)
    assert choice.name == "fake-noisy"


def test_cache_hit_does_not_measure(tmp_path, fake_timer, monkeypatch):
    first = select_linear_kernel("int8", SHAPES, cache_dir=tmp_path, candidates=[NOISY, ROWLOOP])
    assert fake_timer and not first.cached
    assert len(list(tmp_path.glob("kernels-int8-*.json"))) == 1

    def fail(*args, **kwargs):
        raise AssertionError("measured on a cache hit")

    monkeypatch.setattr(selftest, "_call_seconds", fail)
    monkeypatch.setattr(selftest, "check_row_invariance", fail)
    monkeypatch.setattr(selftest, "_synthetic_layer", fail)
    second = select_linear_kernel("int8", SHAPES, cache_dir=tmp_path, candidates=[NOISY, ROWLOOP])
    assert second.cached and second.name == first.name
    assert second.trials == first.trials and second.reason == first.reason
    # another key (thread count, shapes) measures again
    with pytest.raises(AssertionError, match="cache hit"):
        select_linear_kernel("int8", [(96, 64)], cache_dir=tmp_path, candidates=[NOISY, ROWLOOP])


def test_corrupt_cache_is_measured_again(tmp_path, fake_timer):
    select_linear_kernel("int8", SHAPES, cache_dir=tmp_path, candidates=[NOISY, ROWLOOP])
    path = next(tmp_path.glob("kernels-int8-*.json"))
    path.write_text("{not json")
    calls = len(fake_timer)
    choice = select_linear_kernel("int8", SHAPES, cache_dir=tmp_path, candidates=[NOISY, ROWLOOP])
    assert not choice.cached and len(fake_timer) > calls
    assert json.loads(path.read_text())["choice"]["name"] == "fake-rowloop"


def test_forced_kernel_by_environment(tmp_path, fake_timer, monkeypatch):
    candidates = [NOISY, ROWLOOP, SLOW_ROWLOOP]
    assert select_linear_kernel("int8", SHAPES, cache_dir=tmp_path, candidates=candidates).name == "fake-rowloop"
    monkeypatch.setenv(KERNEL_ENV, "fake-rowloop-slow, fp32-mkl-pad")  # one name per mode; the int8 one applies
    choice = select_linear_kernel("int8", SHAPES, cache_dir=tmp_path, candidates=candidates)
    assert choice.name == "fake-rowloop-slow" and [t.name for t in choice.trials] == ["fake-rowloop-slow"]
    assert "forced" in choice.reason and choice.trial.invariant is True
    monkeypatch.setenv(KERNEL_ENV, "no-such-kernel")
    with pytest.raises(KernelError, match="unknown kernel 'no-such-kernel'"):
        select_linear_kernel("int8", SHAPES, cache_dir=tmp_path, candidates=[ROWLOOP])


def test_forced_non_invariant_kernel_is_refused_unless_a_draft(tmp_path, fake_timer, monkeypatch):
    with pytest.raises(KernelError, match="not row-invariant"):
        select_linear_kernel("int8", SHAPES, cache_dir=tmp_path, candidates=[NOISY, ROWLOOP], kernel="fake-noisy")
    monkeypatch.setenv(KERNEL_ENV, "fake-noisy")
    with pytest.raises(KernelError, match="not row-invariant"):  # refused again, now from the cache
        select_linear_kernel("int8", SHAPES, cache_dir=tmp_path, candidates=[NOISY, ROWLOOP])
    draft = select_linear_kernel("int8", SHAPES, cache_dir=tmp_path, candidates=[NOISY, ROWLOOP],
                                 require_invariant=False)
    assert draft.name == "fake-noisy"


def test_forced_kernel_of_another_mode_or_bad_mode(tmp_path):
    with pytest.raises(KernelError, match="serves mode 'int8'"):
        select_linear_kernel("none", SHAPES, cache_dir=tmp_path, kernel="fbgemm-int8")
    with pytest.raises(KernelError, match="unknown quantization mode"):
        select_linear_kernel("int3", SHAPES, cache_dir=tmp_path)
    with pytest.raises(ValueError, match="no linear shapes"):
        select_linear_kernel("none", [], cache_dir=tmp_path)


def test_untested_shape_is_refused_where_invariance_is_required(tmp_path, fake_timer):
    choice = select_linear_kernel("int8", SHAPES, cache_dir=tmp_path, candidates=[ROWLOOP])
    assert choice.build(torch.randn(96, 64)).weight.shape == (96, 64)
    with pytest.raises(KernelError, match="was not in the self-test"):
        choice.build(torch.randn(32, 64))


@needs_fbgemm
def test_real_int8_selection_picks_an_invariant_kernel(tmp_path):
    choice = select_linear_kernel("int8", SHAPES, cache_dir=tmp_path, threads=1)
    assert choice.trial.invariant is True and choice.mode == "int8" and choice.threads == 1
    assert {t.name for t in choice.trials} == {k.name for k in linear_kernels("int8")}
    assert choice.selftest_seconds < 10 and choice.cpu == K.cpu_description()
    assert all(s > 0 for t in choice.trials if t.available for v in t.seconds.values() for s in v.values())


# ------------------------------------------------------------------------------------------ shapes, bytes
def test_llama_linear_shapes_of_qwen_1_5b():
    shapes = K.llama_linear_shapes(hidden=1536, heads=12, kv_heads=2, intermediate=8960, vocab=151936, layers=28,
                                   head_dim=128)
    assert [(s.name, s.out_features, s.in_features, s.count) for s in shapes] == [
        ("qkv", 2048, 1536, 28), ("o", 1536, 1536, 28), ("gate_up", 17920, 1536, 28), ("down", 1536, 8960, 28),
        ("lm_head", 151936, 1536, 1)]
    assert K.as_shapes([(4, 2), LinearShape(4, 2, 3)]) == (LinearShape(4, 2, 4),)


@needs_fbgemm
def test_model_shapes_and_weight_bytes():
    model = nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 64, bias=False), nn.Linear(64, 32))
    assert set(K.model_linear_shapes(model)) == {LinearShape(32, 64, 2), LinearShape(64, 32, 1)}
    assert K.linear_weight_bytes(model) == 4 * (3 * 64 * 32 + 2 * 32)
    model[1] = Int8Linear(model[1].weight)
    model[2] = K.PaddedFloatLinear(model[2].weight, model[2].bias, pad_rows=4)
    assert K.linear_weight_bytes(model) == 4 * (64 * 32 + 32) + (64 * 32 + 8 * 64) + 4 * (64 * 32 + 32)


# ----------------------------------------------------------------------------------------------- machine
def test_dram_bandwidth_is_plausible():
    assert 1e8 < K.measure_dram_bandwidth(64 << 20, repeats=2, threads=1) < 1e13
    with pytest.raises(ValueError):
        K.measure_dram_bandwidth(1024)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_memory_bandwidth_is_measured_on_the_gpu():
    # An H200 reads ~4 TB/s, far above any host's DRAM: a figure under 200 GB/s means the host was measured
    # (costs once printed the host's 95 GB/s as the bound of a model on an H200).
    assert 2e11 < K.measure_dram_bandwidth(256 << 20, repeats=3, device="cuda") < 1e14


def test_cpu_description_lists_what_the_cpu_has_and_lacks(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: Test CPU 9000\nflags\t\t: fpu sse avx2 fma avx512f amx_tile\n\n"
                       "processor\t: 1\nmodel name\t: Test CPU 9000\nflags\t\t: fpu\n")
    line = K.cpu_description(cpuinfo)
    assert line.startswith("Test CPU 9000")
    has, lacks = line.split("; has ")[1].split("; lacks ")
    assert has.split() == ["avx2", "fma", "avx512f", "amx_tile"] and "avx512_vnni" in lacks.split()
    assert K.cpu_flags(cpuinfo) == {"fpu", "sse", "avx2", "fma", "avx512f", "amx_tile"}
    assert "flags unknown" in K.cpu_description(tmp_path / "missing")


# ------------------------------------------------------------------------------------------- integration
@needs_fbgemm
def test_quantize_model_with_onednn_kernel_gives_the_fbgemm_logits(tmp_path):
    if not kernel("onednn-int8").available():
        pytest.skip("no oneDNN int8 in this torch build")
    reference, model = tiny_llama(seed=5), tiny_llama(seed=5)
    choice = select_linear_kernel("int8", K.model_linear_shapes(model.model), cache_dir=tmp_path,
                                  kernel="onednn-int8")
    quantize_model(reference.model, "int8")
    quantize_model(model.model, "int8", kernel=choice)
    assert any(isinstance(m, K.OneDnnInt8Linear) for m in model.model.modules())
    ids = [3, 14, 15, 92, 65, 35]
    assert torch.equal(model.forward(ids).logits, reference.forward(ids).logits)
    with pytest.raises(ValueError, match="serves mode 'int8'"):
        quantize_model(tiny_llama(seed=5).model, "none", kernel=choice)


def test_fp32_model_with_the_chosen_kernel_is_bit_exact_batch_invariant(tmp_path):
    """The transformers fp32 path with the self-test's fp32 kernel: k-token passes equal one-token decoding,
    bit for bit, k = 1..16 (plain MKL is not: docs/cpu_int8.md)."""
    from test_batch_invariance import MAX_K, _k_token_logits, _one_token_logits, _sequence

    backend = tiny_llama(seed=11)
    choice = select_linear_kernel("none", K.model_linear_shapes(backend.model), cache_dir=tmp_path)
    quantize_model(backend.model, "none", kernel=choice)
    tokens = _sequence(backend.vocab_size)
    reference = _one_token_logits(backend, tokens)
    for k in range(1, MAX_K + 1):
        assert torch.equal(_k_token_logits(backend, tokens, k), reference[:k]), f"k={k} ({choice.name})"


def test_costs_prints_machine_figures_and_kernel_table(stories, stories_path, capsys):
    from draftwise.cli import main

    code = main(["costs", str(stories_path), "--ks", "1,2", "--repeats", "1", "--context", "8", "--json",
                 "--kernels", "none", "--bandwidth-mib", "16"])
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    machine = result["machine"]
    assert machine["memory_read_bytes_per_s"] > 1e8 and machine["cpu"] == K.cpu_description()
    assert machine["memory_device"] == "cpu" and machine["linear_weight_bytes"] > 0
    bound = machine["linear_weight_bytes"] / machine["memory_read_bytes_per_s"]
    assert machine["weight_bound_s"] == pytest.approx(bound)
    kernels = result["kernels"]["none"]
    assert kernels["mode"] == "none" and {t["name"] for t in kernels["trials"]} >= {"fp32-mkl-pad"}
    assert main(["costs", str(stories_path), "--kernels", "int3"]) == 2
