"""llama.cpp backend: GGUF models (quantized or not) on the CPU through ``llama-cpp-python``'s C API.

The backend drives llama.cpp's low-level context directly (the high-level ``Llama`` class turns flash attention
off and is slower for this loop):

- ``forward`` writes the new tokens into one ``llama_batch`` (positions ``num_cached ..``), flags the rows whose
  logits are wanted, calls ``llama_decode`` and copies ``llama_get_logits`` (``[rows, n_vocab]`` float32);
- ``rollback`` removes the cache cells past ``length`` with ``llama_memory_seq_rm(memory, 0, length, -1)``.

**Batch invariance.** llama.cpp computes a one-token pass with other kernels than a pass over two or more
tokens (ggml's matrix-vector path against llamafile's tinyBLAS GEMM for F32 weights, the vector against the
tiled flash-attention kernel): measured on stories260K (all tensors F32), the logits of a token decoded alone
differ from the same token decoded inside a batch by up to 3e-3, with one thread, with and without flash
attention. Passes over 2..63 tokens, on the other hand, give bit-identical logits for a given position and
context, whatever the batch size and offset. With flash attention, passes of 64 or more tokens switch to a
tiled attention kernel (ggml's ``GGML_FA_TILE_Q``) and differ again (:data:`FLASH_ATTENTION_TILE_TOKENS`).
Speculative verification runs k + 1 >= 2 tokens while plain decoding runs one, so greedy speculative output
would drift from plain output.

Quantized weights add two more batch-size-dependent kernels, measured on Qwen2.5-Coder-1.5B Q4_K_M (logits
moved by up to 0.68 between batch sizes): repacked Q4_K weights switch kernels at 4 tokens, and ggml's tiled
K-quant product takes over at 8 tokens. With both off, passes of 1..16 tokens gave bit-identical logits there.

With ``batch_invariant=True`` (the default) the backend therefore
1. never runs a one-token pass: a single new token is decoded together with a throw-away copy of itself at the
   next position, and that cell is removed right after (causal attention: the copy cannot change the real
   token's logits);
2. requests at least two output rows from any pass that returns logits (llama.cpp computes the last layer and
   the LM head only for the requested rows, so one requested row would again be a matrix-vector product);
3. with flash attention, puts at most 63 tokens in one pass (long prompts are prefilled in chunks);
4. loads weights without repacking (``use_extra_bufts = false``).

Every backend, invariant or not, sets ``GGML_CPU_TILED_MM=0`` unless the environment already sets it: ggml reads
the variable once per process, at the first pass that could use its tiled kernel, so a native draft that
prefilled before an invariant target was created would otherwise fix the tiled kernel on for the target too.

The price is that a one-token step costs a two-token pass (see ``docs/llama_cpp.md`` for measurements).
``batch_invariant=False`` gives llama.cpp's native path (repacked weights, passes of up to
:data:`MAX_BATCH_TOKENS` tokens, one-token passes): faster steps and prefill, but a target's speculative output is
then not guaranteed to equal its plain output. Drafts load this way (``load_model(..., drafting=True)``): only
the target's numerics decide the output.

Threads default to the CPUs this process may run on; llama.cpp's log lines go to this module's logger at
DEBUG level.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import logging
import os
import weakref
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from draftwise.backends.base import CausalLM, ForwardOutput, KVState

__all__ = ["LlamaCppCausalLM", "LlamaCppTokenizer", "llama_cpp_available", "load_llama_cpp",
           "compiled_cpu_features", "has_amx_kernels", "parse_system_info", "gguf_file_type", "requantize_gguf",
           "REQUANTIZE_TYPES", "copy_recipe",
           "DEFAULT_MAX_CONTEXT", "INSTALL_HINT"]

logger = logging.getLogger(__name__)

#: Context length (tokens) when none is given: the model's training context, capped here because llama.cpp
#: preallocates the whole KV cache.
DEFAULT_MAX_CONTEXT = 4096
#: Largest number of tokens sent to ``llama_decode`` at once (longer inputs are split into even chunks).
MAX_BATCH_TOKENS = 512
#: Bytes the KV caches of a context holding several sequences may take together (f16 keys and values,
#: preallocated by llama.cpp): 2 GiB holds 8 sequences of 21,844 tokens of Qwen2.5-Coder-0.5B (12 KiB a token).
SLOTS_KV_BUDGET = 2 * 1024**3
#: ggml's flash attention switches to a tiled kernel (another summation order) for this many or more query
#: tokens in one pass (``GGML_FA_TILE_Q``); batch-invariant passes with flash attention stay below it.
FLASH_ATTENTION_TILE_TOKENS = 64
#: How to get llama-cpp-python as draftwise needs it: compiled on this machine without llama.cpp's AMX kernels
#: (a plain ``pip install llama-cpp-python`` compiles them in on CPUs that report AMX, where they can crash the
#: process with SIGILL).
INSTALL_HINT = ("install llama-cpp-python compiled without AMX kernels: scripts/install_llama_cpp.sh in a draftwise "
                "checkout (scripts/setup.sh runs it), see docs/llama_cpp.md")


def llama_cpp_available() -> bool:
    """True when the ``llama_cpp`` module (llama-cpp-python, see :data:`INSTALL_HINT`) can be imported."""
    return importlib.util.find_spec("llama_cpp") is not None


def parse_system_info(text: str) -> dict[str, str]:
    """The ``NAME = value`` pairs of llama.cpp's system-info line.

    Args:
        text: what ``llama_print_system_info`` returns, e.g. ``"CPU : SSE3 = 1 | AVX512 = 1 | OPENMP = 1 | "``
            (a backend name and ``:`` may precede the first pair).

    Returns:
        ``{"SSE3": "1", "AVX512": "1", "OPENMP": "1"}``; the last value wins when a name repeats.
    """
    features = {}
    for part in text.split("|"):
        name, sep, value = part.rpartition("=")
        if sep:
            features[name.rpartition(":")[2].strip()] = value.strip()
    return features


def compiled_cpu_features() -> dict[str, str]:
    """The instruction sets and options this llama.cpp build was compiled with (see :func:`parse_system_info`).

    Raises:
        ImportError: llama-cpp-python is not installed.
    """
    import llama_cpp

    return parse_system_info(llama_cpp.llama_print_system_info().decode("utf-8", "replace"))


def has_amx_kernels(features: dict[str, str]) -> bool:
    """True when a build's features (:func:`compiled_cpu_features`) include llama.cpp's AMX kernels.

    A build compiled with ``-march=native`` on a CPU that reports AMX has them, and they can crash the process
    with SIGILL there (issue 15); ``scripts/install_llama_cpp.sh`` compiles without them.
    """
    return any(name.startswith("AMX") and value not in ("", "0") for name, value in features.items())


@functools.cache
def _llama():
    """Import ``llama_cpp``, initialise its backend once and route its log lines to :data:`logger`.

    Cached, so the ctypes log callback stays referenced for the life of the process.

    Raises:
        ImportError: llama-cpp-python is not installed.
    """
    import llama_cpp

    @llama_cpp.llama_log_callback
    def forward_log(level, text, user_data):  # pragma: no cover - called from C
        if text:
            logger.debug("llama.cpp: %s", text.decode("utf-8", "replace").rstrip())

    llama_cpp.llama_log_set(forward_log, ctypes.c_void_p(0))
    llama_cpp.llama_backend_init()
    if has_amx_kernels(compiled_cpu_features()):
        logger.warning("this llama.cpp build has AMX kernels, which crash (SIGILL) on some CPUs that report AMX; "
                       "to rebuild without them, %s", INSTALL_HINT)
    return llama_cpp, forward_log


def _disable_tiled_matmul(warn: bool) -> None:
    """Turn off ggml's tiled K-quant matrix product (``GGML_CPU_TILED_MM=0``) unless the user chose otherwise.

    From 8 tokens per pass, ggml multiplies Q4_K/Q5_K/Q6_K weights with a tiled kernel that sums in another
    order (logits of Qwen2.5-Coder-1.5B Q4_K_M moved by up to 0.68) and was slower on the CPUs measured here.
    The variable is process-wide and read once, so a user's explicit setting wins (with a warning, when ``warn``:
    the backend is batch-invariant, and the setting breaks that).
    """
    value = os.environ.setdefault("GGML_CPU_TILED_MM", "0")
    if warn and value != "0":
        logger.warning("GGML_CPU_TILED_MM=%s: passes of 8 or more tokens use another kernel, so speculative output "
                       "may differ from plain output", value)


def _lib():
    return _llama()[0]


def default_threads() -> int:
    """CPUs this process may use (``sched_getaffinity``), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not on Linux
        return max(1, os.cpu_count() or 1)


class _ModelHandle:
    """Owns one ``llama_model`` (weights and vocabulary); freed when the last user lets go of it.

    ``repack`` lets llama.cpp repack quantized weights for its CPU GEMM kernels (its default). Repacked Q4_K
    weights are multiplied by one kernel for 1-3 tokens and another from 4 tokens on, whose results differ
    (Qwen2.5-Coder-1.5B Q4_K_M: logits moved by up to 0.68), so batch-invariant backends load without it.

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: llama.cpp cannot load the file.
    """

    def __init__(self, path: Path, *, repack: bool = False) -> None:
        lib = _lib()
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {path}")
        params = lib.llama_model_default_params()
        params.use_extra_bufts = repack
        model = lib.llama_model_load_from_file(str(path).encode(), params)
        if not model:
            raise ValueError(f"llama.cpp could not load {path} (not a GGUF model it supports?)")
        self.ptr = model
        self.vocab = lib.llama_model_get_vocab(model)
        self.path = path
        self.repacked = repack
        self._finalizer = weakref.finalize(self, lib.llama_model_free, model)

    @property
    def n_vocab(self) -> int:
        """Rows of the token embedding = width of the logits."""
        return int(_lib().llama_vocab_n_tokens(self.vocab))

    @property
    def n_ctx_train(self) -> int:
        """Context length the model was trained with (tokens)."""
        return int(_lib().llama_model_n_ctx_train(self.ptr))

    def chat_template(self) -> str | None:
        """The chat template stored in the GGUF metadata (``tokenizer.chat_template``), if any."""
        raw = _lib().llama_model_chat_template(self.ptr, None)
        return raw.decode("utf-8") if raw else None


def _free_context(lib, ctx, batch, model: _ModelHandle) -> None:
    """Free a context and its batch before the model they belong to (``model`` is kept alive until then)."""
    lib.llama_batch_free(batch)
    lib.llama_free(ctx)


class LlamaCppCausalLM(CausalLM):
    """A GGUF model run by llama.cpp; its ``CausalLM`` methods drive one sequence (llama.cpp's sequence 0).

    With ``num_slots`` > 1 the context holds that many sequences, each in its own KV-cache stream of
    ``max_context`` cells (llama.cpp's ``n_seq_max`` without a unified cache), which :class:`LlamaCppSlots` drives
    as a slot backend: a draft model for the batched engine (one ``llama_decode`` per draft depth over one row
    per drafting sequence). The ``CausalLM`` methods then use slot 0.

    Args:
        path: the ``.gguf`` file.
        name: identity used in messages (default: the path).
        max_context: context length in tokens (default: the training context, at most
            :data:`DEFAULT_MAX_CONTEXT`); the KV cache is preallocated for it (plus one cell, see below).
        n_threads: CPU threads for decoding (default: every CPU this process may use).
        flash_attention: use llama.cpp's flash-attention kernels (faster on the CPU here).
        batch_invariant: never run one-token passes, so logits do not depend on how tokens are batched (see
            the module docstring); needed for exact greedy speculation by a target. Drafts are loaded without it.
        model: an already loaded model to share (a second context on the same weights); ``path`` is then
            only used for messages. For a batch-invariant backend it must be loaded with ``repack=False``.
        num_slots: sequences the context holds (>= 1; above 1 only without ``batch_invariant``: several
            sequences are for drafts). Their KV caches together are kept within :data:`SLOTS_KV_BUDGET` bytes:
            ``max_context`` shrinks to fit when needed (logged).

    Raises:
        FileNotFoundError, ValueError: the file is missing or llama.cpp cannot load it or create a context;
            ``num_slots`` < 1, or > 1 for a batch-invariant backend.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        name: str | None = None,
        max_context: int | None = None,
        n_threads: int | None = None,
        flash_attention: bool = True,
        batch_invariant: bool = True,
        model: _ModelHandle | None = None,
        num_slots: int = 1,
    ) -> None:
        lib = _lib()
        if num_slots < 1 or (num_slots > 1 and batch_invariant):
            raise ValueError(f"num_slots must be >= 1, and 1 for a batch-invariant backend; got {num_slots}")
        _disable_tiled_matmul(warn=batch_invariant)
        self.handle = model or _ModelHandle(Path(path), repack=not batch_invariant)
        self.name = name or str(path)
        self.vocab_size = self.handle.n_vocab
        self.num_slots = num_slots
        self.max_context = int(max_context or min(self.handle.n_ctx_train, DEFAULT_MAX_CONTEXT))
        if num_slots > 1:
            self.max_context = self._fit_slots_context(self.max_context)
        if self.max_context < 2:
            raise ValueError(f"max_context must be at least 2 tokens, got {self.max_context}")
        self.n_threads = int(n_threads or default_threads())
        self.batch_invariant = batch_invariant
        self.flash_attention = flash_attention
        self.device = torch.device("cpu")
        self._batch_capacity = self._largest_pass()
        self._ctx = self._create_context(lib)
        self._memory = lib.llama_get_memory(self._ctx)
        self._batch = lib.llama_batch_init(self._batch_capacity, 0, 1)
        self._finalizer = weakref.finalize(self, _free_context, lib, self._ctx, self._batch, self.handle)
        self._lengths = [0] * num_slots  # tokens each sequence holds

    def set_threads(self, threads: int) -> None:
        """Decode with ``threads`` CPU threads from the next call on (``llama_set_n_threads``; :attr:`n_threads`,
        the count the backend was loaded with, stays as it is).

        Raises:
            ValueError: ``threads`` < 1.
        """
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        _lib().llama_set_n_threads(self._ctx, int(threads), int(threads))

    def _fit_slots_context(self, max_context: int) -> int:
        """``max_context`` or, when ``num_slots`` caches of it would exceed :data:`SLOTS_KV_BUDGET`, the most
        tokens per sequence that fit (f16 keys and values)."""
        lib, ptr = _lib(), self.handle.ptr
        head_dim = int(lib.llama_model_n_embd(ptr)) // max(1, int(lib.llama_model_n_head(ptr)))
        per_token = 2 * 2 * int(lib.llama_model_n_layer(ptr)) * int(lib.llama_model_n_head_kv(ptr)) * head_dim
        fits = SLOTS_KV_BUDGET // (self.num_slots * max(1, per_token)) - 1
        if fits < max_context:
            logger.info("llama.cpp: %s holds %d sequences of %d tokens (not %d: their KV caches stay within %d MiB)",
                        self.name, self.num_slots, fits, max_context, SLOTS_KV_BUDGET >> 20)
            return fits
        return max_context

    def _largest_pass(self) -> int:
        """Most tokens one ``llama_decode`` may hold (see :data:`FLASH_ATTENTION_TILE_TOKENS`)."""
        largest = min(MAX_BATCH_TOKENS, self.max_context + 1)
        if self.batch_invariant and self.flash_attention:
            largest = min(largest, FLASH_ATTENTION_TILE_TOKENS - 1)
        return largest

    def _create_context(self, lib):
        params = lib.llama_context_default_params()
        # one spare cell per sequence for the throw-away token of a one-token pass
        params.n_ctx = (self.max_context + 1) * self.num_slots
        params.n_batch = params.n_ubatch = self._batch_capacity
        params.n_seq_max = self.num_slots
        params.kv_unified = False  # each sequence its own stream of n_ctx / n_seq_max cells
        params.n_threads = params.n_threads_batch = self.n_threads
        params.flash_attn_type = (lib.LLAMA_FLASH_ATTN_TYPE_ENABLED if self.flash_attention
                                  else lib.LLAMA_FLASH_ATTN_TYPE_DISABLED)
        params.no_perf = True
        ctx = lib.llama_init_from_model(self.handle.ptr, params)
        if not ctx:
            raise ValueError(f"llama.cpp could not create a context of {self.max_context} tokens for {self.name}")
        return ctx

    def close(self) -> None:
        """Free the context now (the model goes with its last user). The backend is unusable afterwards."""
        self._finalizer()

    # ------------------------------------------------------------------ CausalLM
    @property
    def num_cached(self) -> int:
        return self._lengths[0]

    def forward(
        self, token_ids: Sequence[int], *, num_logits: int | None = None, return_hidden: bool = False
    ) -> ForwardOutput:
        """Decode ``token_ids`` (``[n]``) on top of the cache; logits ``[keep, vocab]`` float32 (see
        :meth:`CausalLM.forward`). Hidden states ``[keep, n_embd]`` are the final-norm outputs llama.cpp
        returns as embeddings.

        Raises:
            ContextOverflowError, ValueError: see :meth:`CausalLM.forward`.
            RuntimeError: ``llama_decode`` failed (the cache is rolled back to its state before the call).
        """
        ids = [int(t) for t in token_ids]
        self._check_forward_args(ids)
        self.cache_owner = None  # the cache changes: it no longer holds what a marker recorded
        n = len(ids)
        keep = n if num_logits is None else max(1, min(num_logits, n))
        padded = self.batch_invariant and n == 1
        sequence = ids + ids[-1:] if padded else ids  # the copy sits at the next position and is removed below
        start = self.num_cached
        wanted = range(n - keep, n)
        if return_hidden:
            _lib().llama_set_embeddings(self._ctx, True)
        try:
            logits, hidden = self._decode_chunks(sequence, start, wanted, return_hidden)
        except BaseException:
            self._remove_from(start)
            raise
        finally:
            if return_hidden:
                _lib().llama_set_embeddings(self._ctx, False)
        if padded:
            self._remove_from(start + n)
        self._lengths[0] = start + n
        return ForwardOutput(logits=logits, hidden=hidden)

    def rollback(self, length: int) -> None:
        self._check_rollback_args(length)
        if length != self.num_cached:
            self.cache_owner = None
            self._remove_from(length)
            self._lengths[0] = length

    # ------------------------------------------------------------------ several sequences (LlamaCppSlots)
    def sequence_length(self, seq: int) -> int:
        """Tokens sequence ``seq`` holds (``num_cached`` is sequence 0's)."""
        return self._lengths[seq]

    def truncate_sequence(self, seq: int, length: int) -> None:
        """Keep the first ``length`` tokens of sequence ``seq`` (a rollback of that sequence).

        Raises:
            ValueError: ``length`` outside ``0..sequence_length(seq)``.
        """
        if not 0 <= length <= self._lengths[seq]:
            raise ValueError(f"{self.name}: sequence {seq} holds {self._lengths[seq]} tokens, cannot keep {length}")
        if length != self._lengths[seq]:
            self.cache_owner = None
            self._remove_from(length, seq)
            self._lengths[seq] = length

    def decode_sequences(self, rows: Sequence[tuple[int, int, int, bool]]) -> np.ndarray:
        """Append rows ``(token, sequence, position, logits wanted)`` to their sequences in one ``llama_decode``
        per batch capacity (each sequence's rows in order, its first at its current length); returns the
        wanted rows' logits ``[wanted, vocab]`` float32, in row order.

        Raises:
            RuntimeError: ``llama_decode`` failed (every sequence of the rows keeps what it held before).
        """
        before = {seq: self._lengths[seq] for _, seq, _, _ in rows}
        self.cache_owner = None
        parts = []
        try:
            for first in range(0, len(rows), self._batch_capacity):
                chunk = rows[first:first + self._batch_capacity]
                outputs = [row[3] for row in chunk]
                if not any(outputs):
                    outputs[-1] = True  # llama.cpp computes at least one row's logits; this one is dropped
                tokens, seqs, positions, _ = zip(*chunk)
                self._decode(tokens, positions, seqs, outputs)
                computed = np.cumsum(outputs) - 1  # row i's index among the computed logits rows
                picks = [int(computed[i]) for i, row in enumerate(chunk) if row[3]]
                if picks:
                    parts.append(self._read_logits(int(computed[-1]) + 1)[picks])
                for _, seq, position, _ in chunk:
                    self._lengths[seq] = max(self._lengths[seq], position + 1)
        except BaseException:
            for seq, length in before.items():
                self._remove_from(length, seq)
                self._lengths[seq] = length
            raise
        return np.concatenate(parts) if parts else np.empty((0, self.vocab_size), dtype=np.float32)

    def export_sequence(self, seq: int) -> KVState:
        """Sequence ``seq``'s KV cells copied out of llama.cpp (``llama_state_seq_get_data``), for
        :meth:`import_sequence` into any sequence of a context of the same model."""
        lib = _lib()
        size = int(lib.llama_state_seq_get_size(self._ctx, seq))
        buffer = (ctypes.c_uint8 * size)()
        written = int(lib.llama_state_seq_get_data(self._ctx, buffer, size, seq))
        if written <= 0:
            raise RuntimeError(f"{self.name}: llama.cpp could not export sequence {seq}")
        return KVState(payload=(self.handle.path, buffer, written), length=self._lengths[seq], nbytes=written)

    def import_sequence(self, seq: int, state: KVState, length: int) -> None:
        """Replace sequence ``seq``'s contents by the first ``length`` positions of an exported one.

        Raises:
            ValueError: ``length`` outside ``0..state.length`` or a state of another model or backend.
            RuntimeError: llama.cpp refused the state.
        """
        payload = state.payload
        if not (isinstance(payload, tuple) and len(payload) == 3 and payload[0] == self.handle.path):
            raise ValueError(f"{self.name}: not a KV state this model's llama.cpp backend exported")
        if not 0 <= length <= state.length:
            raise ValueError(f"{self.name}: cannot import {length} of the state's {state.length} positions")
        self.truncate_sequence(seq, 0)
        _, buffer, size = payload
        if int(_lib().llama_state_seq_set_data(self._ctx, buffer, size, seq)) <= 0:
            raise RuntimeError(f"{self.name}: llama.cpp could not import a state into sequence {seq}")
        self._lengths[seq] = state.length
        self.truncate_sequence(seq, length)

    # ------------------------------------------------------------------ decoding
    def _remove_from(self, position: int, seq: int = 0) -> None:
        """Drop every cache cell of sequence ``seq`` at ``position`` and after."""
        if not _lib().llama_memory_seq_rm(self._memory, seq, position, -1):
            raise RuntimeError(f"{self.name}: llama.cpp could not remove cache cells of sequence {seq} from "
                               f"position {position}")

    def _chunks(self, total: int) -> list[range]:
        """Split ``total`` tokens into even chunks of at most the batch capacity (each >= 2 tokens when
        ``total`` >= 2, so no chunk is a one-token pass)."""
        count = -(-total // self._batch_capacity)
        bounds = [round(i * total / count) for i in range(count + 1)]
        return [range(a, b) for a, b in zip(bounds, bounds[1:])]

    def _output_rows(self, chunk: range, wanted: range) -> list[int]:
        """Rows of ``chunk`` to request logits for: the wanted ones, plus a neighbour when exactly one is
        wanted and the backend is batch-invariant (one output row would make the last layer a matrix-vector
        product)."""
        rows = [i for i in chunk if i in wanted]
        if self.batch_invariant and len(rows) == 1 and len(chunk) > 1:
            extra = rows[0] - 1 if rows[0] > chunk.start else rows[0] + 1
            rows = sorted([extra, rows[0]])
        return rows

    def _decode_chunks(
        self, sequence: list[int], start: int, wanted: range, return_hidden: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        logits_parts: list[np.ndarray] = []
        hidden_parts: list[np.ndarray] = []
        for chunk in self._chunks(len(sequence)):
            rows = self._output_rows(chunk, wanted)
            self._decode([sequence[i] for i in chunk], [start + i for i in chunk], [0] * len(chunk),
                         [i in rows for i in chunk])
            kept = [r for r in rows if r in wanted]
            picks = [rows.index(r) for r in kept]
            if kept:
                logits_parts.append(self._read_logits(len(rows))[picks])
                if return_hidden:
                    hidden_parts.append(self._read_hidden(len(rows))[picks])
        logits = torch.from_numpy(np.concatenate(logits_parts))  # [keep, vocab]
        hidden = torch.from_numpy(np.concatenate(hidden_parts)) if return_hidden else None  # [keep, n_embd]
        return logits, hidden

    def _decode(self, tokens: Sequence[int], positions: Sequence[int], seqs: Sequence[int],
                outputs: Sequence[bool]) -> None:
        """One ``llama_decode`` over rows ``(token, position, sequence, logits wanted)`` (at most the batch
        capacity); the logits of the wanted rows are then :meth:`_read_logits`' rows, in row order."""
        batch = self._batch
        batch.n_tokens = len(tokens)
        for row, (token, position, seq, output) in enumerate(zip(tokens, positions, seqs, outputs)):
            batch.token[row] = token
            batch.pos[row] = position
            batch.n_seq_id[row] = 1
            batch.seq_id[row][0] = seq
            batch.logits[row] = 1 if output else 0
        status = _lib().llama_decode(self._ctx, batch)
        if status != 0:
            raise RuntimeError(f"{self.name}: llama_decode returned {status} for {len(tokens)} tokens at positions "
                               f"{min(positions)}..{max(positions)}")

    def _read_logits(self, rows: int) -> np.ndarray:
        """Copy the last decode's logits: ``[rows, vocab]`` float32."""
        pointer = _lib().llama_get_logits(self._ctx)
        return np.ctypeslib.as_array(pointer, shape=(rows, self.vocab_size)).copy()

    def _read_hidden(self, rows: int) -> np.ndarray:
        """Copy the last decode's final hidden states: ``[rows, n_embd]`` float32."""
        lib = _lib()
        width = int(lib.llama_model_n_embd(self.handle.ptr))
        pointer = lib.llama_get_embeddings(self._ctx)
        if not pointer:
            raise RuntimeError(f"{self.name}: llama.cpp returned no hidden states")
        return np.ctypeslib.as_array(pointer, shape=(rows, width)).copy()


class LlamaCppTokenizer:
    """The subset of a ``transformers`` tokenizer draftwise uses, over llama.cpp's own tokenizer.

    Token ids are llama.cpp's by construction (the model is fed exactly what its own tokenizer produces), no
    conversion to a ``transformers`` tokenizer is needed (minutes for a 150k-token vocabulary, and it fails for
    some GGUF vocabularies), and the chat template is the GGUF's, rendered with ``transformers``' Jinja
    renderer, so chat prompts match the PyTorch backend's.

    Args:
        model: the loaded model (shared with its backend).
    """

    def __init__(self, model: _ModelHandle) -> None:
        self._model = model
        lib = _lib()
        self.chat_template = model.chat_template()
        self.bos_token_id = _special(lib.llama_vocab_bos(model.vocab))
        self.eos_token_id = _special(lib.llama_vocab_eos(model.vocab))
        self.pad_token_id = _special(lib.llama_vocab_pad(model.vocab))
        self.add_bos_token = bool(lib.llama_vocab_get_add_bos(model.vocab))

    def __len__(self) -> int:
        return self._model.n_vocab

    @property
    def bos_token(self) -> str | None:
        return None if self.bos_token_id is None else self.convert_ids_to_tokens(self.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        return None if self.eos_token_id is None else self.convert_ids_to_tokens(self.eos_token_id)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Tokenize ``text``; special-token text (``<|im_start|>``) becomes its special id, and BOS is added
        when the model asks for it and ``add_special_tokens`` is True.

        Raises:
            RuntimeError: llama.cpp failed to tokenize.
        """
        lib = _lib()
        data = text.encode("utf-8")
        capacity = len(data) + 8
        for _ in range(2):
            buffer = (lib.llama_token * capacity)()
            count = lib.llama_tokenize(self._model.vocab, data, len(data), buffer, capacity, add_special_tokens, True)
            if count >= 0:
                return list(buffer[:count])
            capacity = -count
        raise RuntimeError(f"llama.cpp could not tokenize a text of {len(data)} bytes")

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Detokenize; with ``skip_special_tokens`` control tokens (BOS, EOS, ``<|im_end|>``) are dropped."""
        lib = _lib()
        ids = [int(t) for t in token_ids]
        if not ids:
            return ""
        tokens = (lib.llama_token * len(ids))(*ids)
        capacity = 8 * len(ids) + 16
        for _ in range(2):
            buffer = ctypes.create_string_buffer(capacity)
            count = lib.llama_detokenize(self._model.vocab, tokens, len(ids), buffer, capacity,
                                         skip_special_tokens, not skip_special_tokens)
            if count >= 0:
                return self._strip_bos_space(ids, buffer.raw[:count].decode("utf-8", "replace"))
            capacity = -count
        raise RuntimeError(f"llama.cpp could not detokenize {len(ids)} tokens")

    def _strip_bos_space(self, ids: list[int], text: str) -> str:
        """llama.cpp keeps the word-boundary space of the token after a BOS (SentencePiece vocabularies);
        ``transformers`` and llama-cpp-python's ``Llama.detokenize`` drop it."""
        if ids[0] == self.bos_token_id and text.startswith(" "):
            return text[1:]
        return text

    def convert_ids_to_tokens(self, ids: int | Sequence[int]) -> str | list[str]:
        """Token strings as stored in the GGUF table (``Ġ``/``▁`` forms, as ``transformers`` shows them)."""
        lib = _lib()
        if isinstance(ids, int):
            return lib.llama_vocab_get_text(self._model.vocab, ids).decode("utf-8", "replace")
        return [lib.llama_vocab_get_text(self._model.vocab, int(i)).decode("utf-8", "replace") for i in ids]

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = False, tokenize: bool = True, **kwargs
    ) -> str | list[int]:
        """Render ``messages`` with the GGUF chat template (Jinja, as ``transformers`` does) and, by default,
        tokenize the result without adding BOS again (the template writes its own special tokens).

        Raises:
            ValueError: the model has no chat template.
        """
        from transformers.utils.chat_template_utils import render_jinja_template

        if not self.chat_template:
            raise ValueError("this model has no chat template")
        specials = {"bos_token": self.bos_token or "", "eos_token": self.eos_token or ""}
        rendered, _ = render_jinja_template(conversations=[messages], chat_template=self.chat_template,
                                            add_generation_prompt=add_generation_prompt, **{**specials, **kwargs})
        text = rendered[0]
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def eog_token_ids(self) -> tuple[int, ...]:
        """Every id llama.cpp treats as end of generation (EOS, EOT, ``<|im_end|>`` ...), sorted."""
        lib = _lib()
        vocab = self._model.vocab
        return tuple(i for i in range(self._model.n_vocab) if lib.llama_vocab_is_eog(vocab, i))


def _special(token_id: int) -> int | None:
    """llama.cpp writes an unset special token as -1."""
    return None if token_id is None or int(token_id) < 0 else int(token_id)


def load_llama_cpp(
    path: str | Path,
    *,
    name: str | None = None,
    max_context: int | None = None,
    n_threads: int | None = None,
    flash_attention: bool = True,
    batch_invariant: bool = True,
    num_slots: int = 1,
):
    """Load a GGUF file for the llama.cpp backend: the backend, llama.cpp's tokenizer and its EOG ids
    (``num_slots``: sequences the context holds, see :class:`LlamaCppCausalLM`).

    Returns:
        ``(backend, tokenizer, eos_token_ids)``: the :class:`LlamaCppCausalLM`, its :class:`LlamaCppTokenizer` and
        the vocabulary's end-of-generation ids; :func:`draftwise.models.loading.load_model` wraps them in a
        ``LoadedModel`` (this module does not import the loading module: no import cycle).

    Raises:
        ImportError: llama-cpp-python is not installed.
        FileNotFoundError, ValueError: see :class:`LlamaCppCausalLM`.
    """
    handle = _ModelHandle(Path(path), repack=not batch_invariant)
    backend = LlamaCppCausalLM(path, name=name, max_context=max_context, n_threads=n_threads,
                               flash_attention=flash_attention, batch_invariant=batch_invariant, model=handle,
                               num_slots=num_slots)
    tokenizer = LlamaCppTokenizer(handle)
    logger.info("llama.cpp: loaded %s (%d tokens, context %d, %d threads, batch-invariant %s)", backend.name,
                backend.vocab_size, backend.max_context, backend.n_threads, batch_invariant)
    return backend, tokenizer, tuple(tokenizer.eog_token_ids())


#: GGUF file types :func:`requantize_gguf` writes (llama.cpp's ``LLAMA_FTYPE_MOSTLY_*`` names).
REQUANTIZE_TYPES = ("Q4_0", "Q8_0", "IQ4_NL")


def gguf_file_type(path: str | Path) -> int | None:
    """The ``general.file_type`` of a GGUF file (llama.cpp's ``LLAMA_FTYPE_*`` number: 2 for Q4_0, 15 for
    Q4_K_M), or None when the file does not say (all-F32 files often do not)."""
    import gguf

    field = gguf.GGUFReader(str(path)).fields.get("general.file_type")
    return None if field is None else int(field.parts[field.data[0]][0])


def copy_recipe(file_type: str, head_type: str | None = None) -> str:
    """How a re-quantized copy is named: ``"Q4_0"``, or ``"Q4_0-head-Q4_0"`` when its LM head has its own type
    (:func:`requantize_gguf`'s ``file_type`` and ``head_type``)."""
    return file_type if head_type is None else f"{file_type}-head-{head_type}"


def requantize_gguf(source: str | Path, destination: str | Path, file_type: str = "Q4_0",
                    threads: int | None = None, head_type: str | None = None) -> Path:
    """Write ``source``'s weights to ``destination`` as GGUF type ``file_type`` with llama.cpp's own quantizer
    (``llama_model_quantize``, re-quantizing already quantized tensors). For drafts: a draft's numerics only
    decide what is proposed, so a file type with faster kernels on this CPU may pay even where it costs some
    acceptance (measured in ``docs/draft_trees.md``: a Q4_0 copy of Qwen2.5-Coder-0.5B Q4_K_M decodes 1.5x
    faster on an AVX-512 EPYC, llama.cpp repacking Q4_0 for its GEMM kernels). The file appears whole or not at
    all (written beside it, then renamed).

    The LM head (``output.weight``) gets llama.cpp's own choice for ``file_type`` unless ``head_type`` says
    otherwise. For Q4_0 that choice was Q8_0 on the heads measured here (Qwen2.5-Coder-0.5B's 896 wide and
    stories260K's 64 wide; k-quants need widths that are multiples of 256), and the 0.5B's 151,936 x 896 Q8_0
    head is about 40% of the bytes its Q4_0 copy reads per token.

    Args:
        source: a GGUF file llama.cpp can load.
        destination: the file to write (its folder must exist).
        file_type: one of :data:`REQUANTIZE_TYPES`.
        threads: quantizer threads (default: every CPU this process may use).
        head_type: the LM head's type, one of :data:`REQUANTIZE_TYPES` (default: llama.cpp's choice).

    Returns:
        ``destination`` as a Path.

    Raises:
        ValueError: an unknown ``file_type`` or ``head_type``, or llama.cpp failed (status code in the message).
        FileNotFoundError: no file at ``source``.
    """
    for kind, value in (("file type", file_type), ("head type", head_type)):
        if value is not None and value not in REQUANTIZE_TYPES:
            raise ValueError(f"{kind} {value!r}: choose one of {', '.join(REQUANTIZE_TYPES)}")
    source, destination = Path(source), Path(destination)
    if not source.is_file():
        raise FileNotFoundError(f"GGUF file not found: {source}")
    lib = _lib()
    params = lib.llama_model_quantize_default_params()
    params.ftype = getattr(lib, f"LLAMA_FTYPE_MOSTLY_{file_type}")
    params.allow_requantize = True
    if head_type is not None:
        params.output_tensor_type = getattr(lib, f"GGML_TYPE_{head_type}")
    params.nthread = int(threads or default_threads())
    partial = destination.with_name(destination.name + f".partial-{os.getpid()}")
    try:
        status = lib.llama_model_quantize(str(source).encode(), str(partial).encode(), ctypes.byref(params))
        if status != 0 or not partial.is_file():
            raise ValueError(f"llama.cpp could not re-quantize {source} to {file_type} (status {status})")
        os.replace(partial, destination)
    finally:
        partial.unlink(missing_ok=True)
    return destination
