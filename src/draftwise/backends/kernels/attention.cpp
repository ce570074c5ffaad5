// Row-invariant attention of query rows over one slot of the lean runtime's KV cache, in the native extension
// beside the GGUF kernels (draftwise_native::attention).
//
// Each (row, KV head) is computed on its own, by one thread, over the row's keys in logical order: first the
// slot's entries [0, prefix) in place, then tail_len entries gathered by index (a draft tree's committed tail,
// ancestors and itself). For every one of its g = heads / kv_heads query heads:
//   s_j = <q, k_j> * scale        (16 fp32 lanes over head_dim, then one fixed lane tree)
//   m   = max_j s_j               (exact in any order)
//   p_j = exp(s_j - m)            (native_math.h's polynomial)
//   out = (sum_j p_j v_j) / sum_j p_j   (sums over j in increasing order; the denominator in 16 lanes)
// So a row's output depends only on its query, its keys' values and their logical order: not on the other rows
// of the pass, their number, the thread split, or where a key sits in the cache. A tree node therefore gets
// the bits the same token gets in a chain, and k verified rows the bits of one-token decoding: the exactness
// the Python block attention (lean/attention.py) reaches with fixed key blocks around batched GEMMs.
//
// The arithmetic is written as scalar loops the compiler vectorizes. It is built with -ffp-contract=off, so
// every operation is the written IEEE one, and a vector lane gives the bits of the scalar loop: a key's
// value does not depend on whether it falls in a full vector or the remainder.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "native_math.h"

namespace {

using namespace draftwise_native;

constexpr int64_t kMaxChunks = 16;  // head_dim up to 256 keeps a key in registers

template <class K>
struct Keys {
  const K* keys;  // [kv, capacity, d] (strides below), fp32 or fp16
  const K* values;
  int64_t head_stride_k, row_stride_k, head_stride_v, row_stride_v;
};

// sum_j p[t][j] v_j for the G query heads, in increasing j, 16 elements of d at a time (G accumulators kept in
// registers); the remainder of d lane by lane with the same multiply and add.
template <int G, class K>
void weighted_values(const K* v_head, int64_t row_stride, const int64_t* index, int64_t length,
                     const float* probs, int64_t padded, int64_t d, float* acc) {
  int64_t e = 0;
  for (; e + kLanes <= d; e += kLanes) {
    Vec sum[G] = {};
    for (int64_t j = 0; j < length; ++j) {
      const Vec value = load(v_head + index[j] * row_stride + e);
      for (int t = 0; t < G; ++t) sum[t] += probs[t * padded + j] * value;
    }
    for (int t = 0; t < G; ++t) store(acc + t * d + e, sum[t]);
  }
  for (; e < d; ++e)
    for (int t = 0; t < G; ++t) {
      float sum = 0.f;
      for (int64_t j = 0; j < length; ++j)
        sum += probs[t * padded + j] * static_cast<float>(v_head[index[j] * row_stride + e]);
      acc[t * d + e] = sum;
    }
}

template <class K>
void weighted_values_any(int64_t g, const K* v_head, int64_t row_stride, const int64_t* index, int64_t length,
                         const float* probs, int64_t padded, int64_t d, float* acc) {
  switch (g) {
    case 1: return weighted_values<1, K>(v_head, row_stride, index, length, probs, padded, d, acc);
    case 2: return weighted_values<2, K>(v_head, row_stride, index, length, probs, padded, d, acc);
    case 4: return weighted_values<4, K>(v_head, row_stride, index, length, probs, padded, d, acc);
    case 6: return weighted_values<6, K>(v_head, row_stride, index, length, probs, padded, d, acc);
    case 7: return weighted_values<7, K>(v_head, row_stride, index, length, probs, padded, d, acc);
    case 8: return weighted_values<8, K>(v_head, row_stride, index, length, probs, padded, d, acc);
    default:  // the same operations per head, one head at a time
      for (int64_t t = 0; t < g; ++t)
        weighted_values<1, K>(v_head, row_stride, index, length, probs + t * padded, padded, d, acc + t * d);
  }
}

// One (row, KV head): out[t] for its g query heads. scores: scratch of g * padded floats, acc: g * d.
template <class K>
void attend_one(const float* q, int64_t g, int64_t d, const Keys<K>& kv, int64_t head, const int64_t* index,
                int64_t length, float scale, float* scores, int64_t padded, float* acc, float* out) {
  const K* k_head = kv.keys + head * kv.head_stride_k;
  const K* v_head = kv.values + head * kv.head_stride_v;
  if (d % kLanes == 0 && d <= kMaxChunks * kLanes) {
    const int64_t chunks = d / kLanes;
    for (int64_t j = 0; j < length; ++j) {  // the key's chunks loaded once for the g heads: dot()'s operations
      const K* key = k_head + index[j] * kv.row_stride_k;
      Vec k[kMaxChunks];
      for (int64_t c = 0; c < chunks; ++c) k[c] = load(key + c * kLanes);
      for (int64_t t = 0; t < g; ++t) {
        Vec acc = {};
        for (int64_t c = 0; c < chunks; ++c) acc += load(q + t * d + c * kLanes) * k[c];
        scores[t * padded + j] = lane_sum(acc) * scale;
      }
    }
  } else {
    for (int64_t j = 0; j < length; ++j) {
      const K* key = k_head + index[j] * kv.row_stride_k;
      for (int64_t t = 0; t < g; ++t) scores[t * padded + j] = dot(q + t * d, key, d) * scale;
    }
  }
  for (int64_t t = 0; t < g; ++t) {
    float* s = scores + t * padded;
    float top = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < length; ++j) top = std::max(top, s[j]);
    for (int64_t j = 0; j < length; ++j) s[j] = exp_clamped(s[j] - top);
    for (int64_t j = length; j < padded; ++j) s[j] = 0.f;
  }
  weighted_values_any(g, v_head, kv.row_stride_v, index, length, scores, padded, d, acc);
  for (int64_t t = 0; t < g; ++t) {
    const float* s = scores + t * padded;
    Vec lanes = {};
    for (int64_t j = 0; j < padded; j += kLanes) lanes += load(s + j);
    const float denominator = lane_sum(lanes);
    for (int64_t e = 0; e < d; ++e) out[t * d + e] = acc[t * d + e] / denominator;
  }
}

// q [n, heads, d] fp32; keys, values [kv, capacity, d] fp32 or fp16 (one slot of one layer; fp16 is widened
// exactly); prefix [n], tail_len [n]
// int64; tail [n, T] int64 cache entries. Returns [n, heads, d].
at::Tensor attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& prefix,
                     const at::Tensor& tail, const at::Tensor& tail_len, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat, "attention: q must be [n, heads, d] float32");
  TORCH_CHECK(keys.dim() == 3 && values.dim() == 3 && keys.scalar_type() == values.scalar_type() &&
              (keys.scalar_type() == at::kFloat || keys.scalar_type() == at::kHalf),
              "attention: keys and values must be [kv, capacity, d], both float32 or both float16");
  TORCH_CHECK(keys.sizes() == values.sizes(), "attention: keys and values differ in shape");
  TORCH_CHECK(keys.stride(2) == 1 && values.stride(2) == 1, "attention: keys and values need unit stride in d");
  const at::Tensor qc = q.contiguous();
  const int64_t n = qc.size(0), heads = qc.size(1), d = qc.size(2);
  const int64_t kv_heads = keys.size(0), capacity = keys.size(1);
  TORCH_CHECK(keys.size(2) == d, "attention: head_dim ", keys.size(2), " of the keys, ", d, " of q");
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, "attention: ", heads, " heads over ", kv_heads, " KV heads");
  TORCH_CHECK(prefix.numel() == n && tail_len.numel() == n && tail.dim() == 2 && tail.size(0) == n,
              "attention: prefix, tail_len [n] and tail [n, T] must match q's ", n, " rows");
  const at::Tensor pre = prefix.to(at::kLong).contiguous(), tl = tail_len.to(at::kLong).contiguous();
  const at::Tensor tc = tail.to(at::kLong).contiguous();
  const int64_t width = tc.size(1);
  const int64_t* pre_p = pre.data_ptr<int64_t>();
  const int64_t* tl_p = tl.data_ptr<int64_t>();
  const int64_t* tail_p = tc.data_ptr<int64_t>();
  int64_t longest = 0;
  for (int64_t r = 0; r < n; ++r) {
    TORCH_CHECK(pre_p[r] >= 0 && pre_p[r] <= capacity && tl_p[r] >= 0 && tl_p[r] <= width,
                "attention: row ", r, " has prefix ", pre_p[r], " and tail ", tl_p[r], " (capacity ", capacity, ")");
    TORCH_CHECK(pre_p[r] + tl_p[r] > 0, "attention: row ", r, " sees no key");
    for (int64_t j = 0; j < tl_p[r]; ++j)
      TORCH_CHECK(tail_p[r * width + j] >= 0 && tail_p[r * width + j] < capacity, "attention: tail entry out of range");
    longest = std::max(longest, pre_p[r] + tl_p[r]);
  }
  at::Tensor out = at::empty({n, heads, d}, qc.options());
  if (n == 0) return out;
  const float* qp = qc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t g = heads / kv_heads;
  const float scale_f = static_cast<float>(scale);
  const int64_t padded_max = (longest + kLanes - 1) / kLanes * kLanes;
  auto run = [&](auto kv) {
    at::parallel_for(0, n * kv_heads, 1, [&](int64_t begin, int64_t end) {
      std::vector<int64_t> index(longest);
      std::vector<float> scores(g * padded_max), acc(g * d);
      for (int64_t item = begin; item < end; ++item) {
        const int64_t r = item / kv_heads, head = item % kv_heads;
        const int64_t length = pre_p[r] + tl_p[r];
        for (int64_t j = 0; j < pre_p[r]; ++j) index[j] = j;
        for (int64_t j = 0; j < tl_p[r]; ++j) index[pre_p[r] + j] = tail_p[r * width + j];
        const int64_t padded = (length + kLanes - 1) / kLanes * kLanes;
        attend_one(qp + (r * heads + head * g) * d, g, d, kv, head, index.data(), length, scale_f, scores.data(),
                   padded, acc.data(), op + (r * heads + head * g) * d);
      }
    });
  };
  if (keys.scalar_type() == at::kHalf) {
    run(Keys<c10::Half>{keys.data_ptr<c10::Half>(), values.data_ptr<c10::Half>(), keys.stride(0), keys.stride(1),
                        values.stride(0), values.stride(1)});
  } else {
    run(Keys<float>{keys.data_ptr<float>(), values.data_ptr<float>(), keys.stride(0), keys.stride(1), values.stride(0),
                    values.stride(1)});
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(draftwise_native, lib) {
  lib.def("attention(Tensor q, Tensor keys, Tensor values, Tensor prefix, Tensor tail, Tensor tail_len, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(draftwise_native, CPU, lib) {
  lib.impl("attention", &attention);
}
