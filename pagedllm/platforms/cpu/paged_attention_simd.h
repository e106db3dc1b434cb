// The vector building blocks of platforms/cpu/paged_attention.cpp (its only includer), per instruction set:
// AVX-512 (with AVX512-BF16's bf16 dot products and AVX512-VNNI's int16 ones where the CPU has
// them) or AVX2 + FMA, whose 16 lanes are two ymm (F16). Loads that widen a bf16 or int8 row to
// float, 16 keys' dot products at once summed by a transposing add tree (hsum16), P.V over row
// blocks with the next rows prefetched, the int16 path for an int8 cache (quantize_i16, dot16_i16,
// pv_block_i16), AVX2's touch_rows (read a chunk first, then compute from L2) and the online
// softmax step 16 exponentials at a time (softmax_fold16). Defines PAGEDLLM_AVX512, PAGEDLLM_VNNI,
// PAGEDLLM_AVX2, and PAGEDLLM_VEC where either vector path is built.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "cpu_math.h"

namespace {

// exp(x) for x <= 0; branch-free so the compiler vectorises the loops that call it.
inline float exp_nonpos(float x) { return pagedllm_cpu::exp_clamped(std::max(x, -87.0f)); }

// block(std::integral_constant<int, R>{}, r) for the rows [r, r + R) of [0, rows), R at a time, then
// block(std::integral_constant<int, 1>{}, r) for each row left: the P.V loops take several rows
// per pass over V, as many as their accumulators fit in registers.
template <int R, typename F>
inline void row_groups(int rows, F&& block) {
  int r = 0;
  for (; r + R <= rows; r += R) block(std::integral_constant<int, R>{}, r);
  for (; r < rows; ++r) block(std::integral_constant<int, 1>{}, r);
}

// Cache element C: float, uint16_t (bf16) or int8_t (values; the block's scales after its rows).
template <typename C>
constexpr bool kInt8 = std::is_same_v<C, int8_t>;
template <typename C>
constexpr int row_bytes(int d) { return d * static_cast<int>(sizeof(C)); }

#if defined(__AVX512F__)
#include <immintrin.h>
#define PAGEDLLM_AVX512 1

// 16 float lanes of row p (bf16 widened: its bits are the top half of a float).
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// An int8 row as float, or as bf16: an integer of at most 7 bits is exact in bf16 (the float's low
// 16 bits are zero), so the bf16 dot products of int8 keys stay exact products.
inline void int8_row_to(const int8_t* src, float* dst, int d) {
  for (int c = 0; c < d; c += 16) _mm512_storeu_ps(dst + c, load16(src + c));
}
inline void int8_row_to(const int8_t* src, uint16_t* dst, int d) {
  int c = 0;
#if defined(__AVX512BF16__)
  // 32 at a time, rounded by vcvtne2ps2bf16 (exact here): 3-6 % less time for an int8 cache's
  // attention in a bf16 model than the shift and narrowing below.
  for (; c + 32 <= d; c += 32)
    _mm512_storeu_si512(dst + c, (__m512i)_mm512_cvtne2ps_pbh(load16(src + c + 16), load16(src + c)));
#endif
  for (; c < d; c += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + c),
                        _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(load16(src + c)), 16)));
}

// {sum(v[0]), ..., sum(v[15])}: a transposing add tree, 45 shuffles/adds for 16 sums where
// 16 separate horizontal sums take ~130.
inline __m512 hsum16(const __m512* v) {
  __m512 x[8], y[4], z[2];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: {a0+a2, b0+b2, a1+a3, b1+b3}
    x[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per lane: {a, b, c, d} partial sums of that lane
    const __m512d a = _mm512_castps_pd(x[2 * i]), b = _mm512_castps_pd(x[2 * i + 1]);
    y[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  for (int i = 0; i < 2; ++i)  // lanes {y0 L0+L1, y0 L2+L3, y1 L0+L1, y1 L2+L3}
    z[i] = _mm512_add_ps(_mm512_shuffle_f32x4(y[2 * i], y[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(y[2 * i], y[2 * i + 1], 0xdd));
  return _mm512_add_ps(_mm512_shuffle_f32x4(z[0], z[1], 0x88), _mm512_shuffle_f32x4(z[0], z[1], 0xdd));
}

// Dot products of one query row with 16 key rows (k[j], j < 16; callers repeat a valid row for
// missing keys), D a multiple of 16. bf16 with AVX512-BF16: vdpbf16ps multiplies bf16 pairs
// exactly and accumulates in float32 (q is bf16 in that model anyway).
template <int D>
inline __m512 dot16(const float* q, const float* const* k, int d) {
  const int dd = D > 0 ? D : d;
  __m512 acc[16];
  for (int j = 0; j < 16; ++j) acc[j] = _mm512_setzero_ps();
  for (int c = 0; c < dd; c += 16) {
    const __m512 qc = _mm512_loadu_ps(q + c);
    for (int j = 0; j < 16; ++j) acc[j] = _mm512_fmadd_ps(qc, _mm512_loadu_ps(k[j] + c), acc[j]);
  }
  return hsum16(acc);
}

template <int D>
inline __m512 dot16(const uint16_t* q, const uint16_t* const* k, int d) {
  const int dd = D > 0 ? D : d;
  __m512 acc[16];
  for (int j = 0; j < 16; ++j) acc[j] = _mm512_setzero_ps();
  int c = 0;
#if defined(__AVX512BF16__)
  for (; c + 32 <= dd; c += 32) {
    const __m512bh qc = (__m512bh)_mm512_loadu_si512(q + c);
    for (int j = 0; j < 16; ++j) acc[j] = _mm512_dpbf16_ps(acc[j], qc, (__m512bh)_mm512_loadu_si512(k[j] + c));
  }
#endif
  for (; c < dd; c += 16) {
    const __m512 qc = load16(q + c);
    for (int j = 0; j < 16; ++j) acc[j] = _mm512_fmadd_ps(qc, load16(k[j] + c), acc[j]);
  }
  return hsum16(acc);
}

// acc[r] += sum_j p[r][j] * v_j for `rows` rows at once (each V row loaded once for all of them),
// D a multiple of 16; accumulators in registers when D is a compile-time constant. pf (null: none):
// n rows of D elements to prefetch into L2, one a key, for the computation after this one (the V
// rows themselves were prefetched while the scores were computed).
template <int D, int R, typename T>
inline void pv_block(const float* p, int p_stride, const T* const* v, int n, float* acc, const T* const* pf) {
  constexpr int C = D / 16;
  __m512 a[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) a[r][c] = _mm512_loadu_ps(acc + r * D + 16 * c);
  for (int j = 0; j < n; ++j) {
    if (pf != nullptr)
      for (int c = 0; c < row_bytes<T>(D); c += 64) __builtin_prefetch(reinterpret_cast<const char*>(pf[j]) + c, 0, 2);
    __m512 vc[C];
    for (int c = 0; c < C; ++c) vc[c] = load16(v[j] + 16 * c);
    for (int r = 0; r < R; ++r) {
      const __m512 w = _mm512_set1_ps(p[r * p_stride + j]);
      for (int c = 0; c < C; ++c) a[r][c] = _mm512_fmadd_ps(w, vc[c], a[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + r * D + 16 * c, a[r][c]);
}

// acc[r] += sum_j p[r][j] * v_j for `rows` rows (each V row loaded once for up to 3 of them),
// D a multiple of 16; accumulators in registers when D is a compile-time constant. pf: as pv_block's
// (prefetched once, with the first rows).
template <int D, typename T>
inline void pv_rows(const float* p, int p_stride, const T* const* v, int n, float* acc, int rows, int d,
                    const T* const* pf) {
  if constexpr (D > 0 && D <= 128) {
    constexpr int R = D <= 64 ? 3 : 2;  // R * D / 16 accumulators + D / 16 V registers <= 32
    row_groups<R>(rows, [&](auto rr, int r) {
      pv_block<D, decltype(rr)::value>(p + static_cast<size_t>(r) * p_stride, p_stride, v, n,
                                       acc + static_cast<size_t>(r) * D, r == 0 ? pf : nullptr);
    });
  } else {
    for (int r = 0; r < rows; ++r) {
      float* o0 = acc + static_cast<size_t>(r) * d;
      const float* p0 = p + static_cast<size_t>(r) * p_stride;
      for (int j = 0; j < n; ++j) {
        const __m512 w0 = _mm512_set1_ps(p0[j]);
        for (int c = 0; c < d; c += 16)
          _mm512_storeu_ps(o0 + c, _mm512_fmadd_ps(w0, load16(v[j] + c), _mm512_loadu_ps(o0 + c)));
      }
    }
  }
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define PAGEDLLM_VNNI 1
// An int8 cache in a bf16 model, with AVX512-VNNI: the dot products in 16-bit integers (vpdpwssd,
// exact int32 sums) instead of widening every key and value to bf16/float. Query rows and the
// probabilities are quantized to int16 with a per-row scale: an error of at most max|x| / 65534,
// 128x below the rounding a bf16 query already carries at its largest element (SageAttention,
// Zhang et al. 2024, quantizes Q, K and P likewise, to coarser types).

// x[0, d) -> round(x / s) in int16, s = max|x| / 32767 (returned; 0 for an all-zero row).
inline float quantize_i16(const uint16_t* x, int16_t* out, int d) {
  __m512 amax = _mm512_setzero_ps();
  for (int c = 0; c < d; c += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(load16(x + c)));
  const float mx = _mm512_reduce_max_ps(amax);
  const __m512 mul = _mm512_set1_ps(mx > 0.0f ? 32767.0f / mx : 0.0f);
  for (int c = 0; c < d; c += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + c),
                        _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(load16(x + c), mul))));
  return mx / 32767.0f;
}

// {sum(v[0]), ..., sum(v[15])} of int32 lanes: hsum16's add tree on integers.
inline __m512i hsum16i(const __m512i* v) {
  __m512i x[8], y[4], z[2];
  for (int i = 0; i < 8; ++i)
    x[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_epi32(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)
    y[i] = _mm512_add_epi32(_mm512_unpacklo_epi64(x[2 * i], x[2 * i + 1]), _mm512_unpackhi_epi64(x[2 * i], x[2 * i + 1]));
  for (int i = 0; i < 2; ++i)
    z[i] = _mm512_add_epi32(_mm512_shuffle_i32x4(y[2 * i], y[2 * i + 1], 0x88), _mm512_shuffle_i32x4(y[2 * i], y[2 * i + 1], 0xdd));
  return _mm512_add_epi32(_mm512_shuffle_i32x4(z[0], z[1], 0x88), _mm512_shuffle_i32x4(z[0], z[1], 0xdd));
}

// Integer dot products of a quantized query row with 16 keys widened to int16 (k[j], D columns).
template <int D>
inline __m512 dot16_i16(const int16_t* q, const int16_t* const* k) {
  __m512i acc[16];
  for (int j = 0; j < 16; ++j) acc[j] = _mm512_setzero_si512();
  for (int c = 0; c < D; c += 32) {
    const __m512i qc = _mm512_loadu_si512(q + c);
    for (int j = 0; j < 16; ++j) acc[j] = _mm512_dpwssd_epi32(acc[j], qc, _mm512_loadu_si512(k[j] + c));
  }
  return _mm512_cvtepi32_ps(hsum16i(acc));
}

// acc[r] += sum_j p[r][j] * v_j for R rows, int8 V rows, D a multiple of 64: each row's p quantized
// to int16 (p >= 0, scale max p / 32767), two keys at a time with vpdpwssd over V rows j and j + 1
// interleaved byte by byte and sign-extended; |sum| <= 512 keys x 32767 x 127 < 2^31. The
// accumulators hold each 64 columns as {0-7, 16-23}, {8-15, 24-31}, {32-39, 48-55}, {40-47, 56-63}
// (what unpack and the widening give), put back in order when added to acc. pf: as pv_block's.
template <int D, int R>
inline void pv_block_i16(const float* p, int p_stride, const int8_t* const* v, int n, float* acc,
                         const int8_t* const* pf) {
  static_assert(D % 64 == 0, "64 columns a group");
  constexpr int Z = D / 64;
  alignas(64) int16_t pq[R][512];
  float back[R];  // max p / 32767
  const int npad = (n + 31) & ~31;
  for (int r = 0; r < R; ++r) {
    const float* pr = p + r * p_stride;
    __m512 mx = _mm512_setzero_ps();
    int j = 0;
    for (; j + 16 <= n; j += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(pr + j));
    float pmax = _mm512_reduce_max_ps(mx);
    for (; j < n; ++j) pmax = std::max(pmax, pr[j]);
    const float mul = pmax > 0.0f ? 32767.0f / pmax : 0.0f;
    back[r] = pmax / 32767.0f;
    for (j = 0; j + 16 <= n; j += 16)
      _mm256_store_si256(reinterpret_cast<__m256i*>(&pq[r][j]),
                         _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(pr + j), _mm512_set1_ps(mul)))));
    for (; j < npad; ++j) pq[r][j] = j < n ? static_cast<int16_t>(std::nearbyint(pr[j] * mul)) : 0;
  }
  __m512i a[R][4 * Z];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < 4 * Z; ++i) a[r][i] = _mm512_setzero_si512();
  for (int j = 0; j < n; j += 2) {
    const int8_t* va = v[j];
    const int8_t* vb = v[std::min(j + 1, n - 1)];  // p of the missing key is 0
    if (pf != nullptr)
      for (int u = j; u < std::min(j + 2, n); ++u)
        for (int c = 0; c < D; c += 64) __builtin_prefetch(reinterpret_cast<const char*>(pf[u]) + c, 0, 2);
    __m512i w[4 * Z];
    for (int z = 0; z < Z; ++z) {
      const __m512i x = _mm512_loadu_si512(va + 64 * z), y = _mm512_loadu_si512(vb + 64 * z);
      const __m512i lo = _mm512_unpacklo_epi8(x, y), hi = _mm512_unpackhi_epi8(x, y);
      w[4 * z] = _mm512_cvtepi8_epi16(_mm512_castsi512_si256(lo));        // {0-7, 16-23}
      w[4 * z + 1] = _mm512_cvtepi8_epi16(_mm512_castsi512_si256(hi));    // {8-15, 24-31}
      w[4 * z + 2] = _mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64(lo, 1));  // {32-39, 48-55}
      w[4 * z + 3] = _mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64(hi, 1));  // {40-47, 56-63}
    }
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, &pq[r][j], sizeof(pair));
      const __m512i pw = _mm512_set1_epi32(pair);
      for (int i = 0; i < 4 * Z; ++i) a[r][i] = _mm512_dpwssd_epi32(a[r][i], w[i], pw);
    }
  }
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int r = 0; r < R; ++r) {
    const __m512 b = _mm512_set1_ps(back[r]);
    for (int z = 0; z < Z; ++z)
      for (int h = 0; h < 2; ++h) {  // columns 64z + 32h + [0, 32): groups 4z + 2h, 4z + 2h + 1
        float* o = acc + r * D + 64 * z + 32 * h;
        const __m512i g0 = a[r][4 * z + 2 * h], g1 = a[r][4 * z + 2 * h + 1];
        _mm512_storeu_ps(o, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_permutex2var_epi32(g0, first, g1)), b, _mm512_loadu_ps(o)));
        _mm512_storeu_ps(o + 16, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_permutex2var_epi32(g0, second, g1)), b, _mm512_loadu_ps(o + 16)));
      }
  }
}

template <int D>
inline void pv_rows_i16(const float* p, int p_stride, const int8_t* const* v, int n, float* acc, int rows,
                        const int8_t* const* pf) {
  constexpr int R = D <= 64 ? 3 : 2;  // R * D / 16 accumulators + D / 16 V registers <= 32
  row_groups<R>(rows, [&](auto rr, int r) {
    pv_block_i16<D, decltype(rr)::value>(p + static_cast<size_t>(r) * p_stride, p_stride, v, n,
                                         acc + static_cast<size_t>(r) * D, r == 0 ? pf : nullptr);
  });
}
#endif  // AVX512-VNNI

// The vector path's 16 lanes (AVX2: two ymm), and its few operations beyond the helpers above.
using F16 = __m512;
inline F16 set1_16(float x) { return _mm512_set1_ps(x); }
inline void store16(float* p, F16 v) { _mm512_storeu_ps(p, v); }
inline F16 mul16(F16 a, F16 b) { return _mm512_mul_ps(a, b); }

#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PAGEDLLM_AVX2 1
// The vector path on AVX2: the same computation as the AVX-512 helpers above, its 16 lanes two
// ymm; the dot products of 16 keys as two transposing add trees of 8, and P.V over column slices
// (16 ymm registers hold the accumulators of 3 rows of 16 columns, not of whole 64-wide rows).
struct F16 {
  __m256 lo, hi;
};
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
template <typename T>
inline F16 load16(const T* p) { return {load8(p), load8(p + 8)}; }
inline F16 set1_16(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline void store16(float* p, F16 v) {
  _mm256_storeu_ps(p, v.lo);
  _mm256_storeu_ps(p + 8, v.hi);
}
inline F16 mul16(F16 a, F16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }

// An int8 row as float, or as bf16 (exact: see the AVX-512 int8_row_to).
inline void int8_row_to(const int8_t* src, float* dst, int d) {
  for (int c = 0; c < d; c += 8) _mm256_storeu_ps(dst + c, load8(src + c));
}
inline void int8_row_to(const int8_t* src, uint16_t* dst, int d) {
  for (int c = 0; c < d; c += 8) {
    const __m256i top = _mm256_srli_epi32(_mm256_castps_si256(load8(src + c)), 16);  // 0 .. 0xffff
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + c),
                     _mm_packus_epi32(_mm256_castsi256_si128(top), _mm256_extracti128_si256(top, 1)));
  }
}

// {sum(v[0]), ..., sum(v[7])}: per 128-bit lane two rounds of pairwise adds, then the lanes.
inline __m256 hsum8(const __m256* v) {
  const __m256 t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// Dot products of one query row with 16 key rows (as the AVX-512 dot16), 8 keys at a time.
template <int D, typename T>
inline F16 dot16(const T* q, const T* const* k, int d) {
  const int dd = D > 0 ? D : d;
  __m256 half[2];
  for (int h = 0; h < 2; ++h) {
    __m256 acc[8];
    for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
    for (int c = 0; c < dd; c += 8) {
      const __m256 qc = load8(q + c);
      for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(qc, load8(k[8 * h + j] + c), acc[j]);
    }
    half[h] = hsum8(acc);
  }
  return {half[0], half[1]};
}

// acc[r] += sum_j p[r][j] * v_j for R rows over columns [c0, c0 + 8 * CW): R * CW accumulators.
template <int R, int CW, typename T>
inline void pv_slice(const float* p, int p_stride, const T* const* v, int n, float* acc, int d, int c0) {
  __m256 a[R][CW];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < CW; ++c) a[r][c] = _mm256_loadu_ps(acc + r * d + c0 + 8 * c);
  for (int j = 0; j < n; ++j) {  // no prefetch: the chunk's rows were read into L2 (touch_rows)
    __m256 vc[CW];
    for (int c = 0; c < CW; ++c) vc[c] = load8(v[j] + c0 + 8 * c);
    for (int r = 0; r < R; ++r) {
      const __m256 w = _mm256_set1_ps(p[r * p_stride + j]);
      for (int c = 0; c < CW; ++c) a[r][c] = _mm256_fmadd_ps(w, vc[c], a[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < CW; ++c) _mm256_storeu_ps(acc + r * d + c0 + 8 * c, a[r][c]);
}

// acc[r] += sum_j p[r][j] * v_j for `rows` rows, D a multiple of 16: 3 rows at a time, over
// slices of 16 columns (3 rows of 32 would need 17 registers: one accumulator spilled to the stack
// made every key wait on a store and a reload, 1.4x slower).
template <int D, typename T>
inline void pv_rows(const float* p, int p_stride, const T* const* v, int n, float* acc, int rows, int d,
                    const T* const* /*pf: unused, the chunk was touched*/) {
  const int dd = D > 0 ? D : d;
  row_groups<3>(rows, [&](auto rr, int r) {
    for (int c0 = 0; c0 < dd; c0 += 16)
      pv_slice<decltype(rr)::value, 2>(p + static_cast<size_t>(r) * p_stride, p_stride, v, n,
                                       acc + static_cast<size_t>(r) * dd, dd, c0);
  });
}

// Scores sr[0, npad) outside [vis_lo, vis_hi) set to -inf, 8 at a time (the AVX-512 path's loop
// in paged_attention_vec); returns their max (-inf when none is visible).
inline float mask_max16(float* sr, int npad, int vis_lo, int vis_hi) {
  const __m256i lo_v = _mm256_set1_epi32(vis_lo), hi_v = _mm256_set1_epi32(vis_hi);
  const __m256 neg_inf = _mm256_set1_ps(-INFINITY);
  __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  __m256 vmax = neg_inf;
  for (int j = 0; j < npad; j += 8, idx = _mm256_add_epi32(idx, _mm256_set1_epi32(8))) {
    const __m256i live = _mm256_andnot_si256(_mm256_cmpgt_epi32(lo_v, idx), _mm256_cmpgt_epi32(hi_v, idx));
    const __m256 x = _mm256_blendv_ps(neg_inf, _mm256_loadu_ps(sr + j), _mm256_castsi256_ps(live));
    _mm256_storeu_ps(sr + j, x);
    vmax = _mm256_max_ps(vmax, x);
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  return _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
}
#endif  // __AVX512F__ / AVX2
#if defined(PAGEDLLM_AVX512) || defined(PAGEDLLM_AVX2)
#define PAGEDLLM_VEC 1
#endif

#ifdef PAGEDLLM_AVX2
// The vector path reads a chunk's K and V (the item's KV heads of n token rows) first with one
// load per cache line and nothing else (touch_rows), then computes on them from L2: kTouchBytes of K + V
// a chunk. On the AVX2-only EPYC measured, the loop's loads and prefetches drew 9-10 GB/s from DRAM
// (prefetching or not made no difference), a bare read of the same rows 15-16, and touching first
// took a 48-sequence SmolLM2 decode (30 layers, context 300) from 65-71 to 40-47 ms. AVX-512 keeps
// its prefetching loop as measured on its own host.
// The rows are read as 2 * kTouchParts interleaved runs (the K and V rows of kTouchParts stretches of
// the chunk), line by line: more runs in flight read faster. 48 sequences x 30 layers, 8 runs
// against 2 (K and V of one stretch): faster in 8 of 8 alternated pairs, by 2-7 %; K, then V: 15-20 %
// slower.
constexpr int kTouchBytes = 128 << 10;
constexpr int kTouchParts = 4;
template <typename C>
inline void touch_rows(const C* k_cache, const C* v_cache, const int64_t* off, int n, int64_t h0, int seg_bytes) {
  __m256i sink = _mm256_setzero_si256();
  const int part = (n + kTouchParts - 1) / kTouchParts;
  for (int j = 0; j < part; ++j) {
    const char* run[2 * kTouchParts];
    for (int u = 0; u < kTouchParts; ++u) {
      const int row = j + u * part < n ? j + u * part : j;  // a short last stretch reads row j again
      run[2 * u] = reinterpret_cast<const char*>(k_cache + off[row] + h0);
      run[2 * u + 1] = reinterpret_cast<const char*>(v_cache + off[row] + h0);
    }
    for (int c = 0; c < seg_bytes; c += 64)
      for (int u = 0; u < 2 * kTouchParts; ++u)
        sink = _mm256_or_si256(sink, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(run[u] + c)));
  }
  asm volatile("" : : "x"(sink));  // the loads stay: their result is "used"
}
#else
constexpr int kTouchBytes = 0;  // off
#endif

#ifdef PAGEDLLM_AVX512
// softmax_fold (platforms/cpu/paged_attention.cpp) for n a multiple of 16, with the exponentials 16 at a
// time (the scalar loop does not vectorise: its exp is a function GCC keeps scalar).
inline void softmax_fold16(float* sr, int n, float bmax, float& m, float& l, float* acc, int d) {
  if (bmax == -INFINITY) {
    std::fill(sr, sr + n, 0.0f);
    return;
  }
  const float m_new = std::max(m, bmax);
  const float corr = exp_nonpos(m - m_new);
  const __m512 mn = _mm512_set1_ps(m_new), lo = _mm512_set1_ps(-87.0f), neg_inf = _mm512_set1_ps(-INFINITY);
  __m512 sum = _mm512_setzero_ps();
  for (int j = 0; j < n; j += 16) {
    const __m512 x = _mm512_loadu_ps(sr + j);
    const __mmask16 live = _mm512_cmp_ps_mask(x, neg_inf, _CMP_NEQ_OQ);
    const __m512 e = _mm512_maskz_mov_ps(live, pagedllm_cpu::exp_clamped16(_mm512_max_ps(_mm512_sub_ps(x, mn), lo)));
    _mm512_storeu_ps(sr + j, e);
    sum = _mm512_add_ps(sum, e);
  }
  l = l * corr + _mm512_reduce_add_ps(sum);
  m = m_new;
  if (corr != 1.0f) {
#pragma omp simd
    for (int c = 0; c < d; ++c) acc[c] *= corr;
  }
}
#elif defined(PAGEDLLM_AVX2)
// As above, 8 at a time.
inline void softmax_fold16(float* sr, int n, float bmax, float& m, float& l, float* acc, int d) {
  if (bmax == -INFINITY) {
    std::fill(sr, sr + n, 0.0f);
    return;
  }
  const float m_new = std::max(m, bmax);
  const float corr = exp_nonpos(m - m_new);
  const __m256 mn = _mm256_set1_ps(m_new), lo = _mm256_set1_ps(-87.0f), neg_inf = _mm256_set1_ps(-INFINITY);
  __m256 sum = _mm256_setzero_ps();
  for (int j = 0; j < n; j += 8) {
    const __m256 x = _mm256_loadu_ps(sr + j);
    const __m256 live = _mm256_cmp_ps(x, neg_inf, _CMP_NEQ_OQ);
    const __m256 e = _mm256_and_ps(live, pagedllm_cpu::exp_clamped8(_mm256_max_ps(_mm256_sub_ps(x, mn), lo)));
    _mm256_storeu_ps(sr + j, e);
    sum = _mm256_add_ps(sum, e);
  }
  __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1));
  s4 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  l = l * corr + _mm_cvtss_f32(_mm_add_ss(s4, _mm_movehdup_ps(s4)));
  m = m_new;
  if (corr != 1.0f) {
#pragma omp simd
    for (int c = 0; c < d; ++c) acc[c] *= corr;
  }
}
#endif

}  // namespace
