// Row-invariant 4-bit linear layer: weights in Q4_K super-blocks (GGUF's format, repacked with decoded
// scales), activations quantized per row to int8 in blocks of 256, integer dot products, fp32 accumulation
// in one fixed order per output element.
//
// Written for draftwise from the GGUF Q4_K format description (ggml's k-quants: 256-weight super-blocks
// of 8 sub-blocks of 32, a 6-bit scale and min per sub-block, fp16 super-scales d and dmin; w = d*sc*q -
// dmin*m). The arithmetic follows the k-quant dot product (activations as int8 with a float scale per 256
// and integer sums per 32) so that it reads as many bytes per weight as llama.cpp does.
//
// Row invariance by construction: y[r, n] depends only on x[r, :] and weight row n. The activation row is
// quantized on its own; each super-block's integer dot product is exact; the float accumulation over
// super-blocks, the 8-lane horizontal sum, the min correction and the bias are added in an order that
// depends on neither the number of rows in the call, nor the row's position, nor the thread split (threads
// split the output features, never a reduction).
//
// Packed weight layout: one uint8 tensor [out, nb * 152] (nb = in_features / 256) in two planes, so that
// every 32-byte load of quants is aligned:
//   bytes [0, out*nb*128):          qs[out][nb][128]; qs[32*j + l]: low nibble = quant of sub-block 2j at l,
//                                   high nibble = sub-block 2j+1 at l (GGUF order)
//   bytes [out*nb*128, out*nb*152): meta[out][nb] = {float d; float dmin; uint8 sc[8]; uint8 mn[8]}

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kSuper = 256;  // weights per super-block
constexpr int64_t kBlockBytes = 152;  // 128 bytes of quants + 24 of meta
constexpr int kRowTile = 8;
constexpr int64_t kPrefetchRows = 16;  // weight rows ahead of the pair being computed  // activation rows computed together against one unpacked weight super-block

struct Meta {
  float d;
  float dmin;
  uint8_t sc[8];
  uint8_t mn[8];
};
static_assert(sizeof(Meta) == 24, "packed Q4_K meta must be 24 bytes");

// One weight row: its nb super-blocks' quants (128 bytes each, 32-byte aligned) and meta.
struct WeightRow {
  const uint8_t* qs;
  const Meta* meta;
};

// One activation row quantized: q [in] int8, d [nb] float, bsum [nb * 8] int16 (sum of q per 32).
struct ActRows {
  const int8_t* q;
  const float* d;
  const int16_t* bsum;
  int64_t in;
  int64_t nb;
};

// Quantize rows [r0, r1) of x [m, in] to int8 per 256-block: d = amax / 127, q = round-half-even(x * (127 /
// amax)) clamped to [-127, 127]. The same fp32 operations on every path (the max is exact in any order, the
// product is one IEEE multiply, the rounding is to nearest even), so the bits do not depend on the
// instruction set.
void quantize_block(const float* xb, int8_t* qb, float* d, int16_t* bsum) {
#if defined(__AVX2__)
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 vmax = _mm256_setzero_ps();
  for (int i = 0; i < kSuper; i += 8) vmax = _mm256_max_ps(vmax, _mm256_andnot_ps(sign, _mm256_loadu_ps(xb + i)));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  const float amax = _mm_cvtss_f32(m4);
#else
  float amax = 0.f;
  for (int i = 0; i < kSuper; ++i) amax = std::fmax(amax, std::fabs(xb[i]));
#endif
  *d = amax / 127.f;
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
#if defined(__AVX2__)
  const __m256 vinv = _mm256_set1_ps(inv), hi = _mm256_set1_ps(127.f), lo = _mm256_set1_ps(-127.f);
  for (int i = 0; i < kSuper; i += 32) {
    __m256i v[4];
    for (int k = 0; k < 4; ++k) {
      __m256 y = _mm256_mul_ps(_mm256_loadu_ps(xb + i + 8 * k), vinv);
      y = _mm256_round_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      v[k] = _mm256_cvtps_epi32(_mm256_min_ps(hi, _mm256_max_ps(lo, y)));
    }
    // pack 32 int32 -> 32 int8 in order (packs work per 128-bit lane: fix the order with a permute)
    const __m256i w01 = _mm256_packs_epi32(v[0], v[1]), w23 = _mm256_packs_epi32(v[2], v[3]);
    const __m256i b = _mm256_packs_epi16(w01, w23);
    const __m256i ordered = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb + i), ordered);
  }
#else
  for (int i = 0; i < kSuper; ++i) {
    float v = std::nearbyint(xb[i] * inv);
    v = std::fmin(127.f, std::fmax(-127.f, v));
    qb[i] = static_cast<int8_t>(v);
  }
#endif
  for (int j = 0; j < 8; ++j) {
    int sum = 0;
    for (int i = 0; i < 32; ++i) sum += qb[j * 32 + i];
    bsum[j] = static_cast<int16_t>(sum);
  }
}

void quantize_rows(const float* x, int64_t r0, int64_t r1, int64_t in, int8_t* q, float* d, int16_t* bsum) {
  const int64_t nb = in / kSuper;
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t b = 0; b < nb; ++b)
      quantize_block(x + r * in + b * kSuper, q + r * in + b * kSuper, d + r * nb + b, bsum + (r * nb + b) * 8);
}

#if defined(__AVX2__)
inline float hsum8(__m256 v) {
  const __m128 lo = _mm256_castps256_ps128(v);
  const __m128 hi = _mm256_extractf128_ps(v, 1);
  __m128 s = _mm_add_ps(lo, hi);                 // 4 lanes: (0+4, 1+5, 2+6, 3+7)
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));        // (0+4)+(2+6), (1+5)+(3+7)
  s = _mm_add_ss(s, _mm_movehdup_ps(s));         // + the second
  return _mm_cvtss_f32(s);
}

inline float hsum4(__m128 s) {
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Rows rows[0..T) of the activations against U weight rows w[u] (nb blocks each): out[u * T + t] = <x_t, w_u>
// before bias. Per super-block and sub-block, U unpacked weight vectors meet T activation vectors in T x U
// products (maddubs: u8 quants x s8 activations -> s16 pairs; madd with the sub-block scale -> s32), so each
// load serves several products; the min correction sum_j mn_j * bsum_j is one madd per row and weight row,
// kept in lane-wise fp32 accumulators (one horizontal sum at the end). Every (t, u) result is computed by
// the same operations in the same order whatever T and U are.
template <int T, int U>
void dot_rows(const WeightRow* w, const ActRows& a, const int64_t* rows, float* out) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  // byte shuffles that broadcast 16-bit scale j of 8 to every 16-bit lane
  alignas(32) static const uint8_t kPick[8][32] = {
#define DW_PICK(j) {2*j, 2*j+1, 2*j, 2*j+1, 2*j, 2*j+1, 2*j, 2*j+1, 2*j, 2*j+1, 2*j, 2*j+1, 2*j, 2*j+1, 2*j, 2*j+1, \
                    2*j, 2*j+1, 2*j, 2*j+1, 2*j, 2*j+1, 2*j, 2*j+1, 2*j, 2*j+1, 2*j, 2*j+1, 2*j, 2*j+1, 2*j, 2*j+1}
      DW_PICK(0), DW_PICK(1), DW_PICK(2), DW_PICK(3), DW_PICK(4), DW_PICK(5), DW_PICK(6), DW_PICK(7)};
#undef DW_PICK
  const int8_t* qrow[T];
  const float* drow[T];
  const int16_t* brow[T];
  __m256 facc[U][T];
  __m128 macc[U][T];
  for (int t = 0; t < T; ++t) {
    qrow[t] = a.q + rows[t] * a.in;
    drow[t] = a.d + rows[t] * a.nb;
    brow[t] = a.bsum + rows[t] * a.nb * 8;
    for (int u = 0; u < U; ++u) {
      facc[u][t] = _mm256_setzero_ps();
      macc[u][t] = _mm_setzero_ps();
    }
  }
  for (int64_t b = 0; b < a.nb; ++b) {
    __m256i iacc[U][T];
    __m256i scales[U];
    const __m256i* qs[U];
    for (int u = 0; u < U; ++u) {
      for (int t = 0; t < T; ++t) iacc[u][t] = _mm256_setzero_si256();
      scales[u] = _mm256_broadcastsi128_si256(
          _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w[u].meta[b].sc))));
      qs[u] = reinterpret_cast<const __m256i*>(w[u].qs + b * 128);
    }
    for (int j = 0; j < 8; ++j) {
      const __m256i pick = _mm256_load_si256(reinterpret_cast<const __m256i*>(kPick[j]));
      __m256i wq[U], ws[U];
      for (int u = 0; u < U; ++u) {
        const __m256i bits = _mm256_load_si256(qs[u] + (j >> 1));
        wq[u] = _mm256_and_si256((j & 1) ? _mm256_srli_epi16(bits, 4) : bits, low4);
        ws[u] = _mm256_shuffle_epi8(scales[u], pick);
      }
      for (int t = 0; t < T; ++t) {
        const __m256i act = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qrow[t] + b * kSuper + 32 * j));
        for (int u = 0; u < U; ++u)
          iacc[u][t] = _mm256_add_epi32(iacc[u][t], _mm256_madd_epi16(_mm256_maddubs_epi16(wq[u], act), ws[u]));
      }
    }
    for (int u = 0; u < U; ++u) {
      const Meta& meta = w[u].meta[b];
      const __m128i mins = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(meta.mn)));
      for (int t = 0; t < T; ++t) {
        const float da = drow[t][b];
        facc[u][t] = _mm256_fmadd_ps(_mm256_set1_ps(meta.d * da), _mm256_cvtepi32_ps(iacc[u][t]), facc[u][t]);
        const __m128i bs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(brow[t] + b * 8));
        macc[u][t] = _mm_fmadd_ps(_mm_set1_ps(meta.dmin * da), _mm_cvtepi32_ps(_mm_madd_epi16(mins, bs)),
                                  macc[u][t]);
      }
    }
  }
  for (int u = 0; u < U; ++u)
    for (int t = 0; t < T; ++t) out[u * T + t] = hsum8(facc[u][t]) - hsum4(macc[u][t]);
}
#else
// Portable path: the same integer sums; fp32 accumulation per super-block in a fixed order.
template <int T, int U>
void dot_rows(const WeightRow* w, const ActRows& a, const int64_t* rows, float* out) {
  for (int u = 0; u < U; ++u) {
    for (int t = 0; t < T; ++t) {
      float facc = 0.f, macc = 0.f;
      for (int64_t b = 0; b < a.nb; ++b) {
        const Meta& blk = w[u].meta[b];
        const uint8_t* qs = w[u].qs + b * 128;
        const int8_t* q = a.q + rows[t] * a.in + b * kSuper;
        int isum = 0;
        for (int j = 0; j < 4; ++j) {
          int lo = 0, hi = 0;
          for (int l = 0; l < 32; ++l) {
            lo += (qs[32 * j + l] & 0x0F) * q[64 * j + l];
            hi += (qs[32 * j + l] >> 4) * q[64 * j + 32 + l];
          }
          isum += blk.sc[2 * j] * lo + blk.sc[2 * j + 1] * hi;
        }
        const int64_t ab = rows[t] * a.nb + b;
        int msum = 0;
        for (int j = 0; j < 8; ++j) msum += blk.mn[j] * a.bsum[ab * 8 + j];
        facc = std::fma(blk.d * a.d[ab], static_cast<float>(isum), facc);
        macc = std::fma(blk.dmin * a.d[ab], static_cast<float>(msum), macc);
      }
      out[u * T + t] = facc - macc;
    }
  }
}
#endif

template <int U>
void dot_tile(const WeightRow* w, const ActRows& a, const int64_t* rows, int count, float* out) {
  switch (count) {
    case 8: dot_rows<8, U>(w, a, rows, out); break;
    case 7: dot_rows<7, U>(w, a, rows, out); break;
    case 6: dot_rows<6, U>(w, a, rows, out); break;
    case 5: dot_rows<5, U>(w, a, rows, out); break;
    case 4: dot_rows<4, U>(w, a, rows, out); break;
    case 3: dot_rows<3, U>(w, a, rows, out); break;
    case 2: dot_rows<2, U>(w, a, rows, out); break;
    default: dot_rows<1, U>(w, a, rows, out); break;
  }
}

at::Tensor q4k_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "q4k_linear: x must be [m, in] float32");
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kByte, "q4k_linear: packed must be [out, bytes] uint8");
  const at::Tensor xc = x.contiguous();
  const int64_t m = xc.size(0), in = xc.size(1), out_features = packed.size(0);
  TORCH_CHECK(in % kSuper == 0, "q4k_linear: in_features must be a multiple of 256, got ", in);
  const int64_t nb = in / kSuper;
  TORCH_CHECK(packed.size(1) == nb * kBlockBytes, "q4k_linear: packed rows hold ", packed.size(1),
              " bytes, expected ", nb * kBlockBytes, " for ", in, " inputs");
  TORCH_CHECK(packed.is_contiguous(), "q4k_linear: packed must be contiguous");
  const bool has_bias = bias.numel() > 0;
  TORCH_CHECK(!has_bias || (bias.scalar_type() == at::kFloat && bias.numel() == out_features),
              "q4k_linear: bias must be [out] float32 or empty");
  const at::Tensor bias_c = has_bias ? bias.contiguous() : bias;

  at::Tensor q = at::empty({m, in}, x.options().dtype(at::kChar));
  at::Tensor d = at::empty({m, nb}, x.options());
  at::Tensor bsum = at::empty({m, nb * 8}, x.options().dtype(at::kShort));
  at::Tensor y = at::empty({m, out_features}, x.options());
  const float* xp = xc.data_ptr<float>();
  int8_t* qp = q.data_ptr<int8_t>();
  float* dp = d.data_ptr<float>();
  int16_t* bp = bsum.data_ptr<int16_t>();
  at::parallel_for(0, m, 16, [&](int64_t r0, int64_t r1) { quantize_rows(xp, r0, r1, in, qp, dp, bp); });

  const ActRows act{qp, dp, bp, in, nb};
  const uint8_t* qs_plane = packed.data_ptr<uint8_t>();
  TORCH_CHECK(reinterpret_cast<uintptr_t>(qs_plane) % 32 == 0, "q4k_linear: packed must be 32-byte aligned");
  const Meta* meta_plane = reinterpret_cast<const Meta*>(qs_plane + out_features * nb * 128);
  const float* biasp = has_bias ? bias_c.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  // activation rows per pass over a chunk of weight rows: about 128 KiB of int8 activations (cache-resident)
  const int64_t row_chunk = std::max<int64_t>(kRowTile, (131072 / in) / kRowTile * kRowTile);
  // up to 4 rows: pairs of weight rows against 4 activation rows (each load serves more products); from 5
  // rows on: one weight row against up to 8 (the 2 x 8 accumulators would not fit in 16 registers)
  const int pair_rows = m <= 4 ? 2 : 1;
  const int64_t row_tile = m <= 4 ? 4 : kRowTile;
  at::parallel_for(0, out_features, 16, [&](int64_t n0, int64_t n1) {
    int64_t rows[kRowTile];
    float tile[2 * kRowTile];
    for (int64_t r0 = 0; r0 < m; r0 += row_chunk) {
      const int64_t r1 = std::min(m, r0 + row_chunk);
      for (int64_t n = n0; n < n1; n += pair_rows) {
        const int pair = n + 1 < n1 ? pair_rows : 1;
#if defined(__AVX2__)
        // software prefetch of the weight rows kPrefetchRows ahead (the hardware prefetcher alone reads DRAM
        // at about a third of its bandwidth here: measured 5 against 15 GB/s on one Zen3 core)
        if (n + kPrefetchRows + pair <= n1) {
          const uint8_t* ahead = qs_plane + (n + kPrefetchRows) * nb * 128;
          for (int64_t off = 0; off < pair * nb * 128; off += 64) {
            _mm_prefetch(reinterpret_cast<const char*>(ahead + off), _MM_HINT_T0);
          }
          const char* meta_ahead = reinterpret_cast<const char*>(meta_plane + (n + kPrefetchRows) * nb);
          for (int64_t off = 0; off < pair * nb * 24; off += 64) _mm_prefetch(meta_ahead + off, _MM_HINT_T0);
        }
#endif
        const int64_t n1w = n + pair - 1;
        const WeightRow w[2] = {{qs_plane + n * nb * 128, meta_plane + n * nb},
                                {qs_plane + n1w * nb * 128, meta_plane + n1w * nb}};
        for (int64_t r = r0; r < r1; r += row_tile) {
          const int count = static_cast<int>(std::min<int64_t>(row_tile, r1 - r));
          for (int t = 0; t < count; ++t) rows[t] = r + t;
          if (pair == 2) {
            dot_tile<2>(w, act, rows, count, tile);
          } else {
            dot_tile<1>(w, act, rows, count, tile);
          }
          for (int u = 0; u < pair; ++u) {
            const float b = has_bias ? biasp[n + u] : 0.f;
            for (int t = 0; t < count; ++t) yp[(r + t) * out_features + n + u] = tile[u * count + t] + b;
          }
        }
      }
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY(draftwise_q4k, lib) {
  lib.def("linear(Tensor x, Tensor packed, Tensor bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(draftwise_q4k, CPU, lib) {
  lib.impl("linear", &q4k_linear);
}
