"""Linear-layer kernels for the PyTorch CPU path, chosen per machine by a short measured self-test.

Greedy speculative decoding is exact only when a row's output of every layer does not depend on how many
rows share the call ("row invariance", bit for bit): the target's logits for a position must be the same
in a k-token verify pass as in one-token decoding (Leviathan et al. 2023, Sec. 2.3, assume exact target
probabilities; He et al. 2024, "Defeating Nondeterminism in LLM Inference", show why a GEMM's reduction
order, and so its rounding, changes with the number of rows). Which kernels keep that property, and which
is fastest, depends on the CPU (AVX2 vs AVX-512/VNNI vs AMX) and the torch build, so neither is assumed:

- :data:`LINEAR_KERNELS` lists the candidates (:class:`LinearKernel`), one quantization mode each:
  ``"none"`` (fp32 weights: MKL with rows zero-padded to a multiple of R, oneDNN prepacked), ``"bf16"``
  (oneDNN bf16), ``"int8"`` (fbgemm and oneDNN u8 x s8 with per-row activation scales, weight-only int8) and
  ``"int4"`` (weight-only int4, group size 32/64/128), and GGUF's block formats on draftwise's C++ kernels:
  ``"q4k"`` (:mod:`.q4k`), ``"q6k"``, ``"q8_0"``, ``"q5_0"`` (:mod:`.gguf_blocks`); :mod:`.gguf_source` maps a
  GGUF file's dequantized weights back to its blocks. Kernels of one mode may differ in their rounding
  (:attr:`LinearKernel.numerics` says how they compute); a run uses one kernel for every layer.
- :func:`select_linear_kernel` checks each available candidate on synthetic weights of the model's layer
  shapes (:func:`check_row_invariance`: rows of an m-row call, m = 1..17 and some prefill sizes, equal to
  the same rows computed alone, with ``torch.equal``), times m = 1, 2, 4, 8, 16 rows, refuses the kernels
  that are not row-invariant and picks the fastest of the rest by a weighted cost (:data:`COST_WEIGHTS`:
  decode m = 1 most, then verify passes of 5-9 rows); kernels slower than the chosen one need no check. The result (:class:`KernelChoice`) is cached as JSON
  under ``draftwise_home()/kernels/``, keyed by CPU model and flags, torch version, threads, mode, shapes and
  candidates, so later loads cost nothing. ``DRAFTWISE_KERNEL=<name>`` (or ``kernel=``) forces a kernel,
  still refused when it is not row-invariant unless the caller says it needs no invariance (a draft model).
- :func:`measure_dram_bandwidth` and :func:`cpu_description` give the machine figures that a
  weight-streaming lower bound per token (weight bytes / read bandwidth) needs.

Modules: :mod:`.shapes` (layer shapes and weight bytes), :mod:`.layers` (the modules the kernels build),
:mod:`.registry` (the candidates), :mod:`.invariance` (the check), :mod:`.selftest` (timing, choice and
cache), :mod:`.settings` (row counts, weights); the machine facts live in :mod:`draftwise.machine`.

Measured tables (AVX2 AMD EPYC and others): ``docs/kernels.md``.
"""

from draftwise.backends.kernels.invariance import InvarianceResult, check_row_invariance
from draftwise.backends.kernels.layers import (
    Int4WeightOnlyLinear,
    Int8WeightOnlyLinear,
    KernelError,
    OneDnnFloatLinear,
    OneDnnInt8Linear,
    PaddedFloatLinear,
    quantize_int4_groups,
)
from draftwise.backends.kernels.registry import LINEAR_KERNELS, LinearKernel, linear_kernels
from draftwise.backends.kernels.selftest import KernelChoice, KernelTrial, kernel_cache_dir, select_linear_kernel
from draftwise.backends.kernels.settings import (
    COST_WEIGHTS,
    INT4_GROUP_SIZES,
    INVARIANCE_ROWS,
    KERNEL_ENV,
    KERNEL_MODES,
    PAD_ROWS,
    TIMED_ROWS,
)
from draftwise.backends.kernels.shapes import (
    LinearShape,
    as_shapes,
    linear_weight_bytes,
    llama_linear_shapes,
    model_linear_shapes,
)
from draftwise.machine import cpu_description, cpu_flags, cpu_model_name, measure_dram_bandwidth

__all__ = [
    "KERNEL_MODES", "KERNEL_ENV", "COST_WEIGHTS", "INVARIANCE_ROWS", "TIMED_ROWS", "LINEAR_KERNELS", "PAD_ROWS",
    "INT4_GROUP_SIZES", "KernelError", "LinearShape", "LinearKernel", "InvarianceResult", "KernelTrial",
    "KernelChoice", "linear_kernels", "check_row_invariance", "select_linear_kernel", "kernel_cache_dir",
    "as_shapes", "llama_linear_shapes", "model_linear_shapes", "linear_weight_bytes", "measure_dram_bandwidth",
    "cpu_description", "cpu_flags", "cpu_model_name", "quantize_int4_groups",
    "PaddedFloatLinear", "OneDnnFloatLinear", "OneDnnInt8Linear", "Int8WeightOnlyLinear", "Int4WeightOnlyLinear",
]
