"""GGUF's Q6_K, Q8_0 and Q5_0 blocks on draftwise's row-invariant C++ kernels, and a GGUF file's rows of every
served type found by value (draftwise.backends.kernels.gguf_blocks, .gguf_source).

Tiny random blocks built here; no model file is needed except by the test marked slow. The kernels are compiled
once per test session (into the session's DRAFTWISE_HOME); every test is skipped where they cannot be built.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from draftwise.backends.kernels.gguf_blocks import (
    BLOCK_FORMATS,
    GGUFBlockLinear,
    SegmentedLinear,
    dequantize_blocks,
    quantize_blocks,
    quantize_q6k,
)
from draftwise.backends.kernels.gguf_source import GGUFSource, q4k_linear_factory
from draftwise.backends.kernels.layers import KernelError
from draftwise.backends.kernels.q4k import Q4KLinear, q4k_available

from conftest import long_test, pulled_model_path
from test_q4k import random_gguf_q4k

pytestmark = pytest.mark.skipif(q4k_available() is not None, reason=f"GGUF kernels unavailable: {q4k_available()}")

FORMATS = list(BLOCK_FORMATS.values())
_SCALE_OFFSET = {"Q6_K": 208, "Q8_0": 0, "Q5_0": 0}  # where a block's fp16 d lies


def random_blocks(ggml_type: str, rows: int, in_features: int, seed: int = 0) -> np.ndarray:
    """Random but valid GGUF rows ``[rows, in / block * block_bytes]``: random quant and scale bytes (Q8_0's
    -128 included), a small positive fp16 ``d`` per block."""
    fmt = BLOCK_FORMATS[ggml_type]
    rng = np.random.default_rng(seed)
    nb = in_features // fmt.block_weights
    raw = rng.integers(0, 256, size=(rows, nb, fmt.block_bytes), dtype=np.uint8)
    at = _SCALE_OFFSET[ggml_type]
    raw[..., at:at + 2] = np.float16(0.01 * rng.random((rows, nb)) + 1e-4).reshape(rows, nb, 1).view(np.uint8)
    return raw.reshape(rows, nb * fmt.block_bytes)


def int8_reference(x: torch.Tensor, weight: torch.Tensor, block: int) -> torch.Tensor:
    """The kernels' arithmetic in float64: activations rounded to int8 per ``block`` inputs (scale amax / 127,
    the fp32 multiply of the kernel), times the dequantized weight."""
    m, k = x.shape
    blocks = x.reshape(m, k // block, block)
    amax = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    q = torch.clamp(torch.round(blocks * inv), -127, 127)
    return (q.double() * (amax / 127.0).double()).reshape(m, k) @ weight.double().T


def ggml_dequantize_q6k(raw: np.ndarray) -> np.ndarray:
    """ggml's ``dequantize_row_q6_K`` written out loop by loop (the layout the kernel decodes)."""
    blocks = raw.reshape(-1, 210)
    out = np.empty((blocks.shape[0], 256), dtype=np.float32)
    for i, blk in enumerate(blocks):
        d = blk[208:210].view(np.float16)[0].astype(np.float32)
        sc = blk[192:208].view(np.int8).astype(np.float32)
        for h in range(2):
            ql, qh, s = blk[64 * h:64 * h + 64].astype(int), blk[128 + 32 * h:160 + 32 * h].astype(int), sc[8 * h:]
            for l in range(32):
                i_s = l // 16
                q1 = ((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32
                q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32
                q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32
                q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32
                for j, q in enumerate((q1, q2, q3, q4)):
                    out[i, 128 * h + 32 * j + l] = d * s[i_s + 2 * j] * np.float32(q)
    return out.reshape(raw.shape[0], -1)


def test_gguf_dequantizes_q6k_as_ggml_writes_it():
    raw = random_blocks("Q6_K", 3, 512, seed=4)
    assert np.array_equal(dequantize_blocks(raw, BLOCK_FORMATS["Q6_K"]).numpy(), ggml_dequantize_q6k(raw))


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.ggml_type)
def test_quantize_then_dequantize_is_close(fmt):
    weight = torch.randn(16, 512, generator=torch.Generator().manual_seed(1))
    packed = quantize_blocks(weight, fmt)
    assert packed.shape == (16, 512 // fmt.block_weights * fmt.block_bytes) and packed.dtype == torch.uint8
    error = (dequantize_blocks(packed, fmt) - weight).abs().mean() / weight.abs().mean()
    assert error < {"Q6_K": 0.03, "Q8_0": 0.01, "Q5_0": 0.05}[fmt.ggml_type]


def test_q6k_quantizer_keeps_zero_rows_and_the_largest_weight():
    weight = np.zeros((2, 256), dtype=np.float32)
    weight[1, 17] = -3.0
    back = dequantize_blocks(quantize_q6k(weight), BLOCK_FORMATS["Q6_K"]).numpy()
    assert np.array_equal(back[0], weight[0]) and abs(back[1, 17] + 3.0) < 0.02 and np.abs(back[1, :17]).max() == 0


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.ggml_type)
@pytest.mark.parametrize("shape", [(37, 512), (16, 1536), (9, 896)])
def test_kernel_computes_x_times_the_dequantized_weight(fmt, shape):
    out, k = shape
    if k % fmt.block_weights:
        pytest.skip(f"{fmt.ggml_type} needs widths divisible by {fmt.block_weights}")
    raw = random_blocks(fmt.ggml_type, out, k, seed=out)
    weight = dequantize_blocks(raw, fmt)
    generator = torch.Generator().manual_seed(k)
    x = torch.randn(7, k, generator=generator) * 2
    bias = torch.randn(out, generator=generator)
    layer = GGUFBlockLinear(fmt, torch.from_numpy(raw), bias)
    y = layer(x)
    assert y.shape == (7, out) and y.dtype == torch.float32
    # exact integer block sums: only the fp32 accumulation differs from the float64 reference
    reference = int8_reference(x, weight, fmt.block_weights) + bias.double()
    assert torch.allclose(y.double(), reference, rtol=1e-5, atol=1e-5 * reference.abs().max().item())
    # and close to the float product (8-bit activations)
    exact = x.double() @ weight.double().T + bias.double()
    assert (y.double() - exact).norm() / exact.norm() < 0.02


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.ggml_type)
def test_rows_do_not_depend_on_the_other_rows_of_the_call(fmt):
    raw = torch.from_numpy(random_blocks(fmt.ggml_type, 131, 512, seed=3))  # odd: a lone last weight row
    layer = GGUFBlockLinear(fmt, raw, torch.randn(131))
    x = torch.randn(40, 512, generator=torch.Generator().manual_seed(3)) * 3
    alone = torch.cat([layer(x[i:i + 1]) for i in range(40)])
    for m in (*range(1, 17), 33, 40):
        assert torch.equal(layer(x[:m]), alone[:m]), m
    assert torch.equal(layer(x[5:25]), alone[5:25])  # the same rows at other positions of the call


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.ggml_type)
def test_regrouping_round_trips_and_a_row_gives_the_same_bits_in_any_group(fmt):
    """The rows are regrouped 8 at a time for the kernel; a last group of fewer rows runs the scalar path."""
    from draftwise.backends.kernels.gguf_blocks import file_rows, regroup

    for out in (1, 5, 8, 13):
        raw = random_blocks(fmt.ggml_type, out, 512, seed=out)
        assert np.array_equal(file_rows(fmt, regroup(fmt, raw)), raw), out
    raw = torch.from_numpy(random_blocks(fmt.ggml_type, 16, 512, seed=7))
    x = torch.randn(9, 512, generator=torch.Generator().manual_seed(7))
    whole = GGUFBlockLinear(fmt, raw)(x)            # rows 8..15: a full group (vector path)
    tail = GGUFBlockLinear(fmt, raw[3:13])(x)       # rows 11, 12: a last group of 2 (scalar path)
    assert torch.equal(whole[:, 3:13], tail)
    assert torch.equal(GGUFBlockLinear(fmt, raw).gguf_rows(), raw)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.ggml_type)
def test_zero_rows_and_bad_shapes(fmt):
    layer = GGUFBlockLinear.from_float(fmt, torch.randn(8, 256))
    assert torch.equal(layer(torch.zeros(2, 256)), torch.zeros(2, 8))
    with pytest.raises(RuntimeError, match="multiple of|packed rows"):
        getattr(torch.ops.draftwise_q4k, fmt.op)(torch.randn(2, 224), layer.packed, torch.empty(0))
    with pytest.raises(KernelError, match="divisible by"):
        quantize_blocks(torch.randn(8, 48 if fmt.block_weights == 32 else 288), fmt)
    with pytest.raises(KernelError, match="uint8"):
        GGUFBlockLinear(fmt, torch.zeros(8, fmt.block_bytes + 1, dtype=torch.uint8))


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.ggml_type)
def test_the_self_test_measures_and_checks_each_kernel(fmt, tmp_path):
    from draftwise.backends.kernels import linear_kernels, select_linear_kernel

    (kernel,) = linear_kernels(fmt.mode)
    assert kernel.name == fmt.kernel_name and kernel.available()
    assert kernel.stored_bytes(8, 512) == 8 * 512 // fmt.block_weights * fmt.block_bytes
    choice = select_linear_kernel(fmt.mode, [(96, 256, 2), (64, 512)], cache_dir=tmp_path, repeats=1)
    assert choice.name == fmt.kernel_name and choice.trial.invariant is True
    layer = choice.build(torch.randn(64, 512), None)
    assert isinstance(layer, GGUFBlockLinear) and layer.format == fmt


def write_gguf(path, tensors: dict[str, tuple[np.ndarray, str | None]]) -> None:
    """A GGUF file of raw quantized tensors (type name) and float ones (None)."""
    from gguf import GGMLQuantizationType, GGUFWriter

    writer = GGUFWriter(str(path), "llama")
    for name, (data, kind) in tensors.items():
        if kind is None:
            writer.add_tensor(name, data)
        else:
            writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=GGMLQuantizationType[kind])
    for step in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file):
        step()
    writer.close()


def test_source_serves_every_type_and_fused_weights_of_mixed_types(tmp_path):
    raw = {"q": (random_gguf_q4k(6, 512, seed=1), "Q4_K"), "v": (random_blocks("Q6_K", 4, 512, seed=2), "Q6_K"),
           "o": (random_blocks("Q8_0", 5, 512, seed=3), "Q8_0"), "g": (random_blocks("Q5_0", 3, 512, seed=4), "Q5_0"),
           "f": (np.ones((2, 512), dtype=np.float32), None)}
    path = tmp_path / "mixed.gguf"
    write_gguf(path, {f"{k}.weight": v for k, v in raw.items()})
    source = GGUFSource(path)
    assert len(source) == 18 and source.tensor_types() == {"Q4_K": 1, "Q6_K": 1, "Q8_0": 1, "Q5_0": 1}
    floats = {k: _dequantize(*v) for k, v in raw.items() if v[1] is not None}

    fused = torch.cat([floats["q"][[3, 0, 5]], floats["v"], floats["q"][[1]]])  # Q4_K, Q6_K, Q4_K rows
    bias = torch.randn(fused.shape[0])
    blocks = source.blocks_for(fused)
    assert [(kind, len(rows)) for kind, rows in blocks] == [("Q4_K", 3), ("Q6_K", 4), ("Q4_K", 1)]
    layer = source.linear_for(fused, bias)
    assert isinstance(layer, SegmentedLinear) and layer.kernel_name == "q4k-cpp+q6k-cpp+q4k-cpp"
    assert [type(s) for s in layer.segments] == [Q4KLinear, GGUFBlockLinear, Q4KLinear]
    assert list(layer.modules()) == [layer] and layer.weight_bytes == sum(s.weight_bytes for s in layer.segments)
    x = torch.randn(12, 512, generator=torch.Generator().manual_seed(5))
    y = layer(x)
    assert y.shape == (12, 8)
    exact = x.double() @ fused.double().T + bias.double()
    assert (y.double() - exact).norm() / exact.norm() < 0.02
    alone = torch.cat([layer(x[i:i + 1]) for i in range(12)])
    assert all(torch.equal(layer(x[:m]), alone[:m]) for m in range(1, 13))

    build = q4k_linear_factory(source)
    for name, kernel in (("o", "q8_0-cpp"), ("g", "q5_0-cpp"), ("v", "q6k-cpp"), ("q", "q4k-cpp")):
        assert build(floats[name], None).kernel_name == kernel
    changed = floats["o"].clone()
    changed[1, 3] += 1e-3
    assert source.blocks_for(changed) is None
    assert type(build(changed, None)).__name__ == "Int8Linear"  # a row not in the file: no second rounding
    assert type(build(torch.ones(2, 512), None)).__name__ == "Int8Linear"  # a float tensor of the file


def _dequantize(raw: np.ndarray, kind: str) -> torch.Tensor:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    return torch.from_numpy(dequantize(raw, GGMLQuantizationType[kind]).astype(np.float32))


@pytest.mark.slow
@long_test
@pytest.mark.parametrize("name", ["qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"])
def test_every_linear_layer_of_the_qwen_gguf_runs_on_its_blocks(name):
    path = pulled_model_path(name)
    if not path.is_file():
        pytest.skip(f"{path} not pulled (draftwise pull {name})")
    from collections import Counter

    from draftwise.backends.kernels.layers import _KernelLinear
    from draftwise.backends.quantization import Int8Linear
    from draftwise.models.loading import load_model

    model = load_model(str(path), quantization="q4k", runtime="lean", device="cpu").backend.model
    int8 = [n for n, m in model.named_modules() if isinstance(m, Int8Linear)]
    kernels = {n: m.kernel_name for n, m in model.named_modules() if isinstance(m, _KernelLinear)}
    by_role = Counter((layer.rsplit(".", 1)[-1], kernel) for layer, kernel in kernels.items())
    logging.getLogger(__name__).info("%s: %s", name, ", ".join(f"{role} {kernel} x{n}" for (role, kernel), n in
                                                             sorted(by_role.items())))
    assert not int8, f"{len(int8)} layers on int8: {int8[:5]}"
    known = {"q4k-cpp", "q6k-cpp", "q8_0-cpp", "q5_0-cpp"}
    assert kernels and all(set(kernel.split("+")) <= known for kernel in kernels.values()), kernels


_BUILD_AND_RUN = """
import sys
from pathlib import Path

import torch
from torch.utils import cpp_extension

sources, march, build, data = sys.argv[1:5]
lib = Path(torch.__file__).parent / "lib"
Path(build).mkdir(parents=True, exist_ok=True)
cpp_extension.load(name="draftwise_check_" + march.replace("-", "_"), sources=sources.split(","), build_directory=build,
                   is_python_module=False, extra_cflags=["-O3", "-march=" + march, "-fopenmp", "-ffp-contract=off"],
                   extra_ldflags=["-L" + str(lib), "-lgomp", "-Wl,-rpath," + str(lib)])
results = {}
for op, (x, packed) in torch.load(data).items():
    run = lambda rows: getattr(torch.ops.draftwise_q4k, op)(rows, packed, torch.empty(0))
    alone = torch.cat([run(x[i:i + 1]) for i in range(x.shape[0])])
    results[op] = (run(x), all(torch.equal(run(x[:m]), alone[:m]) for m in range(1, x.shape[0] + 1)))
native = torch.load(data + ".native")
results["native"] = {name: getattr(torch.ops.draftwise_native, name.rstrip("16"))(*args) for name, args in native.items()}
torch.save(results, data + ".out")
"""


@pytest.mark.slow
@long_test
def test_the_kernels_build_and_agree_on_avx2_only_and_portable_builds(tmp_path):
    """The extension built for an AVX2-only CPU (haswell: no AVX-512) gives this machine's bits; built without
    AVX2 (x86-64-v2: the portable path, software fp16) it is row-invariant and computes the same arithmetic. The
    lean runtime's native operations give the same bits on all three builds."""
    import subprocess
    import sys
    from draftwise.backends.kernels import q4k

    from test_q4k import q8_reference

    generator = torch.Generator().manual_seed(9)
    x = torch.randn(16, 512, generator=generator) * 2
    packed_q4k = q4k.quantize_q4k(torch.randn(24, 512, generator=generator) * 0.05)
    cases = {"linear": (x, packed_q4k)}
    references = {"linear": q8_reference(x, q4k.dequantize_q4k(packed_q4k))}
    for fmt in FORMATS:
        raw = torch.from_numpy(random_blocks(fmt.ggml_type, 24, 512, seed=fmt.block_bytes))
        cases[fmt.op] = (x, GGUFBlockLinear(fmt, raw).packed)  # the layout the op reads
        references[fmt.op] = int8_reference(x, dequantize_blocks(raw, fmt), fmt.block_weights)
    native = {op: getattr(torch.ops.draftwise_q4k, op)(x, packed, torch.empty(0)) for op, (x, packed) in cases.items()}
    data = tmp_path / "cases.pt"
    torch.save(cases, data)
    # the lean runtime's native operations (basic IEEE operations only, no FMA): the same bits on every build
    keys, values = torch.randn(2, 128, 32, generator=generator), torch.randn(2, 128, 32, generator=generator)
    native_cases = {
        "attention": (torch.randn(3, 6, 32, generator=generator), keys, values, torch.tensor([70, 71, 64]),
                      torch.tensor([[0], [0], [100]]), torch.tensor([0, 0, 1]), 0.17),
        "attention16": (torch.randn(3, 6, 32, generator=generator), keys.half(), values.half(), torch.tensor([70, 71, 64]),
                        torch.tensor([[0], [0], [100]]), torch.tensor([0, 0, 1]), 0.17),
        "rms_norm": (torch.randn(3, 200, generator=generator), torch.randn(200, generator=generator), 1e-6),
        "silu_mul": (torch.randn(3, 2 * 150, generator=generator) * 6,),
    }
    torch.save(native_cases, str(data) + ".native")
    native["native"] = {name: getattr(torch.ops.draftwise_native, name.rstrip("16"))(*args)
                        for name, args in native_cases.items()}
    sources = ",".join(str(path) for path in q4k._SOURCES)
    for march in ("haswell", "x86-64-v2"):
        done = subprocess.run([sys.executable, "-c", _BUILD_AND_RUN, sources, march, str(tmp_path / march),
                               str(data)], capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        results = torch.load(str(data) + ".out")
        for name, y in results.pop("native").items():
            assert torch.equal(y, native["native"][name]), (march, name)
        for op, (y, invariant) in results.items():
            assert invariant, (march, op)
            if march == "haswell":
                assert torch.equal(y, native[op]), op  # the AVX2 path, compiled without AVX-512: the same bits
            reference = references[op]
            assert torch.allclose(y.double(), reference, rtol=1e-5,
                                  atol=1e-4 * reference.abs().max().item()), (march, op)
