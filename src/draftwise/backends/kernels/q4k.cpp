// Row-invariant linear layers on GGUF's quantized weights (Q4_K, Q6_K, Q8_0, Q5_0): activations quantized
// per row to int8 per block, integer dot products, fp32 accumulation in one fixed order per output element.
//
// Written for draftwise from the GGUF block formats (ggml's ggml-common.h / ggml-quants.c, dequantize_row_*):
//   Q4_K: 256-weight super-blocks of 8 sub-blocks of 32, a 6-bit scale and min per sub-block, fp16 d and
//         dmin; w = d*sc*q - dmin*m, q in 0..15. Repacked here with decoded scales (see the layout below).
//   Q6_K: 256 weights {ql[128] low nibbles, qh[64] 2 high bits, int8 scales[16] (one per 16), fp16 d};
//         w = d*sc*(q - 32), q in 0..63. 210 bytes, regrouped 8 rows at a time (see the layout below).
//   Q8_0: 32 weights {fp16 d, int8 q[32]}; w = d*q. 34 bytes, regrouped (see the layout below).
//   Q5_0: 32 weights {fp16 d, uint32 qh (5th bits), qs[16] (low nibble: weight j, high: j + 16)};
//         w = d*(q - 16), q in 0..31. 22 bytes, regrouped.
// Paths: AVX-512 with VNNI (64-byte vectors), AVX2 (32-byte halves of the same layout; with AVX512-VL VNNI,
// vpdpbusd in place of maddubs + madd: the same integers) and portable; every path of a format gives the same bits.
// The arithmetic follows ggml's dot products (activations as int8 with a float scale per 256 for the k-quants,
// per 32 for Q8_0/Q5_0, integer sums inside a block), so it reads as many bytes per weight as llama.cpp does.
//
// Row invariance by construction: y[r, n] depends only on x[r, :] and weight row n. The activation row is
// quantized on its own; each block's integer dot product is exact; the float accumulation over blocks, the
// horizontal sum (the row formats), the min correction and the bias are added in an order that depends on
// neither the number of rows in the call, nor the row's position, nor the thread split (threads split the output
// features, never a reduction). Each weight block loaded serves up to 8 activation rows of the call.
//
// Packed Q4_K layout: one uint8 tensor [out, nb * 152] (nb = in_features / 256), 32-byte aligned, in groups of
// 8 weight rows (the last group holds out % 8 rows when that is not 0). A group of R rows is nb super-blocks of
// 152 * R bytes each:
//   quants [jp 4][k 4][r R][i 8]: low nibble = quant 8k+i of sub-block 2jp of row r, high nibble = sub-block
//                                 2jp+1 (GGUF's pairing of sub-blocks, 8 weights of each row side by side)
//   sc [s 8][r R], mn [sp 4][r R][2] (mins of sub-blocks 2sp, 2sp+1): the decoded 6-bit scales and mins, bytes
//   d [r R], dmin [r R]: fp32
// so one 64-byte load gives 8 weights of each of 8 rows, and each row's sums stay in lanes of their own.
// Packed Q6_K layout: [out, nb * 210] uint8, 64-byte aligned, the file's bytes regrouped in groups of 8 rows
// (the last may hold fewer): a quant plane (192 bytes per row and super-block), then a meta plane (18). A group of
// R rows has nb quant super-blocks of 192 * R bytes: the low nibbles of sub-blocks 0/1 (low/high nibble), the
// high 2-bit pairs of sub-blocks 0-3 (bits 2c, 2c+1: sub-block c), low nibbles of 2/3, of 4/5, high bits of 4-7,
// low nibbles of 6/7, each part [k 4][r R][i 8] (weight 8k+i of the sub-block); and nb meta blocks of sc [sp 8]
// [r R][2] (int8 scales of the 16-weight halves 2sp, 2sp+1) and d [r R] fp16.
// Packed Q8_0 and Q5_0: [out, nb * block bytes] uint8, 64-byte aligned, in planes, each in groups of 8 rows (the
// last may hold fewer): Q8_0 quants [k 4][r R][i 8] as q + 128 (32 bytes per row and block), then d [r R] fp16 (2);
// Q5_0 nibbles [j 2][r R][i 8] (low: weight 8j+i, high: 16+8j+i; 16 bytes), fifth bits [k 4][r R][i 8] one bit
// each, little-endian (4), then d (2).

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

// Always inlined, as is every format's prefetch(): GCC marks an out-of-line function whose only effect is
// __builtin_prefetch as const and deletes its calls (C++ assumes loops finish), which had removed the Q4_K
// prefetch from the build.
#define DW_ALWAYS_INLINE inline __attribute__((always_inline))

constexpr int kRowTile = 8;  // activation rows computed together against one unpacked weight block

// One set of activation rows quantized: q [m, in] int8, d [m, nb] float (one scale per block of `block`
// inputs), bsum [m, nb * sums] int16 (sums of q over `block / sums` consecutive inputs; none when sums is 0).
struct ActRows {
  const int8_t* q;
  const float* d;
  const int16_t* bsum;
  int64_t in;
  int64_t nb;
  int64_t sums;
};

// fp16 -> fp32 (exact: every half is a float).
inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu, mant = h & 0x3FFu;
  float f;
  if (exp == 0) {
    f = std::ldexp(static_cast<float>(mant), -24);
    return sign ? -f : f;
  }
  const uint32_t bits = exp == 31 ? (sign | 0x7F800000u | (mant << 13)) : (sign | ((exp + 112) << 23) | (mant << 13));
  std::memcpy(&f, &bits, 4);
  return f;
#endif
}

// Quantize one block of `len` (a multiple of 32) inputs to int8: d = amax / 127, q = round-half-even(x *
// (127 / amax)) clamped to [-127, 127], and `sums` sums of q over equal spans. The same fp32 operations on
// every path (the max is exact in any order, the product is one IEEE multiply, the rounding is to nearest
// even), so the bits do not depend on the instruction set.
void quantize_block(const float* xb, int64_t len, int64_t sums, int8_t* qb, float* d, int16_t* bsum) {
#if defined(__AVX2__)
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 vmax = _mm256_setzero_ps();
  for (int64_t i = 0; i < len; i += 8) vmax = _mm256_max_ps(vmax, _mm256_andnot_ps(sign, _mm256_loadu_ps(xb + i)));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  const float amax = _mm_cvtss_f32(m4);
#else
  float amax = 0.f;
  for (int64_t i = 0; i < len; ++i) amax = std::fmax(amax, std::fabs(xb[i]));
#endif
  *d = amax / 127.f;
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
#if defined(__AVX2__)
  const __m256 vinv = _mm256_set1_ps(inv), hi = _mm256_set1_ps(127.f), lo = _mm256_set1_ps(-127.f);
  for (int64_t i = 0; i < len; i += 32) {
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
  for (int64_t i = 0; i < len; ++i) {
    float v = std::nearbyint(xb[i] * inv);
    v = std::fmin(127.f, std::fmax(-127.f, v));
    qb[i] = static_cast<int8_t>(v);
  }
#endif
  if (sums == 0) return;
  const int64_t span = len / sums;
  for (int64_t j = 0; j < sums; ++j) {
    int sum = 0;
    for (int64_t i = 0; i < span; ++i) sum += qb[j * span + i];
    bsum[j] = static_cast<int16_t>(sum);
  }
}

void quantize_rows(const float* x, int64_t r0, int64_t r1, int64_t in, int64_t block, int64_t sums, int8_t* q,
                   float* d, int16_t* bsum) {
  const int64_t nb = in / block;
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t b = 0; b < nb; ++b)
      quantize_block(x + r * in + b * block, block, sums, q + r * in + b * block, d + r * nb + b,
                     bsum + (r * nb + b) * sums);
}

#if defined(__AVX2__)
// acc + the int32 sums of 4 adjacent u8 x s8 products in each lane (the same integers on both paths: the
// callers' maddubs pair sums do not saturate)
DW_ALWAYS_INLINE __m256i dpbusd(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, u, s);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

// Rows 0-3 and 4-7 as two vectors of lane pairs (2r, 2r + 1 hold row r's two partial sums) -> 8 lanes, row r's
// two sums added, in row order.
DW_ALWAYS_INLINE __m256i pair_lanes(__m256i rows03, __m256i rows47) {
  const __m256i p0 = _mm256_add_epi32(rows03, _mm256_srli_epi64(rows03, 32));
  const __m256i p1 = _mm256_add_epi32(rows47, _mm256_srli_epi64(rows47, 32));
  // the even lanes: rows [0 1 4 5 | 2 3 6 7], then in order
  const __m256i mixed = _mm256_castps_si256(
      _mm256_shuffle_ps(_mm256_castsi256_ps(p0), _mm256_castsi256_ps(p1), _MM_SHUFFLE(2, 0, 2, 0)));
  return _mm256_permute4x64_epi64(mixed, _MM_SHUFFLE(3, 1, 2, 0));
}
#endif

DW_ALWAYS_INLINE void prefetch_bytes(const uint8_t* p, int64_t bytes) {
#if defined(__AVX2__)
  for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(reinterpret_cast<const char*>(p + off), _MM_HINT_T0);
#else
  (void)p;
  (void)bytes;
#endif
}

// ------------------------------------------------------------------------------------------------- formats
// A format F gives: kWeights (weights per block, = inputs per activation block), kSums (activation sums per
// block), kRowBytes (packed bytes per block and weight row), kGroup (rows per group), kName, Group and group()
// (a group's pointers in the packed weight), dot_rows(group, R, a, rows, count, out) for any R rows, and with
// AVX2 dot<T>(group, next, a, rows, out) for a full group: out[t * R + r] = <x_rows[t], w_r> before bias, by the
// same operations in the same order on every path and whatever T is.

struct Q4K {
  static constexpr int64_t kWeights = 256;
  static constexpr int64_t kSums = 8;
  static constexpr int64_t kRowBytes = 152;  // per weight row and super-block: 128 bytes of quants + 24 of meta
  static constexpr int kGroup = 8;           // weight rows interleaved per group
  static constexpr const char* kName = "q4k_linear";

  // Offsets inside one group's super-block of R rows (152 * R bytes): quants [jp 4][k 4][r R][i 8], then
  // sc [s 8][r R], mn [sp 4][r R][2], d [r R] fp32, dmin [r R] fp32.
  static constexpr int64_t sc_at(int R) { return 128 * R; }
  static constexpr int64_t mn_at(int R) { return 136 * R; }
  static constexpr int64_t d_at(int R) { return 144 * R; }
  static constexpr int64_t dmin_at(int R) { return 148 * R; }

  struct Group {
    const uint8_t* q;  // the group's nb super-blocks
  };
  static Group group(const uint8_t* base, int64_t, int64_t nb, int64_t g) { return {base + g * nb * kRowBytes * kGroup}; }

  // Any R (a group's last rows, and every group without AVX2): y[t * R + r] for each row, by the integer sums
  // and the fp32 operations of the vector path, in the same order, so the bits are the same.
  static void dot_rows(Group grp, int R, const ActRows& a, const int64_t* rows, int count, float* out) {
    const int64_t bytes = kRowBytes * R;
    for (int t = 0; t < count; ++t) {
      const int8_t* q = a.q + rows[t] * a.in;
      for (int r = 0; r < R; ++r) {
        float facc = 0.f, macc = 0.f;
        for (int64_t b = 0; b < a.nb; ++b) {
          const uint8_t* blk = grp.q + b * bytes;
          const int8_t* qb = q + b * kWeights;
          int32_t isum = 0, msum = 0;
          for (int s = 0; s < 8; ++s) {
            int32_t sub = 0;
            for (int k = 0; k < 4; ++k)
              for (int i = 0; i < 8; ++i) {
                const uint8_t byte = blk[(4 * (s / 2) + k) * 8 * R + 8 * r + i];
                sub += ((s & 1) ? byte >> 4 : byte & 0x0F) * qb[32 * s + 8 * k + i];
              }
            isum += blk[sc_at(R) + s * R + r] * sub;
            msum += blk[mn_at(R) + (s / 2) * 2 * R + 2 * r + (s & 1)] * a.bsum[(rows[t] * a.nb + b) * kSums + s];
          }
          float dw, dmw;
          std::memcpy(&dw, blk + d_at(R) + 4 * r, 4);
          std::memcpy(&dmw, blk + dmin_at(R) + 4 * r, 4);
          const float da = a.d[rows[t] * a.nb + b];
          facc = std::fma(dw * da, static_cast<float>(isum), facc);
          macc = std::fma(dmw * da, static_cast<float>(msum), macc);
        }
        out[t * R + r] = facc - macc;
      }
    }
  }

#if defined(__AVX512F__) && defined(__AVX512VNNI__)
  // A full group of 8 weight rows against T activation rows: out[t * 8 + r]. One 64-byte load holds 8
  // consecutive weights of each of 8 rows for two sub-blocks (low and high nibbles, the high ones masked in
  // place as 16 * q); a vpdpbusd against 8 activation bytes broadcast gives each row's two sums of 4 products in
  // lanes 2r and 2r + 1, so the sub-block scales apply lane-wise (each row's scale in both of its lanes) and the
  // two lanes are added once per super-block; the mins, d and dmin then apply per row lane. No horizontal sum.
  // `next`: the group to prefetch a super-block at a time (null: none).
  template <int T>
  static void dot(Group grp, Group next, const ActRows& a, const int64_t* rows, float* out) {
    constexpr int64_t bytes = kRowBytes * kGroup;
    const __m512i low4 = _mm512_set1_epi8(0x0F), high4 = _mm512_set1_epi8(static_cast<char>(0xF0));
    const int8_t* qrow[T];
    const float* drow[T];
    const int16_t* brow[T];
    __m256 facc[T], macc[T];
    for (int t = 0; t < T; ++t) {
      qrow[t] = a.q + rows[t] * a.in;
      drow[t] = a.d + rows[t] * a.nb;
      brow[t] = a.bsum + rows[t] * a.nb * kSums;
      facc[t] = _mm256_setzero_ps();
      macc[t] = _mm256_setzero_ps();
    }
    for (int64_t b = 0; b < a.nb; ++b) {
      const uint8_t* blk = grp.q + b * bytes;
      if (next.q) prefetch_bytes(next.q + b * bytes, bytes);
      __m512i isum[T];  // lanes 2r, 2r + 1: row r
      for (int t = 0; t < T; ++t) isum[t] = _mm512_setzero_si512();
      for (int jp = 0; jp < 4; ++jp) {
        __m512i lo[4], hi[4];
        for (int k = 0; k < 4; ++k) {
          const __m512i v = _mm512_load_si512(reinterpret_cast<const void*>(blk + 256 * jp + 64 * k));
          lo[k] = _mm512_and_si512(v, low4);
          hi[k] = _mm512_and_si512(v, high4);
        }
        // each row's two scales as a 16-bit pair (sub-block 2jp low, 2jp + 1 high), in both of its lanes
        const __m128i pairs = _mm_unpacklo_epi8(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + sc_at(8) + 16 * jp)),
                                                _mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + sc_at(8) + 16 * jp + 8)));
        const __m512i scales = _mm512_cvtepu8_epi16(
            _mm256_set_m128i(_mm_unpackhi_epi16(pairs, pairs), _mm_unpacklo_epi16(pairs, pairs)));
        for (int t = 0; t < T; ++t) {
          int64_t a_lo[4], a_hi[4];  // 8 activation bytes at a time: sub-block 2jp, then 2jp + 1
          std::memcpy(a_lo, qrow[t] + b * kWeights + 64 * jp, 32);
          std::memcpy(a_hi, qrow[t] + b * kWeights + 64 * jp + 32, 32);
          const __m512i zero = _mm512_setzero_si512();
          __m512i l0 = _mm512_dpbusd_epi32(zero, lo[0], _mm512_set1_epi64(a_lo[0]));
          __m512i h0 = _mm512_dpbusd_epi32(zero, hi[0], _mm512_set1_epi64(a_hi[0]));
          __m512i l1 = _mm512_dpbusd_epi32(zero, lo[1], _mm512_set1_epi64(a_lo[1]));
          __m512i h1 = _mm512_dpbusd_epi32(zero, hi[1], _mm512_set1_epi64(a_hi[1]));
          l0 = _mm512_dpbusd_epi32(l0, lo[2], _mm512_set1_epi64(a_lo[2]));
          h0 = _mm512_dpbusd_epi32(h0, hi[2], _mm512_set1_epi64(a_hi[2]));
          l1 = _mm512_dpbusd_epi32(l1, lo[3], _mm512_set1_epi64(a_lo[3]));
          h1 = _mm512_dpbusd_epi32(h1, hi[3], _mm512_set1_epi64(a_hi[3]));
          // the low sums (|l| <= 4 * 4 * 15 * 127 < 2^15) in each lane's low 16 bits, the high ones (16 * h,
          // shifted by 12: h * 2^16) in its high 16 bits, then one vpmaddwd: l * sc_lo + h * sc_hi, exactly
          const __m512i l = _mm512_add_epi32(l0, l1);
          const __m512i h = _mm512_slli_epi32(_mm512_add_epi32(h0, h1), 12);
          isum[t] = _mm512_add_epi32(isum[t], _mm512_madd_epi16(_mm512_mask_blend_epi16(0xAAAAAAAA, l, h), scales));
        }
      }
      __m256i rowsum[T];  // each row's two lanes added: lane 2r + (lane 2r + 1), packed to 8 lanes
      for (int t = 0; t < T; ++t)
        rowsum[t] = _mm512_cvtepi64_epi32(_mm512_add_epi32(isum[t], _mm512_srli_epi64(isum[t], 32)));
      finish_block<T>(blk, b, drow, brow, rowsum, facc, macc);
    }
    for (int t = 0; t < T; ++t) _mm256_storeu_ps(out + kGroup * t, _mm256_sub_ps(facc[t], macc[t]));
  }
#elif defined(__AVX2__)
  // The AVX2 path of the same layout: each 64-byte chunk as two 32-byte halves (rows 0-3, rows 4-7), the
  // high nibbles shifted down (maddubs would saturate on 16 * q), the same integers and fp32 operations.
  template <int T>
  static void dot(Group grp, Group next, const ActRows& a, const int64_t* rows, float* out) {
    constexpr int64_t bytes = kRowBytes * kGroup;
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    const __m128i twice = _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    const int8_t* qrow[T];
    const float* drow[T];
    const int16_t* brow[T];
    __m256 facc[T], macc[T];
    for (int t = 0; t < T; ++t) {
      qrow[t] = a.q + rows[t] * a.in;
      drow[t] = a.d + rows[t] * a.nb;
      brow[t] = a.bsum + rows[t] * a.nb * kSums;
      facc[t] = _mm256_setzero_ps();
      macc[t] = _mm256_setzero_ps();
    }
    for (int64_t b = 0; b < a.nb; ++b) {
      const uint8_t* blk = grp.q + b * bytes;
      if (next.q) prefetch_bytes(next.q + b * bytes, bytes);
      __m256i isum[T][2];  // half e: rows 4e..4e+3, lanes 2r', 2r' + 1
      for (int t = 0; t < T; ++t) isum[t][0] = isum[t][1] = _mm256_setzero_si256();
      for (int jp = 0; jp < 4; ++jp) {
        const __m128i sl = _mm_shuffle_epi8(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + sc_at(8) + 16 * jp)), twice);
        const __m128i sh = _mm_shuffle_epi8(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + sc_at(8) + 16 * jp + 8)), twice);
        const __m256i sc_lo[2] = {_mm256_cvtepu8_epi32(sl), _mm256_cvtepu8_epi32(_mm_srli_si128(sl, 8))};
        const __m256i sc_hi[2] = {_mm256_cvtepu8_epi32(sh), _mm256_cvtepu8_epi32(_mm_srli_si128(sh, 8))};
        for (int e = 0; e < 2; ++e) {
          __m256i lo[4], hi[4];
          for (int k = 0; k < 4; ++k) {
            const __m256i v = _mm256_load_si256(reinterpret_cast<const __m256i*>(blk + 256 * jp + 64 * k + 32 * e));
            lo[k] = _mm256_and_si256(v, low4);
            hi[k] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
          }
          for (int t = 0; t < T; ++t) {
            int64_t a_lo[4], a_hi[4];
            std::memcpy(a_lo, qrow[t] + b * kWeights + 64 * jp, 32);
            std::memcpy(a_hi, qrow[t] + b * kWeights + 64 * jp + 32, 32);
            __m256i l0 = _mm256_setzero_si256(), l1 = l0, h0 = l0, h1 = l0;
            for (int k = 0; k < 4; k += 2) {
              l0 = dpbusd(l0, lo[k], _mm256_set1_epi64x(a_lo[k]));
              h0 = dpbusd(h0, hi[k], _mm256_set1_epi64x(a_hi[k]));
              l1 = dpbusd(l1, lo[k + 1], _mm256_set1_epi64x(a_lo[k + 1]));
              h1 = dpbusd(h1, hi[k + 1], _mm256_set1_epi64x(a_hi[k + 1]));
            }
            const __m256i l = _mm256_add_epi32(l0, l1), h = _mm256_add_epi32(h0, h1);
            isum[t][e] = _mm256_add_epi32(isum[t][e], _mm256_add_epi32(_mm256_mullo_epi32(l, sc_lo[e]),
                                                                        _mm256_mullo_epi32(h, sc_hi[e])));
          }
        }
      }
      __m256i rowsum[T];
      for (int t = 0; t < T; ++t) rowsum[t] = pair_lanes(isum[t][0], isum[t][1]);
      finish_block<T>(blk, b, drow, brow, rowsum, facc, macc);
    }
    for (int t = 0; t < T; ++t) _mm256_storeu_ps(out + kGroup * t, _mm256_sub_ps(facc[t], macc[t]));
  }
#endif

#if defined(__AVX2__)
  // A super-block's end for each activation row: the rows' exact integer sums (8 lanes) times d * d_a, and the
  // min correction (each row's mins against the activation sums, in pairs) times dmin * d_a, accumulated in fp32.
  template <int T>
  DW_ALWAYS_INLINE static void finish_block(const uint8_t* blk, int64_t b, const float* const* drow,
                                            const int16_t* const* brow, const __m256i* rowsum, __m256* facc,
                                            __m256* macc) {
    const __m256 dw = _mm256_loadu_ps(reinterpret_cast<const float*>(blk + d_at(8)));
    const __m256 dmw = _mm256_loadu_ps(reinterpret_cast<const float*>(blk + dmin_at(8)));
    __m256i mn[4];
    for (int sp = 0; sp < 4; ++sp)
      mn[sp] = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + mn_at(8) + 16 * sp)));
    for (int t = 0; t < T; ++t) {
      int32_t bs[4];  // the activation sums in pairs (sub-blocks 2sp, 2sp + 1), against each row's two mins
      std::memcpy(bs, brow[t] + b * kSums, 16);
      __m256i ms = _mm256_madd_epi16(mn[0], _mm256_set1_epi32(bs[0]));
      for (int sp = 1; sp < 4; ++sp) ms = _mm256_add_epi32(ms, _mm256_madd_epi16(mn[sp], _mm256_set1_epi32(bs[sp])));
      const __m256 da = _mm256_set1_ps(drow[t][b]);
      facc[t] = _mm256_fmadd_ps(_mm256_mul_ps(dw, da), _mm256_cvtepi32_ps(rowsum[t]), facc[t]);
      macc[t] = _mm256_fmadd_ps(_mm256_mul_ps(dmw, da), _mm256_cvtepi32_ps(ms), macc[t]);
    }
  }
#endif
};

struct Q6K {
  static constexpr int64_t kWeights = 256;
  static constexpr int64_t kSums = 16;  // one activation sum per 16: the -32 offset times each scale
  static constexpr int64_t kRowBytes = 210;
  static constexpr int kGroup = 8;
  static constexpr int64_t kQuantBytes = 192;  // per row and super-block; the other 18 are scales and d
  static constexpr const char* kName = "q6k_linear";

  // Per group of R rows (see the layout at the top): nb super-blocks of quants (192 * R bytes each) in the quant
  // plane, nb of scales and d (18 * R bytes each) in the meta plane. A quant super-block, in reading order:
  // low nibbles of sub-blocks 0/1 (as low/high nibble), the high bits of sub-blocks 0-3, low nibbles of 2/3, of
  // 4/5, the high bits of 4-7, low nibbles of 6/7; each part [k 4][r R][i 8] (weight 8k + i of the sub-block).
  static constexpr int64_t ql_at(int R, int p) { return R * (p == 0 ? 0 : p == 1 ? 64 : p == 2 ? 96 : 160); }
  static constexpr int64_t qh_at(int R, int h) { return R * (h == 0 ? 32 : 128); }

  struct Group {
    const uint8_t* q;     // nb quant super-blocks
    const uint8_t* meta;  // nb of {sc [sp 8][r R][2] int8 (the scales of halves 2sp, 2sp + 1), d [r R] fp16}
  };
  static Group group(const uint8_t* base, int64_t out, int64_t nb, int64_t g) {
    return {base + g * kGroup * nb * kQuantBytes, base + out * nb * kQuantBytes + g * kGroup * nb * (kRowBytes - kQuantBytes)};
  }

  // quant (0..63) of weight e (0..255) of row r in a quant super-block of R rows
  static int quant(const uint8_t* q, int R, int r, int e) {
    const int sub = e / 32, k = (e % 32) / 8, i = e % 8;
    const uint8_t ql = q[ql_at(R, sub / 2) + k * 8 * R + 8 * r + i];
    const uint8_t qh = q[qh_at(R, sub / 4) + k * 8 * R + 8 * r + i];
    return ((sub & 1) ? ql >> 4 : ql & 0x0F) | (((qh >> (2 * (sub % 4))) & 3) << 4);
  }

  // Any R: y[t * R + r], the vector paths' integers and fp32 operations, so the same bits.
  static void dot_rows(Group grp, int R, const ActRows& a, const int64_t* rows, int count, float* out) {
    for (int t = 0; t < count; ++t) {
      const int8_t* x = a.q + rows[t] * a.in;
      for (int r = 0; r < R; ++r) {
        float facc = 0.f;
        for (int64_t b = 0; b < a.nb; ++b) {
          const uint8_t* q = grp.q + b * kQuantBytes * R;
          const uint8_t* meta = grp.meta + b * (kRowBytes - kQuantBytes) * R;
          const int8_t* xb = x + b * kWeights;
          const int16_t* bs = a.bsum + (rows[t] * a.nb + b) * kSums;
          int32_t isum = 0, offset = 0;
          for (int half = 0; half < 16; ++half) {
            int32_t sub = 0;
            for (int e = 16 * half; e < 16 * half + 16; ++e) sub += quant(q, R, r, e) * xb[e];
            const int32_t sc = static_cast<int8_t>(meta[(half / 2) * 2 * R + 2 * r + (half & 1)]);
            isum += sc * sub;
            offset += sc * bs[half];
          }
          const float dw = half_to_float(meta + 16 * R + 2 * r);
          facc = std::fma(dw * a.d[rows[t] * a.nb + b], static_cast<float>(isum - 32 * offset), facc);
        }
        out[t * R + r] = facc;
      }
    }
  }

#if defined(__AVX2__)
  // A super-block's end for each activation row: the rows' exact sums (8 lanes) less 32 times each row's scales
  // against the activation sums (the -32 offset), times d * d_a, accumulated in fp32.
  template <int T>
  DW_ALWAYS_INLINE static void finish_block(const uint8_t* meta, int64_t b, const float* const* drow,
                                            const int16_t* const* brow, const __m256i* sc16, const __m256i* rowsum,
                                            __m256* facc) {
    const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(meta + 16 * kGroup)));
    for (int t = 0; t < T; ++t) {
      int32_t bs[8];  // the activation sums in pairs (halves 2sp, 2sp + 1), against each row's two scales
      std::memcpy(bs, brow[t] + b * kSums, 32);
      __m256i offset = _mm256_madd_epi16(sc16[0], _mm256_set1_epi32(bs[0]));
      for (int sp = 1; sp < 8; ++sp) offset = _mm256_add_epi32(offset, _mm256_madd_epi16(sc16[sp], _mm256_set1_epi32(bs[sp])));
      const __m256i total = _mm256_sub_epi32(rowsum[t], _mm256_slli_epi32(offset, 5));
      facc[t] = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_set1_ps(drow[t][b])), _mm256_cvtepi32_ps(total), facc[t]);
    }
  }
#endif

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
  // A full group of 8 rows against T activation rows: out[t * 8 + r]. One 64-byte load of low nibbles and one of
  // high bits give 8 weights of each of 8 rows for two sub-blocks; a vpdpbusd against 8 activation bytes gives
  // each row's two sums of 4 in lanes 2r, 2r + 1; the 16-weight halves (k < 2, k >= 2) accumulate apart for their
  // scales (each row's scale in both of its lanes); the two lanes are added once per super-block.
  template <int T>
  static void dot(Group grp, Group next, const ActRows& a, const int64_t* rows, float* out) {
    constexpr int64_t qbytes = kQuantBytes * kGroup, mbytes = (kRowBytes - kQuantBytes) * kGroup;
    const __m512i low4 = _mm512_set1_epi8(0x0F), bits45 = _mm512_set1_epi8(0x30);
    const __m128i even = _mm_setr_epi8(0, 0, 2, 2, 4, 4, 6, 6, 8, 8, 10, 10, 12, 12, 14, 14);
    const __m128i odd = _mm_setr_epi8(1, 1, 3, 3, 5, 5, 7, 7, 9, 9, 11, 11, 13, 13, 15, 15);
    const int8_t* qrow[T];
    const float* drow[T];
    const int16_t* brow[T];
    __m256 facc[T];
    for (int t = 0; t < T; ++t) {
      qrow[t] = a.q + rows[t] * a.in;
      drow[t] = a.d + rows[t] * a.nb;
      brow[t] = a.bsum + rows[t] * a.nb * kSums;
      facc[t] = _mm256_setzero_ps();
    }
    for (int64_t b = 0; b < a.nb; ++b) {
      const uint8_t* q = grp.q + b * qbytes;
      const uint8_t* meta = grp.meta + b * mbytes;
      if (next.q) prefetch_bytes(next.q + b * qbytes, qbytes);
      __m256i sc16[8];  // int16 [r 8][2]: the scales of halves 2sp, 2sp + 1
      __m512i isum[T];  // lanes 2r, 2r + 1: row r
      for (int t = 0; t < T; ++t) isum[t] = _mm512_setzero_si512();
      for (int sp = 0; sp < 8; ++sp)
        sc16[sp] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(meta + 16 * sp)));
      for (int p = 0; p < 4; ++p) {
        __m512i q0[4], q1[4];  // sub-blocks 2p and 2p + 1
        for (int k = 0; k < 4; ++k) {
          const __m512i v = _mm512_load_si512(reinterpret_cast<const void*>(q + ql_at(kGroup, p) + 64 * k));
          const __m512i hb = _mm512_load_si512(reinterpret_cast<const void*>(q + qh_at(kGroup, p >> 1) + 64 * k));
          // the high bits of sub-block 4h + c sit at bits 2c, 2c + 1: c = 0, 1 (p even) or 2, 3 (p odd)
          const __m512i h0 = (p & 1) ? hb : _mm512_slli_epi16(hb, 4);
          const __m512i h1 = (p & 1) ? _mm512_srli_epi16(hb, 2) : _mm512_slli_epi16(hb, 2);
          q0[k] = _mm512_or_si512(_mm512_and_si512(v, low4), _mm512_and_si512(h0, bits45));
          q1[k] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(v, 4), low4), _mm512_and_si512(h1, bits45));
        }
        // each row's scale twice: halves 4p, 4p + 1 (sub-block 2p), 4p + 2, 4p + 3 (2p + 1)
        const __m128i sa = _mm_loadu_si128(reinterpret_cast<const __m128i*>(meta + 16 * (2 * p)));
        const __m128i sb = _mm_loadu_si128(reinterpret_cast<const __m128i*>(meta + 16 * (2 * p + 1)));
        const __m512i s0 = _mm512_cvtepi8_epi32(_mm_shuffle_epi8(sa, even)), s1 = _mm512_cvtepi8_epi32(_mm_shuffle_epi8(sa, odd));
        const __m512i s2 = _mm512_cvtepi8_epi32(_mm_shuffle_epi8(sb, even)), s3 = _mm512_cvtepi8_epi32(_mm_shuffle_epi8(sb, odd));
        for (int t = 0; t < T; ++t) {
          int64_t a0[4], a1[4];  // 8 activation bytes at a time: sub-block 2p, then 2p + 1
          std::memcpy(a0, qrow[t] + b * kWeights + 64 * p, 32);
          std::memcpy(a1, qrow[t] + b * kWeights + 64 * p + 32, 32);
          const __m512i zero = _mm512_setzero_si512();
          const __m512i c0 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(zero, q0[0], _mm512_set1_epi64(a0[0])), q0[1], _mm512_set1_epi64(a0[1]));
          const __m512i c1 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(zero, q0[2], _mm512_set1_epi64(a0[2])), q0[3], _mm512_set1_epi64(a0[3]));
          const __m512i c2 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(zero, q1[0], _mm512_set1_epi64(a1[0])), q1[1], _mm512_set1_epi64(a1[1]));
          const __m512i c3 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(zero, q1[2], _mm512_set1_epi64(a1[2])), q1[3], _mm512_set1_epi64(a1[3]));
          const __m512i lo = _mm512_add_epi32(_mm512_mullo_epi32(c0, s0), _mm512_mullo_epi32(c1, s1));
          const __m512i hi = _mm512_add_epi32(_mm512_mullo_epi32(c2, s2), _mm512_mullo_epi32(c3, s3));
          isum[t] = _mm512_add_epi32(isum[t], _mm512_add_epi32(lo, hi));
        }
      }
      __m256i rowsum[T];
      for (int t = 0; t < T; ++t)
        rowsum[t] = _mm512_cvtepi64_epi32(_mm512_add_epi32(isum[t], _mm512_srli_epi64(isum[t], 32)));
      finish_block<T>(meta, b, drow, brow, sc16, rowsum, facc);
    }
    for (int t = 0; t < T; ++t) _mm256_storeu_ps(out + kGroup * t, facc[t]);
  }
#elif defined(__AVX2__)
  // The AVX2 path of the same layout: each 64-byte chunk as two 32-byte halves (rows 0-3, rows 4-7), the same
  // integers and fp32 operations.
  template <int T>
  static void dot(Group grp, Group next, const ActRows& a, const int64_t* rows, float* out) {
    constexpr int64_t qbytes = kQuantBytes * kGroup, mbytes = (kRowBytes - kQuantBytes) * kGroup;
    const __m256i low4 = _mm256_set1_epi8(0x0F), bits45 = _mm256_set1_epi8(0x30);
    const __m128i even = _mm_setr_epi8(0, 0, 2, 2, 4, 4, 6, 6, 8, 8, 10, 10, 12, 12, 14, 14);
    const __m128i odd = _mm_setr_epi8(1, 1, 3, 3, 5, 5, 7, 7, 9, 9, 11, 11, 13, 13, 15, 15);
    const int8_t* qrow[T];
    const float* drow[T];
    const int16_t* brow[T];
    __m256 facc[T];
    for (int t = 0; t < T; ++t) {
      qrow[t] = a.q + rows[t] * a.in;
      drow[t] = a.d + rows[t] * a.nb;
      brow[t] = a.bsum + rows[t] * a.nb * kSums;
      facc[t] = _mm256_setzero_ps();
    }
    for (int64_t b = 0; b < a.nb; ++b) {
      const uint8_t* q = grp.q + b * qbytes;
      const uint8_t* meta = grp.meta + b * mbytes;
      if (next.q) prefetch_bytes(next.q + b * qbytes, qbytes);
      __m256i sc16[8];
      __m256i isum[T][2];  // half e: rows 4e..4e+3, lanes 2r', 2r' + 1
      for (int t = 0; t < T; ++t) isum[t][0] = isum[t][1] = _mm256_setzero_si256();
      for (int sp = 0; sp < 8; ++sp)
        sc16[sp] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(meta + 16 * sp)));
      for (int p = 0; p < 4; ++p) {
        const __m128i sa = _mm_loadu_si128(reinterpret_cast<const __m128i*>(meta + 16 * (2 * p)));
        const __m128i sb = _mm_loadu_si128(reinterpret_cast<const __m128i*>(meta + 16 * (2 * p + 1)));
        const __m128i sc[4] = {_mm_shuffle_epi8(sa, even), _mm_shuffle_epi8(sa, odd), _mm_shuffle_epi8(sb, even),
                               _mm_shuffle_epi8(sb, odd)};
        for (int e = 0; e < 2; ++e) {
          __m256i s[4];
          for (int j = 0; j < 4; ++j) s[j] = _mm256_cvtepi8_epi32(e ? _mm_srli_si128(sc[j], 8) : sc[j]);
          __m256i q0[4], q1[4];
          for (int k = 0; k < 4; ++k) {
            const __m256i v = _mm256_load_si256(reinterpret_cast<const __m256i*>(q + ql_at(kGroup, p) + 64 * k + 32 * e));
            const __m256i hb = _mm256_load_si256(reinterpret_cast<const __m256i*>(q + qh_at(kGroup, p >> 1) + 64 * k + 32 * e));
            const __m256i h0 = (p & 1) ? hb : _mm256_slli_epi16(hb, 4);
            const __m256i h1 = (p & 1) ? _mm256_srli_epi16(hb, 2) : _mm256_slli_epi16(hb, 2);
            q0[k] = _mm256_or_si256(_mm256_and_si256(v, low4), _mm256_and_si256(h0, bits45));
            q1[k] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), low4), _mm256_and_si256(h1, bits45));
          }
          for (int t = 0; t < T; ++t) {
            int64_t a0[4], a1[4];
            std::memcpy(a0, qrow[t] + b * kWeights + 64 * p, 32);
            std::memcpy(a1, qrow[t] + b * kWeights + 64 * p + 32, 32);
            const __m256i zero = _mm256_setzero_si256();
            const __m256i c0 = dpbusd(dpbusd(zero, q0[0], _mm256_set1_epi64x(a0[0])), q0[1], _mm256_set1_epi64x(a0[1]));
            const __m256i c1 = dpbusd(dpbusd(zero, q0[2], _mm256_set1_epi64x(a0[2])), q0[3], _mm256_set1_epi64x(a0[3]));
            const __m256i c2 = dpbusd(dpbusd(zero, q1[0], _mm256_set1_epi64x(a1[0])), q1[1], _mm256_set1_epi64x(a1[1]));
            const __m256i c3 = dpbusd(dpbusd(zero, q1[2], _mm256_set1_epi64x(a1[2])), q1[3], _mm256_set1_epi64x(a1[3]));
            const __m256i lo = _mm256_add_epi32(_mm256_mullo_epi32(c0, s[0]), _mm256_mullo_epi32(c1, s[1]));
            const __m256i hi = _mm256_add_epi32(_mm256_mullo_epi32(c2, s[2]), _mm256_mullo_epi32(c3, s[3]));
            isum[t][e] = _mm256_add_epi32(isum[t][e], _mm256_add_epi32(lo, hi));
          }
        }
      }
      __m256i rowsum[T];
      for (int t = 0; t < T; ++t) rowsum[t] = pair_lanes(isum[t][0], isum[t][1]);
      finish_block<T>(meta, b, drow, brow, sc16, rowsum, facc);
    }
    for (int t = 0; t < T; ++t) _mm256_storeu_ps(out + kGroup * t, facc[t]);
  }
#endif
};

// Q8_0 and Q5_0: 32-weight blocks with an fp16 d each, regrouped 8 rows at a time in planes (see the layout at the
// top). A Decode gives the unsigned quants of a group's block as four 64-byte vectors [r 8][i 8] (weights 8k+i,
// k = 0..3), their offset (128: Q8_0 stored as q + 128; 16: Q5_0's q - 16), and the scalar quant.
struct Q8_0Decode {
  static constexpr int64_t kRowBytes = 34;
  static constexpr int64_t kPlanes[2] = {32, 2};  // quants [k 4][r R][i 8] u8 (q + 128), d [r R] fp16
  static constexpr int32_t kOffset = 128;
  static constexpr const char* kName = "q8_0_linear";
  static int quant(const uint8_t* quants, int R, int r, int e) { return quants[(e / 8) * 8 * R + 8 * r + e % 8]; }
#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
  DW_ALWAYS_INLINE static void load(const uint8_t* const* plane, int64_t b, __m512i* w) {
    for (int k = 0; k < 4; ++k) w[k] = _mm512_load_si512(reinterpret_cast<const void*>(plane[0] + 256 * b + 64 * k));
  }
#elif defined(__AVX2__)
  // signed quants (q + 128 with its top bit flipped back): maddubs would saturate on q + 128 up to 255
  static constexpr bool kSigned = true;
  DW_ALWAYS_INLINE static void load(const uint8_t* const* plane, int64_t b, int e, __m256i* w) {
    const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
    for (int k = 0; k < 4; ++k)
      w[k] = _mm256_xor_si256(_mm256_load_si256(reinterpret_cast<const __m256i*>(plane[0] + 256 * b + 64 * k + 32 * e)), flip);
  }
#endif
};

struct Q5_0Decode {
  static constexpr int64_t kRowBytes = 22;
  // nibbles [j 2][r R][i 8] (low: weight 8j+i, high: 16+8j+i), fifth bits [k 4][r R][i 8] (one bit each, in that
  // order), d [r R] fp16
  static constexpr int64_t kPlanes[3] = {16, 4, 2};
  static constexpr int32_t kOffset = 16;
  static constexpr const char* kName = "q5_0_linear";
  static int quant(const uint8_t* nibbles, const uint8_t* bits, int R, int r, int e) {
    const int k = e / 8, i = e % 8;
    const uint8_t byte = nibbles[(k % 2) * 8 * R + 8 * r + i];
    const int bit = (k * 8 * R + 8 * r + i);
    return ((k < 2) ? byte & 0x0F : byte >> 4) | (((bits[bit / 8] >> (bit % 8)) & 1) << 4);
  }
#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
  DW_ALWAYS_INLINE static void load(const uint8_t* const* plane, int64_t b, __m512i* w) {
    const __m512i low4 = _mm512_set1_epi8(0x0F), fifth = _mm512_set1_epi8(0x10);
    const __m512i v0 = _mm512_load_si512(reinterpret_cast<const void*>(plane[0] + 128 * b));
    const __m512i v1 = _mm512_load_si512(reinterpret_cast<const void*>(plane[0] + 128 * b + 64));
    const __m512i n[4] = {_mm512_and_si512(v0, low4), _mm512_and_si512(v1, low4),
                          _mm512_and_si512(_mm512_srli_epi16(v0, 4), low4), _mm512_and_si512(_mm512_srli_epi16(v1, 4), low4)};
    for (int k = 0; k < 4; ++k) {
      uint64_t bits;
      std::memcpy(&bits, plane[1] + 32 * b + 8 * k, 8);
      w[k] = _mm512_mask_add_epi8(n[k], static_cast<__mmask64>(bits), n[k], fifth);
    }
  }
#elif defined(__AVX2__)
  static constexpr bool kSigned = false;
  DW_ALWAYS_INLINE static void load(const uint8_t* const* plane, int64_t b, int e, __m256i* w) {
    const __m256i low4 = _mm256_set1_epi8(0x0F), fifth = _mm256_set1_epi8(0x10);
    const __m256i select = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
    const __m256i v0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(plane[0] + 128 * b + 32 * e));
    const __m256i v1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(plane[0] + 128 * b + 64 + 32 * e));
    const __m256i n[4] = {_mm256_and_si256(v0, low4), _mm256_and_si256(v1, low4),
                          _mm256_and_si256(_mm256_srli_epi16(v0, 4), low4), _mm256_and_si256(_mm256_srli_epi16(v1, 4), low4)};
    for (int k = 0; k < 4; ++k) {
      uint32_t bits;  // this half's 32 bytes: bit j of these 32 bits belongs to byte j
      std::memcpy(&bits, plane[1] + 32 * b + 8 * k + 4 * e, 4);
      const __m256i spread = _mm256_shuffle_epi8(
          _mm256_set1_epi32(static_cast<int>(bits)),
          _mm256_setr_epi64x(0x0000000000000000, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303));
      const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, select), select);
      w[k] = _mm256_or_si256(n[k], _mm256_and_si256(set, fifth));
    }
  }
#endif
};

template <class Decode>
struct Block32 {
  static constexpr int64_t kWeights = 32;
  static constexpr int64_t kSums = 1;  // the activation sum per block: the offset times it
  static constexpr int64_t kRowBytes = Decode::kRowBytes;
  static constexpr int kGroup = 8;
  static constexpr int kPlaneCount = sizeof(Decode::kPlanes) / sizeof(Decode::kPlanes[0]);
  static constexpr const char* kName = Decode::kName;

  struct Group {
    const uint8_t* plane[kPlaneCount];  // this group's part of each plane (the last one: d)
  };
  static Group group(const uint8_t* base, int64_t out, int64_t nb, int64_t g) {
    Group grp{};
    int64_t at = 0;
    for (int p = 0; p < kPlaneCount; ++p) {
      grp.plane[p] = base + at + g * kGroup * nb * Decode::kPlanes[p];
      at += out * nb * Decode::kPlanes[p];
    }
    return grp;
  }

  static int quant(const Group& grp, int64_t b, int R, int r, int e) {
    if constexpr (kPlaneCount == 3) {
      return Decode::quant(grp.plane[0] + b * Decode::kPlanes[0] * R, grp.plane[1] + b * Decode::kPlanes[1] * R, R, r, e);
    } else {
      return Decode::quant(grp.plane[0] + b * Decode::kPlanes[0] * R, R, r, e);
    }
  }

  // Any R: y[t * R + r], the vector paths' integers and fp32 operations, so the same bits.
  static void dot_rows(Group grp, int R, const ActRows& a, const int64_t* rows, int count, float* out) {
    const uint8_t* dplane = grp.plane[kPlaneCount - 1];
    for (int t = 0; t < count; ++t) {
      const int8_t* x = a.q + rows[t] * a.in;
      for (int r = 0; r < R; ++r) {
        float facc = 0.f;
        for (int64_t b = 0; b < a.nb; ++b) {
          int32_t isum = 0;
          for (int e = 0; e < 32; ++e) isum += quant(grp, b, R, r, e) * x[b * kWeights + e];
          const int32_t total = isum - Decode::kOffset * a.bsum[rows[t] * a.nb + b];
          const float dw = half_to_float(dplane + 2 * (b * R + r));
          facc = std::fma(dw * a.d[rows[t] * a.nb + b], static_cast<float>(total), facc);
        }
        out[t * R + r] = facc;
      }
    }
  }

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
  // A full group of 8 rows against T activation rows: out[t * 8 + r]. Per block, four 64-byte vectors of unsigned
  // quants (8 weights of each row) meet 8 activation bytes broadcast in a vpdpbusd each: each row's two sums of 4
  // in lanes 2r, 2r + 1, added once per block; the offset times the block's activation sum comes off per row lane,
  // then one fp32 multiply-add per block with d * d_a.
  template <int T>
  static void dot(Group grp, Group next, const ActRows& a, const int64_t* rows, float* out) {
    const int8_t* qrow[T];
    const float* drow[T];
    const int16_t* brow[T];
    __m256 facc[T];
    for (int t = 0; t < T; ++t) {
      qrow[t] = a.q + rows[t] * a.in;
      drow[t] = a.d + rows[t] * a.nb;
      brow[t] = a.bsum + rows[t] * a.nb;
      facc[t] = _mm256_setzero_ps();
    }
    for (int64_t b = 0; b < a.nb; ++b) {
      if (next.plane[0] && b % 2 == 0) prefetch_bytes(next.plane[0] + b * Decode::kPlanes[0] * kGroup, 2 * Decode::kPlanes[0] * kGroup);
      __m512i w[4];
      Decode::load(grp.plane, b, w);
      const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(grp.plane[kPlaneCount - 1] + 16 * b)));
      for (int t = 0; t < T; ++t) {
        int64_t x[4];
        std::memcpy(x, qrow[t] + b * kWeights, 32);
        const __m512i zero = _mm512_setzero_si512();
        const __m512i s0 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(zero, w[0], _mm512_set1_epi64(x[0])), w[2], _mm512_set1_epi64(x[2]));
        const __m512i s1 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(zero, w[1], _mm512_set1_epi64(x[1])), w[3], _mm512_set1_epi64(x[3]));
        const __m512i s = _mm512_add_epi32(s0, s1);
        const __m256i rowsum = _mm512_cvtepi64_epi32(_mm512_add_epi32(s, _mm512_srli_epi64(s, 32)));
        const __m256i total = _mm256_sub_epi32(rowsum, _mm256_set1_epi32(Decode::kOffset * brow[t][b]));
        facc[t] = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_set1_ps(drow[t][b])), _mm256_cvtepi32_ps(total), facc[t]);
      }
    }
    for (int t = 0; t < T; ++t) _mm256_storeu_ps(out + kGroup * t, facc[t]);
  }
#elif defined(__AVX2__)
  // acc + each lane's sum of 4 products of quants and activation bytes (signed quants: |q| against the activation
  // with q's sign, so that maddubs's pair sums fit in int16)
  DW_ALWAYS_INLINE static __m256i dot4(__m256i acc, __m256i w, __m256i x) {
    if constexpr (Decode::kSigned) return dpbusd(acc, _mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
    return dpbusd(acc, w, x);
  }

  // The AVX2 path of the same layout: each 64-byte vector as two 32-byte halves (rows 0-3, rows 4-7).
  template <int T>
  static void dot(Group grp, Group next, const ActRows& a, const int64_t* rows, float* out) {
    const int8_t* qrow[T];
    const float* drow[T];
    const int16_t* brow[T];
    __m256 facc[T];
    for (int t = 0; t < T; ++t) {
      qrow[t] = a.q + rows[t] * a.in;
      drow[t] = a.d + rows[t] * a.nb;
      brow[t] = a.bsum + rows[t] * a.nb;
      facc[t] = _mm256_setzero_ps();
    }
    for (int64_t b = 0; b < a.nb; ++b) {
      if (next.plane[0] && b % 2 == 0) prefetch_bytes(next.plane[0] + b * Decode::kPlanes[0] * kGroup, 2 * Decode::kPlanes[0] * kGroup);
      __m256i w[2][4];
      Decode::load(grp.plane, b, 0, w[0]);
      Decode::load(grp.plane, b, 1, w[1]);
      const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(grp.plane[kPlaneCount - 1] + 16 * b)));
      for (int t = 0; t < T; ++t) {
        int64_t x[4];
        std::memcpy(x, qrow[t] + b * kWeights, 32);
        __m256i half[2];
        for (int e = 0; e < 2; ++e) {
          __m256i s = _mm256_setzero_si256();
          for (int k = 0; k < 4; ++k) s = dot4(s, w[e][k], _mm256_set1_epi64x(x[k]));
          half[e] = s;
        }
        // signed quants carry no offset: the same integer as the unsigned sum less the offset times the sum
        const int32_t offset = Decode::kSigned ? 0 : Decode::kOffset * brow[t][b];
        const __m256i total = _mm256_sub_epi32(pair_lanes(half[0], half[1]), _mm256_set1_epi32(offset));
        facc[t] = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_set1_ps(drow[t][b])), _mm256_cvtepi32_ps(total), facc[t]);
      }
    }
    for (int t = 0; t < T; ++t) _mm256_storeu_ps(out + kGroup * t, facc[t]);
  }
#endif
};

using Q8_0 = Block32<Q8_0Decode>;
using Q5_0 = Block32<Q5_0Decode>;

// ------------------------------------------------------------------------------------------------ the driver
template <class F, int T>
DW_ALWAYS_INLINE void group_tile(typename F::Group grp, typename F::Group next, const ActRows& a, const int64_t* rows,
                                 float* out) {
#if defined(__AVX2__)
  F::template dot<T>(grp, next, a, rows, out);
#else
  (void)next;
  F::dot_rows(grp, F::kGroup, a, rows, T, out);
#endif
}

// y [m, out] = x [m, in] W^T + bias for a format F of interleaved weight rows (Q4K, Q6K: groups of 8 rows, the
// last group may hold fewer): activation rows quantized once, then threads over the groups, each group against
// tiles of up to 8 activation rows (one group's super-block serves every row of the tile).
template <class F>
at::Tensor grouped_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& bias) {
  const char* name = F::kName;
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, name, ": x must be [m, in] float32");
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kByte, name, ": packed must be [out, bytes] uint8");
  const at::Tensor xc = x.contiguous();
  const int64_t m = xc.size(0), in = xc.size(1), out_features = packed.size(0);
  TORCH_CHECK(in % F::kWeights == 0, name, ": in_features must be a multiple of ", F::kWeights, ", got ", in);
  const int64_t nb = in / F::kWeights;
  TORCH_CHECK(packed.size(1) == nb * F::kRowBytes, name, ": packed rows hold ", packed.size(1),
              " bytes, expected ", nb * F::kRowBytes, " for ", in, " inputs");
  TORCH_CHECK(packed.is_contiguous(), name, ": packed must be contiguous");
  const bool has_bias = bias.numel() > 0;
  TORCH_CHECK(!has_bias || (bias.scalar_type() == at::kFloat && bias.numel() == out_features),
              name, ": bias must be [out] float32 or empty");
  const at::Tensor bias_c = has_bias ? bias.contiguous() : bias;

  at::Tensor q = at::empty({m, in}, x.options().dtype(at::kChar));
  at::Tensor d = at::empty({m, nb}, x.options());
  at::Tensor bsum = at::empty({m, nb * F::kSums}, x.options().dtype(at::kShort));
  at::Tensor y = at::empty({m, out_features}, x.options());
  const float* xp = xc.data_ptr<float>();
  int8_t* qp = q.data_ptr<int8_t>();
  float* dp = d.data_ptr<float>();
  int16_t* bp = bsum.data_ptr<int16_t>();
  at::parallel_for(0, m, 16, [&](int64_t r0, int64_t r1) {
    quantize_rows(xp, r0, r1, in, F::kWeights, F::kSums, qp, dp, bp);
  });

  const ActRows act{qp, dp, bp, in, nb, F::kSums};
  const uint8_t* base = packed.data_ptr<uint8_t>();
  // the vector paths' aligned 64-byte loads
  TORCH_CHECK(reinterpret_cast<uintptr_t>(base) % 64 == 0, name, ": packed must be 64-byte aligned");
  const float* biasp = has_bias ? bias_c.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const int64_t full = out_features / F::kGroup, groups = (out_features + F::kGroup - 1) / F::kGroup;
  // activation rows per pass over the groups: about 128 KiB of int8 activations (cache-resident)
  const int64_t row_chunk = std::max<int64_t>(kRowTile, (131072 / in) / kRowTile * kRowTile);
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    int64_t rows[kRowTile];
    float tile[F::kGroup * kRowTile];
    for (int64_t r0 = 0; r0 < m; r0 += row_chunk) {
      const int64_t r1 = std::min(m, r0 + row_chunk);
      for (int64_t g = g0; g < g1; ++g) {
        const typename F::Group grp = F::group(base, out_features, nb, g);
        const int R = g < full ? F::kGroup : static_cast<int>(out_features - full * F::kGroup);
        for (int64_t r = r0; r < r1; r += kRowTile) {
          const int count = static_cast<int>(std::min<int64_t>(kRowTile, r1 - r));
          for (int t = 0; t < count; ++t) rows[t] = r + t;
          // one row streams its groups at the DRAM rate on the hardware prefetcher alone (measured on a Zen4:
          // software prefetch made it slower); with several rows each group takes longer to compute, and the
          // next group is prefetched one super-block at a time as this one is computed
          const bool ahead = m > 1 && r == r0 && g + 1 < std::min(g1, full);
          const typename F::Group next = ahead ? F::group(base, out_features, nb, g + 1) : typename F::Group{};
          if (R < F::kGroup) {
            F::dot_rows(grp, R, act, rows, count, tile);
          } else {
            switch (count) {
              case 8: group_tile<F, 8>(grp, next, act, rows, tile); break;
              case 7: group_tile<F, 7>(grp, next, act, rows, tile); break;
              case 6: group_tile<F, 6>(grp, next, act, rows, tile); break;
              case 5: group_tile<F, 5>(grp, next, act, rows, tile); break;
              case 4: group_tile<F, 4>(grp, next, act, rows, tile); break;
              case 3: group_tile<F, 3>(grp, next, act, rows, tile); break;
              case 2: group_tile<F, 2>(grp, next, act, rows, tile); break;
              default: group_tile<F, 1>(grp, next, act, rows, tile); break;
            }
          }
          for (int t = 0; t < count; ++t)
            for (int u = 0; u < R; ++u) {
              const int64_t n = g * F::kGroup + u;
              yp[(r + t) * out_features + n] = tile[t * R + u] + (has_bias ? biasp[n] : 0.f);
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
  lib.def("linear_q6_k(Tensor x, Tensor packed, Tensor bias) -> Tensor");
  lib.def("linear_q8_0(Tensor x, Tensor packed, Tensor bias) -> Tensor");
  lib.def("linear_q5_0(Tensor x, Tensor packed, Tensor bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(draftwise_q4k, CPU, lib) {
  lib.impl("linear", &grouped_linear<Q4K>);
  lib.impl("linear_q6_k", &grouped_linear<Q6K>);
  lib.impl("linear_q8_0", &grouped_linear<Q8_0>);
  lib.impl("linear_q5_0", &grouped_linear<Q5_0>);
}
