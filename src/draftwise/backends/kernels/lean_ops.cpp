// The lean runtime's per-row operations between its linear layers, in the native extension
// (draftwise_native::rms_norm, rope_write, silu_mul): one call each instead of several ATen ops.
//
// Each output row is computed from its own input row only, in one fixed order (reductions in 16 lanes and one
// fixed tree), so the results do not depend on the other rows of the pass or on the thread split (threads take
// whole rows). Built with -ffp-contract=off: every operation is the written IEEE one, so a vector lane gives
// the scalar loop's bits.
//   rms_norm:   y = (x * (1 / sqrt(sum(x^2) / H + eps))) * w        (the sum as native_math.h's dot(x, x))          (transformers' LlamaRMSNorm in fp32)
//   rope_write: rotary embedding (rotate-half: x * cos + rotate(x) * sin, the same operations as the torch path
//               of lean/model.py, so the same bits) of the query and key heads of a fused qkv row; the keys and
//               values are written into the slot cache, the queries returned
//   silu_mul:   silu(gate) * up = gate / (1 + exp(-gate)) * up, over a fused [gate | up] row

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "native_math.h"

namespace {

using namespace draftwise_native;

constexpr int64_t kRowGrain = 4;  // rows per thread task

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "rms_norm: x must be [n, H] float32");
  TORCH_CHECK(weight.dim() == 1 && weight.scalar_type() == at::kFloat && weight.size(0) == x.size(1),
              "rms_norm: weight must be [H] float32");
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous();
  const int64_t n = xc.size(0), width = xc.size(1);
  at::Tensor y = at::empty({n, width}, xc.options());
  const float* xp = xc.data_ptr<float>();
  const float* wp = wc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const float epsilon = static_cast<float>(eps), inv_width = 1.f / static_cast<float>(width);
  at::parallel_for(0, n, kRowGrain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* row = xp + r * width;
      const float inv = 1.f / std::sqrt(dot(row, row, width) * inv_width + epsilon);  // lane-wise sum of squares
      float* out = yp + r * width;
      for (int64_t i = 0; i < width; ++i) out[i] = (row[i] * inv) * wp[i];
    }
  });
  return y;
}

// One head (d floats) rotated into out: out_i = x_i cos_i + (-x_{i+d/2}) sin_i for i < d/2, else
// x_i cos_i + x_{i-d/2} sin_i.
inline void rotate_head(const float* x, const float* cos, const float* sin, int64_t d, float* out) {
  const int64_t half = d / 2;
  for (int64_t i = 0; i < half; ++i) out[i] = x[i] * cos[i] + (-x[i + half]) * sin[i];
  for (int64_t i = half; i < d; ++i) out[i] = x[i] * cos[i] + x[i - half] * sin[i];
}

// qkv [n, (heads + 2 kv) d]: the query heads, then the key heads, then the value heads of each row; cos, sin
// [n, d]; keys, values [slots, kv, capacity, d] fp32 or fp16 (one layer's cache); slots, index [n]. Returns
// q [n, heads, d].
at::Tensor rope_write(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& keys,
                      const at::Tensor& values, const at::Tensor& slots, const at::Tensor& index, int64_t heads,
                      int64_t kv_heads) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.scalar_type() == at::kFloat, "rope_write: qkv must be [n, width] float32");
  TORCH_CHECK(keys.dim() == 4 && values.sizes() == keys.sizes() && keys.scalar_type() == values.scalar_type() &&
              (keys.scalar_type() == at::kFloat || keys.scalar_type() == at::kHalf) && keys.stride(3) == 1 &&
              values.stride(3) == 1,
              "rope_write: keys and values must be [slots, kv, capacity, d], float32 or float16, unit stride in d");
  const int64_t n = qkv.size(0), d = keys.size(3), capacity = keys.size(2);
  TORCH_CHECK(keys.size(1) == kv_heads && qkv.size(1) == (heads + 2 * kv_heads) * d && d % 2 == 0,
              "rope_write: qkv width ", qkv.size(1), " is not (", heads, " + 2 x ", kv_heads, ") heads of ", d);
  TORCH_CHECK(cos.dim() == 2 && sin.dim() == 2 && cos.size(0) == n && sin.size(0) == n && cos.size(1) == d &&
              sin.size(1) == d && cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat,
              "rope_write: cos and sin must be [n, d] float32");
  TORCH_CHECK(slots.numel() == n && index.numel() == n, "rope_write: slots and index must be [n]");
  const at::Tensor qc = qkv.contiguous(), cc = cos.contiguous(), sc = sin.contiguous();
  const at::Tensor sl = slots.to(at::kLong).contiguous(), ix = index.to(at::kLong).contiguous();
  const int64_t* slp = sl.data_ptr<int64_t>();
  const int64_t* ixp = ix.data_ptr<int64_t>();
  for (int64_t r = 0; r < n; ++r)
    TORCH_CHECK(slp[r] >= 0 && slp[r] < keys.size(0) && ixp[r] >= 0 && ixp[r] < capacity,
                "rope_write: row ", r, " writes slot ", slp[r], " entry ", ixp[r], " outside the cache");
  at::Tensor q = at::empty({n, heads, d}, qc.options());
  const float* xp = qc.data_ptr<float>();
  const float* cp = cc.data_ptr<float>();
  const float* sp = sc.data_ptr<float>();
  float* qp = q.data_ptr<float>();
  const bool half = keys.scalar_type() == at::kHalf;
  const int64_t width = qc.size(1);
  at::parallel_for(0, n, kRowGrain, [&](int64_t r0, int64_t r1) {
    std::vector<float> rotated(d);
    for (int64_t r = r0; r < r1; ++r) {
      const float* row = xp + r * width;
      const float* c = cp + r * d;
      const float* s = sp + r * d;
      for (int64_t h = 0; h < heads; ++h) rotate_head(row + h * d, c, s, d, qp + (r * heads + h) * d);
      for (int64_t h = 0; h < kv_heads; ++h) {
        const int64_t key_at = slp[r] * keys.stride(0) + h * keys.stride(1) + ixp[r] * keys.stride(2);
        const int64_t value_at = slp[r] * values.stride(0) + h * values.stride(1) + ixp[r] * values.stride(2);
        const float* value = row + (heads + kv_heads + h) * d;
        rotate_head(row + (heads + h) * d, c, s, d, rotated.data());
        if (half) {  // rounded to nearest even (c10::Half's software conversion: the same bits on every CPU)
          c10::Half* key = keys.data_ptr<c10::Half>() + key_at;
          c10::Half* out = values.data_ptr<c10::Half>() + value_at;
          for (int64_t i = 0; i < d; ++i) key[i] = c10::Half(rotated[i]);
          for (int64_t i = 0; i < d; ++i) out[i] = c10::Half(value[i]);
        } else {
          std::memcpy(keys.data_ptr<float>() + key_at, rotated.data(), d * sizeof(float));
          std::memcpy(values.data_ptr<float>() + value_at, value, d * sizeof(float));
        }
      }
    }
  });
  return q;
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.scalar_type() == at::kFloat && gate_up.size(1) % 2 == 0,
              "silu_mul: gate_up must be [n, 2 I] float32");
  const at::Tensor gc = gate_up.contiguous();
  const int64_t n = gc.size(0), width = gc.size(1) / 2;
  at::Tensor y = at::empty({n, width}, gc.options());
  const float* gp = gc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, n, kRowGrain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* gate = gp + r * 2 * width;
      const float* up = gate + width;
      float* out = yp + r * width;
      for (int64_t i = 0; i < width; ++i) out[i] = gate[i] / (1.f + exp_clamped(-gate[i])) * up[i];
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(draftwise_native, lib) {
  lib.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  lib.def("rope_write(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) keys, Tensor(b!) values, Tensor slots, "
          "Tensor index, int heads, int kv_heads) -> Tensor");
  lib.def("silu_mul(Tensor gate_up) -> Tensor");
}

TORCH_LIBRARY_IMPL(draftwise_native, CPU, lib) {
  lib.impl("rms_norm", &rms_norm);
  lib.impl("rope_write", &rope_write);
  lib.impl("silu_mul", &silu_mul);
}
