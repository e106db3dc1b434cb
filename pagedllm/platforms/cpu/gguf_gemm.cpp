// y = x @ W^T over a GGUF weight kept in its ggml blocks (platforms/cpu/gguf_gemm.py).
//
// As llama.cpp does (ggml-cpu/arch/x86/quants.c, ggml_vec_dot_*): the activations are quantized to
// 8 bits, here in blocks of 32 along k (one float scale d and the float d * sum(q) a block:
// gguf_quantize_rows), and every 32 weights of a block are unpacked in registers to 32 int8 values
// and dotted with the activation's 32 in integers (AVX-VNNI / AVX512-VNNI dpbusd where the build
// has it, else AVX2 maddubs + madd: both exact, as no product pair leaves int16). Each 32's int32
// sums go to float once, times the weight's and the activation's scales; the weight's minimum
// terms (Q4_1, Q5_1, Q4_K, Q5_K) come from the activation block's float sum.
//
// Block layouts: ggml-common.h (block_q8_0 ... block_q6_K). Threads: each takes an equal,
// contiguous share of the output rows (as panel_gemm.h splits panels); a thread walks its rows in
// chunks of 16 and each chunk against the rows of x in tiles of up to 4, so a weight block is
// unpacked once per 4 rows of x and a chunk is re-read from L1/L2 for the next tile.
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

inline float half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// 8 int32 lanes, each the sum of 4 products of unsigned bytes u and signed bytes s.
inline __m256i dot_us(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

// The 16 bytes v as 32 values: low nibbles (elements 0-15), then high nibbles (16-31).
inline __m256i nibbles_16(const uint8_t* p) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i m = _mm_set1_epi8(0x0f);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m), _mm_and_si128(v, m));
}

// The 32 bits at p as 32 bytes: 0x10 where bit j is set, else 0 (ggml's bytes_from_bits_32).
inline __m256i bit4_from_bits(const uint8_t* p) {
  uint32_t x;
  std::memcpy(&x, p, 4);
  const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
  __m256i b = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(x)), shuf);
  b = _mm256_or_si256(b, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
  return _mm256_and_si256(_mm256_cmpeq_epi8(b, _mm256_set1_epi64x(-1)), _mm256_set1_epi8(0x10));
}

// The activation rows of a tile: their int8 values, scales and scaled sums per block of 32.
template <int NR>
struct Tile {
  const int8_t* q[NR];
  const float* d[NR];
  const float* s[NR];
  __m256 acc[NR];
  float mins[NR];
};

// 32 weights w (signed when SIGNED, else unsigned bytes) of scale fw and minimum mw (w_true =
// fw * w + mw) against activation block b of each row.
template <int NR, bool SIGNED, bool MIN>
inline void add32(Tile<NR>& t, __m256i w, float fw, float mw, int64_t b) {
  const __m256i u = SIGNED ? _mm256_sign_epi8(w, w) : w;
  for (int r = 0; r < NR; ++r) {
    __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t.q[r] + 32 * b));
    if (SIGNED) a = _mm256_sign_epi8(a, w);
    const __m256 p = _mm256_cvtepi32_ps(dot_us(u, a));
    t.acc[r] = _mm256_fmadd_ps(p, _mm256_set1_ps(fw * t.d[r][b]), t.acc[r]);
    if (MIN) t.mins[r] += mw * t.s[r][b];
  }
}

// Signed 32 weights with one integer scale per 16 (Q6_K): sc16 holds them as AVX2 int16 lanes
// (8 of the first, 8 of the second) or, under VNNI, int32 lanes (4 and 4).
template <int NR>
inline void add32_scaled(Tile<NR>& t, __m256i w, __m256i sc, float fw, int64_t b) {
  const __m256i u = _mm256_sign_epi8(w, w);
  for (int r = 0; r < NR; ++r) {
    __m256i a = _mm256_sign_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(t.q[r] + 32 * b)), w);
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
    const __m256i p = _mm256_mullo_epi32(dot_us(u, a), sc);
#else
    const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(u, a), sc);
#endif
    t.acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(fw * t.d[r][b]), t.acc[r]);
  }
}

// ---- one weight block against the tile's rows; b0: the activation block of its first 32 weights
struct Q8_0 {
  static constexpr int kElems = 32, kBytes = 34;
  template <int NR>
  static void block(const uint8_t* p, Tile<NR>& t, int64_t b0) {
    add32<NR, true, false>(t, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 2)), half(p), 0.f, b0);
  }
};

struct Q4_0 {
  static constexpr int kElems = 32, kBytes = 18;
  template <int NR>
  static void block(const uint8_t* p, Tile<NR>& t, int64_t b0) {
    const __m256i w = _mm256_sub_epi8(nibbles_16(p + 2), _mm256_set1_epi8(8));
    add32<NR, true, false>(t, w, half(p), 0.f, b0);
  }
};

struct Q4_1 {
  static constexpr int kElems = 32, kBytes = 20;
  template <int NR>
  static void block(const uint8_t* p, Tile<NR>& t, int64_t b0) {
    add32<NR, false, true>(t, nibbles_16(p + 4), half(p), half(p + 2), b0);
  }
};

struct Q5_0 {
  static constexpr int kElems = 32, kBytes = 22;
  template <int NR>
  static void block(const uint8_t* p, Tile<NR>& t, int64_t b0) {
    const __m256i w = _mm256_or_si256(nibbles_16(p + 6), bit4_from_bits(p + 2));
    add32<NR, true, false>(t, _mm256_sub_epi8(w, _mm256_set1_epi8(16)), half(p), 0.f, b0);
  }
};

struct Q5_1 {
  static constexpr int kElems = 32, kBytes = 24;
  template <int NR>
  static void block(const uint8_t* p, Tile<NR>& t, int64_t b0) {
    const __m256i w = _mm256_or_si256(nibbles_16(p + 8), bit4_from_bits(p + 4));
    add32<NR, false, true>(t, w, half(p), half(p + 2), b0);
  }
};

// The 6-bit scale and minimum of sub-block j of a Q4_K / Q5_K block (ggml's get_scale_min_k4).
inline void scale_min_k4(int j, const uint8_t* q, int& sc, int& m) {
  if (j < 4) {
    sc = q[j] & 63;
    m = q[j + 4] & 63;
  } else {
    sc = (q[j + 4] & 0xf) | ((q[j - 4] >> 6) << 4);
    m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// block_q4_K: d, dmin (fp16), scales[12], qs[128]; 8 sub-blocks of 32, the 64 weights of chunk c
// in qs[32c..32c+31], low nibbles then high.
struct Q4_K {
  static constexpr int kElems = 256, kBytes = 144;
  template <int NR>
  static void block(const uint8_t* p, Tile<NR>& t, int64_t b0) {
    const float d = half(p), dmin = half(p + 2);
    const uint8_t* sc = p + 4;
    const uint8_t* qs = p + 16;
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    for (int c = 0; c < 4; ++c) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * c));
      int s1, m1, s2, m2;
      scale_min_k4(2 * c, sc, s1, m1);
      scale_min_k4(2 * c + 1, sc, s2, m2);
      add32<NR, false, true>(t, _mm256_and_si256(v, m4), d * s1, -dmin * m1, b0 + 2 * c);
      add32<NR, false, true>(t, _mm256_and_si256(_mm256_srli_epi16(v, 4), m4), d * s2, -dmin * m2, b0 + 2 * c + 1);
    }
  }
};

// block_q5_K: d, dmin, scales[12], qh[32], qs[128]: Q4_K's nibbles plus a fifth bit, chunk c's
// low half from bit 2c of qh[l], its high half from bit 2c + 1.
struct Q5_K {
  static constexpr int kElems = 256, kBytes = 176;
  template <int NR>
  static void block(const uint8_t* p, Tile<NR>& t, int64_t b0) {
    const float d = half(p), dmin = half(p + 2);
    const uint8_t* sc = p + 4;
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16));
    const uint8_t* qs = p + 48;
    const __m256i m4 = _mm256_set1_epi8(0x0f), one = _mm256_set1_epi8(1);
    for (int c = 0; c < 4; ++c) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * c));
      const __m256i h1 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * c), one), 4);
      const __m256i h2 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * c + 1), one), 4);
      int s1, m1, s2, m2;
      scale_min_k4(2 * c, sc, s1, m1);
      scale_min_k4(2 * c + 1, sc, s2, m2);
      add32<NR, false, true>(t, _mm256_or_si256(_mm256_and_si256(v, m4), h1), d * s1, -dmin * m1, b0 + 2 * c);
      add32<NR, false, true>(t, _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), m4), h2), d * s2,
                             -dmin * m2, b0 + 2 * c + 1);
    }
  }
};

// Two int8 scales as the scale vector of add32_scaled.
inline __m256i scale_pair(int8_t a, int8_t b) {
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
  return _mm256_set_epi32(b, b, b, b, a, a, a, a);
#else
  return _mm256_set_m128i(_mm_set1_epi16(b), _mm_set1_epi16(a));
#endif
}

// block_q6_K: ql[128], qh[64], scales[16] (int8, one per 16), d (fp16); per half n of 128: weight
// l + 32i (i = 0..3) is the nibble of ql[64n + l + 32 (i & 1)] (low for i < 2) with bits 2i, 2i + 1
// of qh[32n + l] above it, minus 32.
struct Q6_K {
  static constexpr int kElems = 256, kBytes = 210;
  template <int NR>
  static void block(const uint8_t* p, Tile<NR>& t, int64_t b0) {
    const uint8_t* ql = p;
    const uint8_t* qh = p + 128;
    const int8_t* sc = reinterpret_cast<const int8_t*>(p + 192);
    const float d = half(p + 208);
    const __m256i m4 = _mm256_set1_epi8(0x0f), m2 = _mm256_set1_epi8(3), off = _mm256_set1_epi8(32);
    for (int n = 0; n < 2; ++n) {
      const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 64 * n));
      const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 64 * n + 32));
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh + 32 * n));
      const __m256i lo[4] = {_mm256_and_si256(l0, m4), _mm256_and_si256(l1, m4),
                             _mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
                             _mm256_and_si256(_mm256_srli_epi16(l1, 4), m4)};
      for (int i = 0; i < 4; ++i) {
        const __m256i hi = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2 * i), m2), 4);
        const __m256i w = _mm256_sub_epi8(_mm256_or_si256(lo[i], hi), off);
        const int8_t* s = sc + 8 * n + 2 * i;
        add32_scaled<NR>(t, w, scale_pair(s[0], s[1]), d, b0 + 4 * n + i);
      }
    }
  }
};

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Rows i0..i0+NR-1 of x against weight row w: out[r * ldo] for r < NR.
template <class T, int NR>
inline void dot_rows(const uint8_t* w, int64_t nblocks, const int8_t* q, const float* d, const float* s,
                     int64_t K, int64_t i0, float* out, int64_t ldo) {
  Tile<NR> t;
  const int64_t kb = K / 32;
  for (int r = 0; r < NR; ++r) {
    t.q[r] = q + (i0 + r) * K;
    t.d[r] = d + (i0 + r) * kb;
    t.s[r] = s + (i0 + r) * kb;
    t.acc[r] = _mm256_setzero_ps();
    t.mins[r] = 0.f;
  }
  constexpr int sub = T::kElems / 32;
  for (int64_t b = 0; b < nblocks; ++b) T::template block<NR>(w + b * T::kBytes, t, b * sub);
  for (int r = 0; r < NR; ++r) out[r * ldo] = hsum(t.acc[r]) + t.mins[r];
}

constexpr int kRowChunk = 16;  // weight rows a thread takes through all tiles of x before the next
constexpr int kTileRows = 4;   // rows of x a weight block is unpacked for

template <class T>
void gemm(const int8_t* q, const float* d, const float* s, int M, int64_t K, const uint8_t* w, int64_t N,
          float* out, int64_t ldo) {
  const int64_t nblocks = K / T::kElems, row_bytes = nblocks * T::kBytes;
#pragma omp parallel
  {
    const int nt = omp_get_num_threads(), th = omp_get_thread_num();
    const int64_t j0 = N * th / nt, j1 = N * (th + 1) / nt;
    for (int64_t jc = j0; jc < j1; jc += kRowChunk) {
      const int64_t je = std::min<int64_t>(jc + kRowChunk, j1);
      for (int i = 0; i < M; i += kTileRows) {
        const int rows = std::min(kTileRows, M - i);
        for (int64_t j = jc; j < je; ++j) {
          const uint8_t* wr = w + j * row_bytes;
          float* o = out + i * ldo + j;
          switch (rows) {
            case 4: dot_rows<T, 4>(wr, nblocks, q, d, s, K, i, o, ldo); break;
            case 3: dot_rows<T, 3>(wr, nblocks, q, d, s, K, i, o, ldo); break;
            case 2: dot_rows<T, 2>(wr, nblocks, q, d, s, K, i, o, ldo); break;
            default: dot_rows<T, 1>(wr, nblocks, q, d, s, K, i, o, ldo); break;
          }
        }
      }
    }
  }
}

}  // namespace

extern "C" {

// ggml type ids (ggml.h enum ggml_type) this file has a kernel for; 0 elsewhere.
int gguf_gemm_supported(int type) {
  switch (type) {
    case 2: case 3: case 6: case 7: case 8: case 12: case 13: case 14: return 1;
    default: return 0;
  }
}

// 1 when the build has a VNNI dot product (AVX512-VNNI or AVX-VNNI), 0 for AVX2 maddubs.
int gguf_gemm_vnni() {
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
  return 1;
#else
  return 0;
#endif
}

// x float32 [M, K] (row stride ldx; K a multiple of 32) -> per block of 32 of each row: q int8
// [M, K], d = max|x| / 127 and s = d * sum(q), float32 [M, K / 32]; q = round-half-even(x / d).
void gguf_quantize_rows(const float* x, int64_t ldx, int M, int64_t K, int8_t* q, float* d, float* s) {
  const int64_t kb = K / 32, total = M * kb;
  // A decode step's few rows take a microsecond or two on one thread: no parallel region (its
  // start and barrier cost more, and far more on a host whose cores are shared).
#pragma omp parallel for schedule(static) if (total >= 1024)
  for (int64_t idx = 0; idx < total; ++idx) {
    const int64_t i = idx / kb, b = idx % kb;
    const float* xb = x + i * ldx + 32 * b;
    __m256 amax = _mm256_setzero_ps();
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int u = 0; u < 4; ++u) amax = _mm256_max_ps(amax, _mm256_and_ps(_mm256_loadu_ps(xb + 8 * u), absmask));
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    const float dd = _mm_cvtss_f32(m) / 127.f;
    const __m256 id = _mm256_set1_ps(dd > 0.f ? 1.f / dd : 0.f);
    __m256i qi[4];
    for (int u = 0; u < 4; ++u)
      qi[u] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(xb + 8 * u), id),
                                                 _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    const __m256i sum = _mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]), _mm256_add_epi32(qi[2], qi[3]));
    const __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    const __m128i s2 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
    const int tot = _mm_cvtsi128_si32(_mm_add_epi32(s2, _mm_shuffle_epi32(s2, 0xb1)));
    // int32 -> int8 in element order (packs interleave 128-bit lanes; the permute undoes it)
    const __m256i p16a = _mm256_packs_epi32(qi[0], qi[1]), p16b = _mm256_packs_epi32(qi[2], qi[3]);
    __m256i p8 = _mm256_packs_epi16(p16a, p16b);
    p8 = _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + i * K + 32 * b), p8);
    d[idx] = dd;
    s[idx] = dd * static_cast<float>(tot);
  }
}

// out [M, N] float32 (row stride ldo) = x @ W^T for W the N rows of ggml `type` blocks at w (each
// row K / block elements blocks, contiguous), x given as gguf_quantize_rows' q, d, s. Returns 0,
// or -1 for a type without a kernel.
int gguf_gemm(int type, const int8_t* q, const float* d, const float* s, int M, int64_t K, const uint8_t* w,
              int64_t N, float* out, int64_t ldo) {
  switch (type) {
    case 2: gemm<Q4_0>(q, d, s, M, K, w, N, out, ldo); return 0;
    case 3: gemm<Q4_1>(q, d, s, M, K, w, N, out, ldo); return 0;
    case 6: gemm<Q5_0>(q, d, s, M, K, w, N, out, ldo); return 0;
    case 7: gemm<Q5_1>(q, d, s, M, K, w, N, out, ldo); return 0;
    case 8: gemm<Q8_0>(q, d, s, M, K, w, N, out, ldo); return 0;
    case 12: gemm<Q4_K>(q, d, s, M, K, w, N, out, ldo); return 0;
    case 13: gemm<Q5_K>(q, d, s, M, K, w, N, out, ldo); return 0;
    case 14: gemm<Q6_K>(q, d, s, M, K, w, N, out, ldo); return 0;
    default: return -1;
  }
}

}  // extern "C"
