"""GGUF variants of a test model (fewer layers, a swapped or longer token table), written with the ``gguf``
package for the llama.cpp tests."""

from __future__ import annotations

import numpy as np


def write_gguf_variant(source, target, *, layers: int | None = None, swap_tokens: tuple[int, int] | None = None,
                       extra_tokens: int = 0) -> None:
    """Copy a llama GGUF file, keeping its first ``layers`` blocks, swapping two token strings, or appending
    ``extra_tokens`` tokens (with zero embedding and output rows)."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    reader = GGUFReader(str(source))
    writer = GGUFWriter(str(target), arch="llama")
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = field.contents()
        if key == "llama.block_count" and layers is not None:
            value = layers
        if key == "tokenizer.ggml.tokens":
            value = list(value)
            if swap_tokens:
                a, b = swap_tokens
                value[a], value[b] = value[b], value[a]
            value += [f"<extra{i}>" for i in range(extra_tokens)]
        elif key == "tokenizer.ggml.scores":
            value = list(value) + [0.0] * extra_tokens
        elif key == "tokenizer.ggml.token_type":
            value = list(value) + [1] * extra_tokens
        types = field.types
        writer.add_key_value(key, value, types[0], types[1] if types[0] == GGUFValueType.ARRAY else None)
    for tensor in reader.tensors:
        if layers is not None and tensor.name.startswith("blk.") and int(tensor.name.split(".")[1]) >= layers:
            continue
        data = np.array(tensor.data)
        if extra_tokens and tensor.name in ("token_embd.weight", "output.weight"):
            data = np.concatenate([data, np.zeros((extra_tokens, data.shape[1]), dtype=data.dtype)])
        writer.add_tensor(tensor.name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
