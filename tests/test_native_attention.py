"""The native attention of the lean runtime (kernels/attention.cpp): close to the torch block attention, and bit
for bit the same row whatever the other rows of the call and wherever its keys sit in the cache."""

from __future__ import annotations

import pytest
import torch

from draftwise.backends.lean.attention import block_attention, native_attention, native_attention_available

pytestmark = pytest.mark.skipif(native_attention_available() is not None,
                                reason=f"native extension unavailable: {native_attention_available()}")

SCALE = 0.125


def _cache(kv_heads: int, capacity: int, head_dim: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(kv_heads, capacity, head_dim, generator=generator),
            torch.randn(kv_heads, capacity, head_dim, generator=generator))


def _chain(query, keys, values, context):
    n = query.shape[0]
    return native_attention(query, keys, values, context, torch.zeros(n, 0, dtype=torch.long),
                            torch.zeros(n, dtype=torch.long), scale=SCALE)


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "length"), [(12, 2, 128, 201), (4, 2, 12, 70), (6, 6, 20, 17)])
def test_native_attention_is_close_to_the_block_attention(heads, kv_heads, head_dim, length):
    n = 5
    capacity = -(-length // 64) * 64
    keys, values = _cache(kv_heads, capacity, head_dim)
    query = torch.randn(n, heads, head_dim, generator=torch.Generator().manual_seed(1))
    context = torch.arange(length - n + 1, length + 1)
    visible = torch.arange(capacity)[None] < context[:, None]
    expected = block_attention(query, keys, values, visible, scale=SCALE, block=64, multiple=4)
    torch.testing.assert_close(_chain(query, keys, values, context), expected, rtol=1e-5, atol=1e-6)


def test_a_row_gets_the_same_bits_alone_in_a_chain_and_as_a_tree_node():
    """A row's output depends on its keys in logical order only: alone, among 9 rows, and with its last keys
    gathered from other cache entries (a draft tree's tail) it is the same, bit for bit."""
    heads, kv_heads, head_dim, n, start = 6, 2, 32, 9, 150
    keys, values = _cache(kv_heads, 256, head_dim)
    query = torch.randn(n, heads, head_dim, generator=torch.Generator().manual_seed(2))
    context = torch.arange(start + 1, start + n + 1)
    together = _chain(query, keys, values, context)
    alone = torch.cat([_chain(query[r:r + 1], keys, values, context[r:r + 1]) for r in range(n)])
    assert torch.equal(together, alone)
    # the same keys: odd rows read entries [128, start + r] from copies at [200, ...), through a tail after 128
    moved_keys, moved_values = keys.clone(), values.clone()
    moved_keys[:, 200:232], moved_values[:, 200:232] = keys[:, 128:160], values[:, 128:160]
    tails = [torch.arange(200, 72 + int(context[r])) if r % 2 else torch.arange(128, int(context[r])) for r in range(n)]
    width = max(len(t) for t in tails)
    tail = torch.zeros(n, width, dtype=torch.long)
    for r, t in enumerate(tails):
        tail[r, : len(t)] = t
    tail_len = torch.tensor([len(t) for t in tails])
    as_tree = native_attention(query, moved_keys, moved_values, torch.full((n,), 128), tail, tail_len, scale=SCALE)
    assert torch.equal(as_tree, together)


def test_bad_keys_are_errors_not_reads_outside_the_cache():
    keys, values = _cache(2, 64, 16)
    query = torch.randn(1, 4, 16)
    with pytest.raises(RuntimeError, match="tail entry out of range"):
        native_attention(query, keys, values, torch.tensor([3]), torch.tensor([[64]]), torch.tensor([1]), scale=SCALE)
    with pytest.raises(RuntimeError, match="capacity"):
        _chain(query, keys, values, torch.tensor([65]))
    with pytest.raises(RuntimeError, match="sees no key"):
        _chain(query, keys, values, torch.tensor([0]))
    with pytest.raises(RuntimeError, match="heads"):
        _chain(torch.randn(1, 3, 16), keys, values, torch.tensor([5]))


def test_native_rms_norm_and_silu_gate_are_close_to_torch_and_row_invariant():
    from torch.nn import functional as F

    ops = torch.ops.draftwise_native
    x = torch.randn(9, 1536, generator=torch.Generator().manual_seed(3))
    weight = torch.randn(1536, generator=torch.Generator().manual_seed(4))
    normed = ops.rms_norm(x, weight, 1e-6)
    torch.testing.assert_close(normed, F.rms_norm(x, (1536,), weight, 1e-6), rtol=1e-5, atol=1e-5)
    assert torch.equal(torch.cat([ops.rms_norm(x[r:r + 1], weight, 1e-6) for r in range(9)]), normed)
    gate_up = torch.randn(9, 2 * 700, generator=torch.Generator().manual_seed(5)) * 8
    gated = ops.silu_mul(gate_up)
    torch.testing.assert_close(gated, F.silu(gate_up[:, :700]) * gate_up[:, 700:], rtol=1e-5, atol=1e-5)
    assert torch.equal(torch.cat([ops.silu_mul(gate_up[r:r + 1]) for r in range(9)]), gated)


def test_native_rotary_gives_the_torch_rotation_bits_and_writes_the_cache():
    from draftwise.backends.lean.model import _rotate

    heads, kv_heads, d, n = 6, 2, 16, 5
    qkv = torch.randn(n, (heads + 2 * kv_heads) * d, generator=torch.Generator().manual_seed(6))
    cos, sin = torch.randn(n, d), torch.randn(n, d)
    keys, values = torch.zeros(3, kv_heads, 64, d), torch.zeros(3, kv_heads, 64, d)
    slots, index = torch.tensor([2, 2, 0, 1, 2]), torch.tensor([7, 8, 3, 63, 9])
    q = torch.ops.draftwise_native.rope_write(qkv, cos, sin, keys, values, slots, index, heads, kv_heads)
    rotated = _rotate(qkv[:, : (heads + kv_heads) * d].view(n, heads + kv_heads, d), cos[:, None], sin[:, None])
    assert torch.equal(q, rotated[:, :heads])
    assert torch.equal(keys[slots, :, index], rotated[:, heads:])
    assert torch.equal(values[slots, :, index], qkv[:, (heads + kv_heads) * d:].view(n, kv_heads, d))
    with pytest.raises(RuntimeError, match="outside the cache"):
        torch.ops.draftwise_native.rope_write(qkv, cos, sin, keys, values, slots, index + 60, heads, kv_heads)


def test_an_fp16_cache_is_read_exactly_and_written_rounded_to_nearest():
    """The native path's fp16 KV cache: attention over fp16 entries gives the bits it gives over the same values
    widened to fp32, and rope_write stores the rotation rounded to nearest (torch's ``.half()``)."""
    keys, values = _cache(2, 128, 32)
    keys16, values16 = keys.half(), values.half()
    query = torch.randn(4, 6, 32, generator=torch.Generator().manual_seed(7))
    context = torch.tensor([90, 91, 92, 93])
    assert torch.equal(_chain(query, keys16, values16, context), _chain(query, keys16.float(), values16.float(), context))
    with pytest.raises(RuntimeError, match="both float32 or both float16"):
        _chain(query, keys16, values, context)

    from draftwise.backends.lean.model import _rotate

    heads, kv_heads, d, n = 6, 2, 32, 3
    qkv = torch.randn(n, (heads + 2 * kv_heads) * d, generator=torch.Generator().manual_seed(8)) * 30
    cos, sin = torch.randn(n, d), torch.randn(n, d)
    cache_k, cache_v = torch.zeros(1, kv_heads, 16, d, dtype=torch.half), torch.zeros(1, kv_heads, 16, d, dtype=torch.half)
    slots, index = torch.zeros(n, dtype=torch.long), torch.tensor([4, 5, 6])
    torch.ops.draftwise_native.rope_write(qkv, cos, sin, cache_k, cache_v, slots, index, heads, kv_heads)
    rotated = _rotate(qkv[:, : (heads + kv_heads) * d].view(n, heads + kv_heads, d), cos[:, None], sin[:, None])
    assert torch.equal(cache_k[0, :, 4:7].transpose(0, 1), rotated[:, heads:].half())
    assert torch.equal(cache_v[0, :, 4:7].transpose(0, 1), qkv[:, (heads + kv_heads) * d:].view(n, kv_heads, d).half())
