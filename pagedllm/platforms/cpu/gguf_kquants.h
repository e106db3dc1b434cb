// The K-quants (Q4_K, Q5_K, Q6_K: ggml's super-blocks of 256) against activations quantized per
// 256 (llama.cpp's Q8_K scheme), for gguf_gemm.cpp.
//
// Why per 256 and not per 32 as the other types: a super-block's sub-block scales are small
// integers (6-bit, or int8 for Q6_K) under one fp16 d. With one activation scale per 256 too, a
// sub-block's int8 dot (maddubs to int16 pairs) is multiplied by its integer scale and summed in
// int32 (madd_epi16, or one VNNI dpwssd), and the block goes to float once: one convert and one
// fma per 256 weights, where blocks of 32 took one per 32 plus a scalar multiply and broadcast.
// The minimum terms (Q4_K, Q5_K: w = d sc q - dmin m) and Q6_K's offset of 32 come from the
// activation's int16 sums per 16 (bsums), in integers as well. This is ggml_vec_dot_q4_K_q8_K's
// arithmetic (ggml-cpu/arch/x86/quants.c); the activation error grows from d_32 / 2 to d_256 / 2
// per value (d = max |x| / 127 of the block), as in llama.cpp.
//
// Exactness of the integer sums: maddubs' pairs stay within int16 (2 * 63 * 127 for Q6_K's
// 0..63); a block's int32 total is at most 256 * 63 * 127 * 128 (Q6_K) < 2^31.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace kq {

// acc + the pairwise products of the int16 lanes p and sc (exact: |p sc| < 2^30).
inline __m256i madd_acc(__m256i acc, __m256i p, __m256i sc) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpwssd_epi32(acc, p, sc);
#elif defined(__AVXVNNI__)
  return _mm256_dpwssd_avx_epi32(acc, p, sc);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(p, sc));
#endif
}

inline float half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

inline __m256i load(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// The activation rows of a tile, quantized per 256: int8 values, a float scale and int16 sums of
// each 16 values; acc: the row's float sums so far (8 lanes).
template <int NR>
struct Tile {
  const int8_t* q[NR];
  const float* d[NR];
  const int16_t* bs[NR];
  __m256 acc[NR];
};

// The 12 scale bytes of a Q4_K / Q5_K block -> its 8 6-bit scales (bytes 0-7) and 8 minimums
// (bytes 8-15). Sub-block j < 4: scale s[j] & 63, min s[j + 4] & 63; j >= 4: the low (scale) or
// high (min) nibble of s[j + 4] under the top two bits of s[j - 4] (scale) or s[j] (min): ggml's
// get_scale_min_k4, four bytes at a time.
inline __m128i scales_mins(const uint8_t* s12) {
  uint32_t u[3];
  std::memcpy(u, s12, 12);
  const uint32_t m6 = 0x3f3f3f3f, m4 = 0x0f0f0f0f, m2 = 0x03030303;
  const uint32_t sc_lo = u[0] & m6, mn_lo = u[1] & m6;
  const uint32_t sc_hi = (u[2] & m4) | (((u[0] >> 6) & m2) << 4);
  const uint32_t mn_hi = ((u[2] >> 4) & m4) | (((u[1] >> 6) & m2) << 4);
  return _mm_set_epi32(static_cast<int>(mn_hi), static_cast<int>(mn_lo), static_cast<int>(sc_hi),
                       static_cast<int>(sc_lo));
}

// A pshufb mask that fills every int16 lane of a 128-bit lane with its int16 lane j.
inline __m256i lane16(int j) { return _mm256_set1_epi16(static_cast<int16_t>((2 * j + 1) << 8 | 2 * j)); }

// A Q4_K / Q5_K block's 8 minimums (bytes 8-15 of scales_mins), each twice as int16: against the
// activation's sums of 16 they give each sub-block's m * sum.
inline __m256i mins16(__m128i sm) {
  return _mm256_cvtepu8_epi16(
      _mm_shuffle_epi8(sm, _mm_setr_epi8(8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15)));
}

// Row r's float sum += d dx isum - dmin dx (mins . bsums): a Q4_K / Q5_K block's integer dot isum
// (8 int32 lanes) and its minimum term, dx the activation block's scale.
template <int NR>
inline void q45_k_finish(Tile<NR>& t, int r, int64_t b, __m256i isum, __m256i mins, float d, float dmin) {
  const float dx = t.d[r][b];
  const __m256i m = _mm256_madd_epi16(load(t.bs[r] + 16 * b), mins);
  t.acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(d * dx), t.acc[r]);
  t.acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(m), _mm256_set1_ps(-dmin * dx), t.acc[r]);
}

// Q4_K and Q5_K (FIVE): d, dmin (fp16), scales[12], [Q5_K: qh[32]], qs[128]; sub-block 2c's 32
// weights are the low nibbles of qs[32c..32c+31], sub-block 2c + 1's the high ones; Q5_K's fifth
// bit of weight l of sub-block j is bit j of qh[l].
template <bool FIVE, int NR>
inline void q45_k(const uint8_t* p, Tile<NR>& t, int64_t b) {
  const float d = half(p), dmin = half(p + 2);
  const __m128i sm = scales_mins(p + 4);
  const __m256i sc = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(sm));
  const __m256i mins = mins16(sm);
  const uint8_t* qs = p + (FIVE ? 48 : 16);
  const __m256i m4 = _mm256_set1_epi8(0x0f);
  __m256i h = FIVE ? load(p + 16) : _mm256_setzero_si256();
  __m256i acc0[NR], acc1[NR];
  for (int r = 0; r < NR; ++r) acc0[r] = acc1[r] = _mm256_setzero_si256();
  for (int c = 0; c < 4; ++c) {
    const __m256i v = load(qs + 32 * c);
    __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
    if (FIVE) {  // bits 2c, 2c + 1 of each qh byte (h shifted right by 2c) to bit 4
      const __m256i b4 = _mm256_set1_epi8(0x10);
      lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_slli_epi16(h, 4), b4));
      hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_slli_epi16(h, 3), b4));
      h = _mm256_srli_epi16(h, 2);
    }
    const __m256i s_lo = _mm256_shuffle_epi8(sc, lane16(2 * c)), s_hi = _mm256_shuffle_epi8(sc, lane16(2 * c + 1));
    for (int r = 0; r < NR; ++r) {
      const int8_t* a = t.q[r] + 256 * b + 64 * c;
      acc0[r] = madd_acc(acc0[r], _mm256_maddubs_epi16(lo, load(a)), s_lo);
      acc1[r] = madd_acc(acc1[r], _mm256_maddubs_epi16(hi, load(a + 32)), s_hi);
    }
  }
  for (int r = 0; r < NR; ++r) q45_k_finish(t, r, b, _mm256_add_epi32(acc0[r], acc1[r]), mins, d, dmin);
}

#if defined(__AVX512BW__)
// 64 weights a zmm where the host has AVX-512 (half the instructions of the 256-bit loop above):
// the same sums in the same int32 lanes' pairs, so the same results.
inline __m512i madd_acc512(__m512i acc, __m512i p, __m512i sc) {
#if defined(__AVX512VNNI__)
  return _mm512_dpwssd_epi32(acc, p, sc);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(p, sc));
#endif
}

inline __m256i fold(__m512i v) { return _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1)); }

// Q4_K / Q5_K: chunk c's 32 bytes as one zmm of its 64 weights in order (low nibbles: sub-block 2c,
// high: 2c + 1), each half's int16 products times its sub-block's scale (vpermw from the 8 scales).
template <bool FIVE, int NR>
inline void q45_k_512(const uint8_t* p, Tile<NR>& t, int64_t b) {
  const float d = half(p), dmin = half(p + 2);
  const __m128i sm = scales_mins(p + 4);
  const __m512i sc = _mm512_castsi128_si512(_mm_cvtepu8_epi16(sm));
  const __m256i mins = mins16(sm);
  const uint8_t* qs = p + (FIVE ? 48 : 16);
  const __m512i m4 = _mm512_set1_epi8(0x0f), b4 = _mm512_set1_epi8(0x10);
  __m256i h = FIVE ? load(p + 16) : _mm256_setzero_si256();
  __m512i acc[NR];
  for (int r = 0; r < NR; ++r) acc[r] = _mm512_setzero_si512();
  for (int c = 0; c < 4; ++c) {
    const __m256i v = load(qs + 32 * c);
    __m512i w = _mm512_and_si512(_mm512_inserti64x4(_mm512_castsi256_si512(v), _mm256_srli_epi16(v, 4), 1), m4);
    if (FIVE) {  // bit 2c of each qh byte to bit 4 of the low half, bit 2c + 1 of the high half
      const __m512i hb = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_slli_epi16(h, 4)), _mm256_slli_epi16(h, 3), 1);
      w = _mm512_or_si512(w, _mm512_and_si512(hb, b4));
      h = _mm256_srli_epi16(h, 2);
    }
    const __m512i s = _mm512_permutexvar_epi16(
        _mm512_inserti64x4(_mm512_set1_epi16(static_cast<int16_t>(2 * c)), _mm256_set1_epi16(static_cast<int16_t>(2 * c + 1)), 1), sc);
    for (int r = 0; r < NR; ++r) {
      const __m512i a = _mm512_loadu_si512(t.q[r] + 256 * b + 64 * c);
      acc[r] = madd_acc512(acc[r], _mm512_maddubs_epi16(w, a), s);
    }
  }
  for (int r = 0; r < NR; ++r) q45_k_finish(t, r, b, fold(acc[r]), mins, d, dmin);
}
#endif

// The build's widest form of q45_k.
template <bool FIVE, int NR>
inline void q45_k_best(const uint8_t* p, Tile<NR>& t, int64_t b) {
#if defined(__AVX512BW__)
  q45_k_512<FIVE, NR>(p, t, b);
#else
  q45_k<FIVE, NR>(p, t, b);
#endif
}

// Q4_K (144 bytes a block) and Q5_K (FIVE: its 32 bytes of fifth bits more, 176).
template <bool FIVE>
struct Q45_K {
  template <int NR>
  using TileT = Tile<NR>;
  static constexpr int kElems = 256, kBytes = FIVE ? 176 : 144;
  template <int NR>
  static void block(const uint8_t* p, Tile<NR>& t, int64_t b) { q45_k_best<FIVE, NR>(p, t, b); }
};
using Q4_K = Q45_K<false>;
using Q5_K = Q45_K<true>;

// block_q6_K: ql[128], qh[64], scales[16] (int8, one per 16 weights), d (fp16). Half n of 128,
// its weight l + 32i (i = 0..3): the nibble of ql[64n + l + 32 (i & 1)] (low for i < 2) under bits
// 2i, 2i + 1 of qh[32n + l], minus 32; scale sc[8n + 2i + l / 16]. The weights go in as 0..63
// (unsigned, for maddubs) and the 32 comes off as 32 * sum_g sc_g * bsum_g.
struct Q6_K {
  template <int NR>
  using TileT = Tile<NR>;
  static constexpr int kElems = 256, kBytes = 210;
  template <int NR>
  static void block(const uint8_t* p, Tile<NR>& t, int64_t b) {
#if defined(__AVX512BW__)
    block512<NR>(p, t, b);
#else
    block256<NR>(p, t, b);
#endif
  }

#if defined(__AVX512BW__)
  // Half n's 64 bytes of ql as one zmm: low nibbles are its weights 0-63 in order, high nibbles
  // 64-127; qh's 32 bytes in both halves, each half shifting its own two bits to bits 4-5.
  template <int NR>
  static void block512(const uint8_t* p, Tile<NR>& t, int64_t b) {
    const float d = half(p + 208);
    const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 192)));
    const __m512i sc = _mm512_castsi256_si512(sc16);
    const __m512i m4 = _mm512_set1_epi8(0x0f), m2 = _mm512_set1_epi8(0x30);
    const __m512i up_a = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);
    const __m512i dn_b = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
    // int16 product lane l of the zmm of weights 64h..64h+63 of half n: scale 8n + 4h + l / 8
    const __m512i lanes = _mm512_srli_epi16(
        _mm512_set_epi16(31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17, 16, 15, 14, 13, 12, 11, 10, 9,
                         8, 7, 6, 5, 4, 3, 2, 1, 0), 3);
    __m512i acc[NR];
    for (int r = 0; r < NR; ++r) acc[r] = _mm512_setzero_si512();
    for (int n = 0; n < 2; ++n) {
      const __m512i l = _mm512_loadu_si512(p + 64 * n);
      const __m512i h = _mm512_broadcast_i64x4(load(p + 128 + 32 * n));
      const __m512i wa = _mm512_or_si512(_mm512_and_si512(l, m4), _mm512_and_si512(_mm512_sllv_epi16(h, up_a), m2));
      const __m512i wb = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l, 4), m4),
                                         _mm512_and_si512(_mm512_srlv_epi16(h, dn_b), m2));
      const __m512i sa = _mm512_permutexvar_epi16(_mm512_add_epi16(lanes, _mm512_set1_epi16(static_cast<int16_t>(8 * n))), sc);
      const __m512i sb = _mm512_permutexvar_epi16(_mm512_add_epi16(lanes, _mm512_set1_epi16(static_cast<int16_t>(8 * n + 4))), sc);
      for (int r = 0; r < NR; ++r) {
        const int8_t* a = t.q[r] + 256 * b + 128 * n;
        acc[r] = madd_acc512(acc[r], _mm512_maddubs_epi16(wa, _mm512_loadu_si512(a)), sa);
        acc[r] = madd_acc512(acc[r], _mm512_maddubs_epi16(wb, _mm512_loadu_si512(a + 64)), sb);
      }
    }
    for (int r = 0; r < NR; ++r) {
      const __m256i off = _mm256_slli_epi32(_mm256_madd_epi16(load(t.bs[r] + 16 * b), sc16), 5);
      const __m256i tot = _mm256_sub_epi32(fold(acc[r]), off);
      t.acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(tot), _mm256_set1_ps(d * t.d[r][b]), t.acc[r]);
    }
  }
#endif

  template <int NR>
  static void block256(const uint8_t* p, Tile<NR>& t, int64_t b) {
    const uint8_t* ql = p;
    const uint8_t* qh = p + 128;
    const float d = half(p + 208);
    const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 192)));
    const __m256i m4 = _mm256_set1_epi8(0x0f), m2 = _mm256_set1_epi8(0x30);
    __m256i acc0[NR], acc1[NR];
    for (int r = 0; r < NR; ++r) acc0[r] = acc1[r] = _mm256_setzero_si256();
    for (int n = 0; n < 2; ++n) {
      // scales 8n..8n+7 in both 128-bit lanes: the low lane's 16 products take 2i, the high's 2i + 1
      const __m256i s = _mm256_permute2x128_si256(sc16, sc16, n ? 0x11 : 0x00);
      const __m256i l0 = load(ql + 64 * n), l1 = load(ql + 64 * n + 32), h = load(qh + 32 * n);
      const __m256i lo[4] = {_mm256_and_si256(l0, m4), _mm256_and_si256(l1, m4),
                             _mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
                             _mm256_and_si256(_mm256_srli_epi16(l1, 4), m4)};
      const __m256i hi[4] = {_mm256_and_si256(_mm256_slli_epi16(h, 4), m2),
                             _mm256_and_si256(_mm256_slli_epi16(h, 2), m2), _mm256_and_si256(h, m2),
                             _mm256_and_si256(_mm256_srli_epi16(h, 2), m2)};
      for (int i = 0; i < 4; ++i) {
        const __m256i w = _mm256_or_si256(lo[i], hi[i]);
        const __m256i si = _mm256_shuffle_epi8(s, _mm256_set_m128i(
            _mm_set1_epi16(static_cast<int16_t>((4 * i + 3) << 8 | (4 * i + 2))),
            _mm_set1_epi16(static_cast<int16_t>((4 * i + 1) << 8 | 4 * i))));
        for (int r = 0; r < NR; ++r) {
          const __m256i pr = _mm256_maddubs_epi16(w, load(t.q[r] + 256 * b + 128 * n + 32 * i));
          if (i & 1) acc1[r] = madd_acc(acc1[r], pr, si);
          else acc0[r] = madd_acc(acc0[r], pr, si);
        }
      }
    }
    for (int r = 0; r < NR; ++r) {
      const __m256i off = _mm256_slli_epi32(_mm256_madd_epi16(load(t.bs[r] + 16 * b), sc16), 5);
      const __m256i tot = _mm256_sub_epi32(_mm256_add_epi32(acc0[r], acc1[r]), off);
      t.acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(tot), _mm256_set1_ps(d * t.d[r][b]), t.acc[r]);
    }
  }
};

// x float32 [M, K] (row stride ldx; K a multiple of 256) -> per block of 256 of each row: q int8
// [M, K] = round-half-even(x / d), d = max |x| / 127 float32 [M, K / 256], and bsums int16
// [M, K / 16], the sums of each 16 q.
inline void quantize_rows_k(const float* x, int64_t ldx, int M, int64_t K, int8_t* q, float* d, int16_t* bs) {
  const int64_t kb = K / 256, total = M * kb;
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  // a decode step's row is a few microseconds on one thread: no parallel region below a prefill's
#pragma omp parallel for schedule(static) if (total >= 128)
  for (int64_t idx = 0; idx < total; ++idx) {
    const int64_t i = idx / kb, b = idx % kb;
    const float* xb = x + i * ldx + 256 * b;
    int8_t* qb = q + i * K + 256 * b;
    __m256 amax = _mm256_setzero_ps();
    for (int u = 0; u < 32; ++u) amax = _mm256_max_ps(amax, _mm256_and_ps(_mm256_loadu_ps(xb + 8 * u), absmask));
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    const float dd = _mm_cvtss_f32(m) / 127.f;
    const __m256 id = _mm256_set1_ps(dd > 0.f ? 1.f / dd : 0.f);
    for (int u = 0; u < 8; ++u) {  // 32 values: to int8 in element order, and their two sums of 16
      __m256i qi[4];
      for (int v = 0; v < 4; ++v)
        qi[v] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(xb + 32 * u + 8 * v), id),
                                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      __m256i p8 = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3]));
      p8 = _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb + 32 * u), p8);
      const __m256i s01 = _mm256_add_epi32(qi[0], qi[1]), s23 = _mm256_add_epi32(qi[2], qi[3]);
      __m256i hs = _mm256_hadd_epi32(s01, s23);  // [s01 0+1, 2+3, s23 0+1, 2+3 | the high lanes' same]
      hs = _mm256_hadd_epi32(hs, hs);            // [s01 lo, s23 lo, .. | s01 hi, s23 hi, ..]
      const __m128i tot = _mm_add_epi32(_mm256_castsi256_si128(hs), _mm256_extracti128_si256(hs, 1));
      bs[i * (K / 16) + 16 * b + 2 * u] = static_cast<int16_t>(_mm_cvtsi128_si32(tot));
      bs[i * (K / 16) + 16 * b + 2 * u + 1] = static_cast<int16_t>(_mm_extract_epi32(tot, 1));
    }
    d[idx] = dd;
  }
}

}  // namespace kq
