"""The q4k mode: GGUF Q4_K weights on draftwise's row-invariant C++ kernel (draftwise.backends.kernels.q4k).

The kernel is compiled once per test session (into the session's DRAFTWISE_HOME); every test here is skipped
where it cannot be built (no C++ compiler).
"""

from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest
import torch

from draftwise.backends.kernels import q4k
from draftwise.machine import cpu_flags
from draftwise.backends.kernels.gguf_source import GGUFSource, q4k_linear_factory
from draftwise.backends.kernels.q4k import (
    GGUF_BLOCK_BYTES,
    Q4KError,
    Q4KLinear,
    dequantize_q4k,
    load_q4k_ops,
    pack_gguf_q4k,
    q4k_available,
    q4k_linear,
    quantize_q4k,
)

pytestmark = pytest.mark.skipif(q4k_available() is not None, reason=f"Q4_K kernel unavailable: {q4k_available()}")


def q8_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The kernel's arithmetic in float64: activations rounded to int8 per 256 (scale amax / 127), times the
    dequantized weight."""
    m, k = x.shape
    blocks = x.reshape(m, k // 256, 256)
    amax = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    q = torch.clamp(torch.round(blocks * inv), -127, 127)
    return (q.double() * (amax.double() / 127.0)).reshape(m, k) @ weight.double().T


@pytest.mark.parametrize("shape", [(64, 256), (40, 1536), (33, 768)])
def test_kernel_computes_the_int8_activation_arithmetic(shape):
    out, k = shape
    generator = torch.Generator().manual_seed(out)
    weight = torch.randn(out, k, generator=generator) * 0.05
    packed = quantize_q4k(weight)
    x = torch.randn(7, k, generator=generator)
    bias = torch.randn(out, generator=generator)
    y = q4k_linear(x, packed, bias)
    reference = q8_reference(x, dequantize_q4k(packed)) + bias.double()
    assert y.shape == (7, out) and y.dtype == torch.float32
    assert torch.allclose(y.double(), reference, rtol=1e-5, atol=1e-4 * reference.abs().max().item())
    # and close to the float product: 4-bit weights and 8-bit activations, a few percent
    exact = x.double() @ weight.double().T + bias.double()
    assert (y.double() - exact).norm() / exact.norm() < 0.15


def test_quantize_then_dequantize_is_close():
    weight = torch.randn(16, 512, generator=torch.Generator().manual_seed(1))
    error = (dequantize_q4k(quantize_q4k(weight)) - weight).abs().mean() / weight.abs().mean()
    assert error < 0.12


@pytest.mark.parametrize("in_features", [256, 1536])
def test_rows_do_not_depend_on_the_other_rows_of_the_call(in_features):
    generator = torch.Generator().manual_seed(3)
    packed = quantize_q4k(torch.randn(131, in_features, generator=generator) * 0.1)  # odd: a lone last row
    x = torch.randn(70, in_features, generator=generator) * 3
    alone = torch.cat([q4k_linear(x[i:i + 1], packed) for i in range(70)])
    for m in (*range(1, 18), 32, 33, 64, 70):
        assert torch.equal(q4k_linear(x[:m], packed), alone[:m]), m
    shifted = q4k_linear(x[5:25], packed)  # the same rows at other positions of the call
    assert torch.equal(shifted, alone[5:25])
    assert torch.equal(q4k_linear(x[:9], packed), q4k_linear(x[:9].clone(), packed))  # deterministic


def test_a_weight_row_gives_the_same_bits_in_a_full_group_and_in_the_last_one():
    """The packed layout interleaves 8 weight rows per group; a last group of fewer rows runs the scalar path.
    A row's output must not depend on which of the two computes it."""
    generator = torch.Generator().manual_seed(5)
    weight = torch.randn(16, 512, generator=generator) * 0.05
    x = torch.randn(9, 512, generator=generator)
    whole = q4k_linear(x, quantize_q4k(weight))      # rows 8..12 in the second full group (vector path)
    tail = q4k_linear(x, quantize_q4k(weight[3:13]))  # rows 11, 12 in a last group of 2 (scalar path)
    lone = q4k_linear(x, quantize_q4k(weight[8:13]))  # rows 8..12 as a last group of 5
    assert torch.equal(whole[:, 3:13], tail) and torch.equal(whole[:, 8:13], lone)


def test_packing_round_trips_every_group_shape():
    generator = torch.Generator().manual_seed(6)
    for out in (1, 7, 8, 9, 21):
        packed = quantize_q4k(torch.randn(out, 512, generator=generator))
        assert torch.equal(q4k._pack(*q4k._unpack(packed)), packed), out


def test_zero_rows_and_bad_shapes():
    packed = quantize_q4k(torch.randn(8, 256))
    assert torch.equal(q4k_linear(torch.zeros(2, 256), packed), torch.zeros(2, 8))
    with pytest.raises(RuntimeError, match="multiple of 256|packed rows"):
        q4k_linear(torch.randn(2, 128), packed)
    with pytest.raises(Q4KError, match="divisible by 256"):
        quantize_q4k(torch.randn(8, 300))
    with pytest.raises(Q4KError, match="uint8"):
        Q4KLinear(torch.zeros(8, 100, dtype=torch.uint8))


def random_gguf_q4k(rows: int, in_features: int, seed: int = 0) -> np.ndarray:
    """Random but valid GGUF Q4_K rows ``[rows, in / 256 * 144]``: fp16 d and dmin, random scale bytes and
    nibbles."""
    rng = np.random.default_rng(seed)
    nb = in_features // 256
    raw = rng.integers(0, 256, size=(rows, nb, GGUF_BLOCK_BYTES), dtype=np.uint8)
    raw[..., 0:2] = np.float16(0.002 * rng.random((rows, nb)) + 1e-4).reshape(rows, nb, 1).view(np.uint8)
    raw[..., 2:4] = np.float16(0.001 * rng.random((rows, nb))).reshape(rows, nb, 1).view(np.uint8)
    return raw.reshape(rows, nb * GGUF_BLOCK_BYTES)


def test_gguf_blocks_repack_to_the_same_weights_as_gguf_dequantizes():
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    raw = random_gguf_q4k(12, 512)
    expected = dequantize(raw, GGMLQuantizationType.Q4_K).astype(np.float32)
    assert torch.equal(dequantize_q4k(pack_gguf_q4k(raw)), torch.from_numpy(expected))


def test_source_finds_fused_and_reordered_rows_of_a_gguf_file(tmp_path):
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import dequantize

    raw_a, raw_b = random_gguf_q4k(6, 512, seed=1), random_gguf_q4k(4, 512, seed=2)
    path = tmp_path / "tiny.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_tensor("a.weight", raw_a, raw_shape=raw_a.shape, raw_dtype=GGMLQuantizationType.Q4_K)
    writer.add_tensor("b.weight", raw_b, raw_shape=raw_b.shape, raw_dtype=GGMLQuantizationType.Q4_K)
    writer.add_tensor("f.weight", np.ones((2, 512), dtype=np.float32))
    for step in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file):
        step()
    writer.close()

    source = GGUFSource(path)
    assert len(source) == 10
    floats_a = torch.from_numpy(dequantize(raw_a, GGMLQuantizationType.Q4_K).astype(np.float32))
    floats_b = torch.from_numpy(dequantize(raw_b, GGMLQuantizationType.Q4_K).astype(np.float32))
    fused = torch.cat([floats_a[[3, 0, 5]], floats_b])  # a permuted slice of one tensor fused with another
    ((kind, raw),) = source.blocks_for(fused)
    assert kind == "Q4_K" and torch.equal(dequantize_q4k(pack_gguf_q4k(raw)), fused)
    changed = fused.clone()
    changed[2, 7] += 1e-3
    assert source.blocks_for(changed) is None  # one row not in the file: not a Q4_K weight of it
    assert source.blocks_for(torch.ones(2, 512)) is None  # a float tensor of the file

    build = q4k_linear_factory(source)
    assert isinstance(build(fused, None), Q4KLinear)
    assert not isinstance(build(torch.ones(2, 512), None), Q4KLinear)  # stays int8: no second rounding


def q4k_qwen2(seed: int = 0):
    """A tiny random Qwen2 whose widths are multiples of 256 (q/k/v biases, tied embeddings)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=128, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2, tie_word_embeddings=True,
        use_sliding_window=False, attn_implementation="eager", bos_token_id=0, eos_token_id=1, pad_token_id=0,
    )
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.3)
    return model


@pytest.fixture(scope="module")
def q4k_lean():
    from draftwise.backends.lean import build_lean

    return build_lean(q4k_qwen2(), quantization="q4k", name="tiny-q4k")


def test_lean_q4k_model_uses_the_kernel_and_is_exact(q4k_lean):
    kinds = {type(m).__name__ for m in q4k_lean.model.modules()}
    assert "Q4KLinear" in kinds  # every projection (width 256 / 512) and the head
    ids = torch.randint(2, 128, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    q4k_lean.reset()
    one = [q4k_lean.forward([token], num_logits=1).logits[-1] for token in ids]
    q4k_lean.reset()
    q4k_lean.forward(ids[:20])
    chunk = q4k_lean.forward(ids[20:29], num_logits=9).logits
    assert torch.equal(chunk, torch.stack(one[20:29]))


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_greedy_speculation_equals_plain_in_q4k(q4k_lean, method, k):
    from draftwise.backends.lean import build_lean
    from draftwise.config import SamplingParams
    from draftwise.engine import SpeculativeEngine
    from draftwise.proposers.draft_model import DraftModelProposer
    from draftwise.proposers.ngram import NgramProposer

    prompt = [5, 9, 17, 5, 9, 17, 5, 9, 33, 40, 5, 9]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    plain = SpeculativeEngine(q4k_lean, None, k).generate(prompt, params).token_ids
    if method == "ngram":
        proposer = NgramProposer(1, 3)
    else:  # a different q4k model as the draft: it guesses often wrong, which exercises rollback
        proposer = DraftModelProposer(build_lean(q4k_qwen2(seed=1), quantization="q4k", name="draft"), 128)
    result = SpeculativeEngine(q4k_lean, proposer, k).generate(prompt, params)
    assert result.token_ids == plain
    assert result.stats.num_draft_tokens > 0


def test_quantize_model_q4k_makes_transformers_row_invariant():
    from draftwise.backends.quantization import quantize_model

    from draftwise.backends.kernels.gguf_source import Q4KKernel

    model = quantize_model(q4k_qwen2(), "q4k", kernel=Q4KKernel())
    assert any(isinstance(m, Q4KLinear) for m in model.modules())
    ids = torch.randint(2, 128, (1, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(ids).logits[0]
        prefix = model(ids[:, :8], use_cache=True)
        rest = model(ids[:, 8:], past_key_values=prefix.past_key_values).logits[0]
    assert torch.equal(full[8:], rest)


def test_a_failing_build_is_a_clear_error(monkeypatch):
    from torch.utils import cpp_extension

    def broken(**kwargs):
        raise RuntimeError("Error building extension\nq4k.cpp:1:1: error: no compiler here\nninja: stopped")

    monkeypatch.setattr(cpp_extension, "load", broken)
    monkeypatch.setattr(q4k, "build_key", lambda: "broken-build")
    q4k.load_q4k_ops.cache_clear()
    try:
        assert "error: no compiler here" in (q4k.q4k_available() or "")
    finally:
        q4k.load_q4k_ops.cache_clear()


def test_the_self_test_measures_and_checks_the_q4k_kernel(tmp_path):
    from draftwise.backends.kernels import linear_kernels, select_linear_kernel

    (kernel,) = linear_kernels("q4k")
    assert kernel.name == "q4k-cpp" and kernel.available()
    assert kernel.stored_bytes(8, 512) == 8 * 2 * 152  # 152 bytes per 256 weights
    choice = select_linear_kernel("q4k", [(96, 256, 2), (64, 512)], cache_dir=tmp_path, repeats=1)
    assert choice.name == "q4k-cpp"
    layer = choice.build(torch.randn(64, 512), None)
    assert isinstance(layer, Q4KLinear)


@pytest.mark.skipif(shutil.which("objdump") is None, reason="objdump (binutils) is not installed")
@pytest.mark.skipif("avx2" not in cpu_flags(), reason="the portable build issues no prefetches")
def test_every_format_kernel_keeps_its_weight_prefetch():
    """Each format's linear issues software prefetches of the weight rows ahead. GCC once deleted the Q4_K ones
    (an out-of-line function whose only effect is a prefetch counts as const), which halved its DRAM rate."""
    library = load_q4k_ops()
    listing = subprocess.run(["objdump", "-d", "--no-show-raw-insn", "-C", library], capture_output=True, text=True,
                             check=True).stdout
    prefetching, function = set(), ""
    for line in listing.splitlines():
        if line.endswith(">:"):
            function = line
        elif "prefetch" in line:
            prefetching.add(function)
    for fmt in ("Q4K", "Q6K", "Q8_0Decode", "Q5_0Decode"):
        assert any("linear<(anonymous namespace)::" in f and fmt in f for f in prefetching), fmt


def test_the_kernel_self_test_measures_again_after_the_extension_changes(monkeypatch):
    """The self-test's cache key holds the extension's build key for its kernels' modes, so a changed kernel
    source is timed and checked again; other modes' keys do not depend on it."""
    from draftwise.backends.kernels import linear_kernels
    from draftwise.backends.kernels.selftest import _cache_key

    def key(mode):
        return _cache_key(mode, [], linear_kernels(mode), True, 2, False)

    before = {mode: key(mode) for mode in ("q4k", "int8")}
    monkeypatch.setattr(q4k, "build_key", lambda: "another-source")
    assert key("q4k") != before["q4k"]
    assert key("int8") == before["int8"]
