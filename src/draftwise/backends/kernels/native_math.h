// Arithmetic shared by the lean runtime's native operations (attention.cpp, lean_ops.cpp): 16 fp32 lanes as a
// GCC vector, exact fp16 widening, one fixed lane-sum tree, a lane-wise dot product and a polynomial exp. Built
// with -ffp-contract=off, every operation is the written IEEE one, so a vector lane gives the scalar loop's bits.
#pragma once

#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace draftwise_native {

constexpr int64_t kLanes = 16;
typedef float Vec __attribute__((vector_size(kLanes * sizeof(float))));  // 16 fp32 lanes (GCC vector extension)

inline Vec load(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof(Vec));
  return v;
}

inline void store(float* p, Vec v) { std::memcpy(p, &v, sizeof(Vec)); }

// 16 cached fp16 values as fp32 (exact: every half is a float), by F16C where the CPU has it.
inline Vec load(const c10::Half* p) {
#if defined(__AVX512F__)
  const __m512 wide = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  Vec v;
  std::memcpy(&v, &wide, sizeof(Vec));
  return v;
#elif defined(__F16C__)
  float out[kLanes];
  _mm256_storeu_ps(out, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  _mm256_storeu_ps(out + 8, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8))));
  return load(out);
#else
  float out[kLanes];
  for (int64_t l = 0; l < kLanes; ++l) out[l] = static_cast<float>(p[l]);
  return load(out);
#endif
}

// acc[0] + ... + acc[15] as the fixed tree ((l + 8) then (l + 4), (l + 2), (l + 1)), by vector shuffles.
inline float lane_sum(Vec v) {
  v += __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  v += __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  return v[0];
}

// <a, b> over n floats: lane l accumulates the products of elements l, l + 16, ... (a multiply, then an add),
// then one fixed tree over the lanes.
template <class K>
inline float dot(const float* a, const K* b, int64_t n) {
  Vec acc = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) acc += load(a + i) * load(b + i);
  for (int64_t l = 0; i + l < n; ++l) acc[l] += a[i + l] * static_cast<float>(b[i + l]);
  return lane_sum(acc);
}

// exp(x) for x in [-87, 88] (clamped: the float range's normal ends, so exp(-87) ~ 1.6e-38 stands for 0),
// Cephes' expf: x = n ln2 + r, |r| <= ln2 / 2, a degree-6 polynomial in r times 2^n. Only +, -, * and exact
// conversions: the same bits in every lane and on every build.
inline float exp_clamped(float x) {
  x = std::min(std::max(x, -87.f), 88.f);
  const float n = (x * 1.44269504088896341f + 12582912.f) - 12582912.f;  // round to nearest: |x log2 e| < 2^22
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * (r * r) + r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, 4);
  return y * two_n;
}

}  // namespace draftwise_native
