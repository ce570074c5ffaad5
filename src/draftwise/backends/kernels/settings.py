"""The self-test's settings: modes, row counts, cost weights, cache schema."""

from __future__ import annotations

#: Quantization modes a kernel can serve: the float or integer format of the stored weights.
KERNEL_MODES = ("none", "bf16", "int8", "int4", "q4k", "q6k", "q8_0", "q5_0")
#: Environment variable that forces a kernel: a name, or comma-separated names (the one of the mode applies).
KERNEL_ENV = "DRAFTWISE_KERNEL"
#: Row counts whose rows must equal the same rows computed alone: decode, verify and tree passes (1..17)
#: and prefill chunks (32..512; those above the multiply-accumulate budget of a shape are skipped).
INVARIANCE_ROWS = (*range(1, 18), 32, 64, 128, 512)
#: Row counts m of an m-row call up to which every row is compared; above it a sample of rows.
FULL_CHECK_ROWS = 17
#: Longest predicted time (s) of one invariance call above 17 rows (from the kernel's measured 16-row
#: time); larger prefill sizes are skipped for that shape and kernel, which keeps the test short.
LARGE_CALL_SECONDS = 0.3
#: Row counts that are timed.
TIMED_ROWS = (1, 2, 4, 8, 16)
#: A call whose first run (the warm-up) takes longer than this (s) is not repeated.
SLOW_CALL_SECONDS = 0.25
#: A kernel whose weighted cost exceeds this multiple of the fastest fully timed one is not timed further.
SLOWER_CUTOFF = 3.0
#: Weight of each timed row count in the cost that picks a kernel: decode passes (m = 1, target and draft)
#: dominate; verify passes of K + 1 = 5..9 rows lie between m = 4 and m = 8.
COST_WEIGHTS = {1: 0.55, 2: 0.05, 4: 0.15, 8: 0.2, 16: 0.05}
#: Row multiples that ``fp32-mkl-pad`` tries, smallest first (1 = no padding).
PAD_ROWS = (1, 4, 8, 16)
#: Group sizes (input channels per scale and zero point) of the weight-only int4 kernels.
INT4_GROUP_SIZES = (32, 64, 128)
CACHE_SCHEMA = 1

_SYNTHETIC_BLOCK_ROWS = 4096  # synthetic weights: a random block of this many output rows, repeated


