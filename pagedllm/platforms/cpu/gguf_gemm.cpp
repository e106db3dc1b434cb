// y = x @ W^T over a GGUF weight kept in its ggml blocks (platforms/cpu/gguf_gemm.py).
//
// As llama.cpp does (ggml-cpu/arch/x86/quants.c, ggml_vec_dot_*): the activations are quantized to
// 8 bits, for the 32-weight types in blocks of 32 along k (one float scale d and the float
// d * sum(q) a block: gguf_quantize_rows; the K-quants take blocks of 256, gguf_kquants.h says
// why), and every 32 weights of a block are unpacked in registers to 32 int8 values
// and dotted with the activation's 32 in integers (AVX-VNNI / AVX512-VNNI dpbusd where the build
// has it, else AVX2 maddubs + madd: both exact, as no product pair leaves int16). Each 32's int32
// sums go to float once, times the weight's and the activation's scales; the weight's minimum
// terms (Q4_1, Q5_1) come from the activation block's float sum.
//
// Block layouts: ggml-common.h (block_q8_0 ... block_q6_K). Threads: each takes an equal,
// contiguous share of the output rows (as panel_gemm.h splits panels); a thread walks its rows in
// chunks of 16 and each chunk against the rows of x in tiles of up to 4, so a weight block is
// unpacked once per 4 rows of x and a chunk is re-read from L1/L2 for the next tile. From
// kPanelMinRows rows (Q6_K: kPanelMinRowsQ6K) the K-quants instead unpack a super-block of 64
// weight rows once for all rows of x (gguf_panel.h: prefill and batched decode).
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "gguf_kquants.h"
#include "gguf_panel.h"

namespace {

using kq::half;

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

// ---- one weight block against the tile's rows; b0: the activation block of its first 32 weights
// The 32-weight types: a block is an activation block of 32 (Tile; the K-quants' is kq::Tile).
struct Blocks32 {
  template <int NR>
  using TileT = Tile<NR>;
  static constexpr int kElems = 32;
};

struct Q8_0 : Blocks32 {
  static constexpr int kBytes = 34;
  template <int NR>
  static void block(const uint8_t* p, Tile<NR>& t, int64_t b0) {
    add32<NR, true, false>(t, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 2)), half(p), 0.f, b0);
  }
};

struct Q4_0 : Blocks32 {
  static constexpr int kBytes = 18;
  template <int NR>
  static void block(const uint8_t* p, Tile<NR>& t, int64_t b0) {
    const __m256i w = _mm256_sub_epi8(nibbles_16(p + 2), _mm256_set1_epi8(8));
    add32<NR, true, false>(t, w, half(p), 0.f, b0);
  }
};

struct Q4_1 : Blocks32 {
  static constexpr int kBytes = 20;
  template <int NR>
  static void block(const uint8_t* p, Tile<NR>& t, int64_t b0) {
    add32<NR, false, true>(t, nibbles_16(p + 4), half(p), half(p + 2), b0);
  }
};

struct Q5_0 : Blocks32 {
  static constexpr int kBytes = 22;
  template <int NR>
  static void block(const uint8_t* p, Tile<NR>& t, int64_t b0) {
    const __m256i w = _mm256_or_si256(nibbles_16(p + 6), bit4_from_bits(p + 2));
    add32<NR, true, false>(t, _mm256_sub_epi8(w, _mm256_set1_epi8(16)), half(p), 0.f, b0);
  }
};

struct Q5_1 : Blocks32 {
  static constexpr int kBytes = 24;
  template <int NR>
  static void block(const uint8_t* p, Tile<NR>& t, int64_t b0) {
    const __m256i w = _mm256_or_si256(nibbles_16(p + 8), bit4_from_bits(p + 4));
    add32<NR, false, true>(t, w, half(p), half(p + 2), b0);
  }
};

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The quantized rows of x: q int8 [M, K]; per block of 32 (the 32-weight types) d and s float32
// [M, K / 32], or per block of 256 (the K-quants, gguf_kquants.h) d float32 [M, K / 256] and s the
// int16 sums of 16, [M, K / 16].
struct Rows {
  const int8_t* q;
  const float* d;
  const void* s;
  int64_t K;
};

template <int NR>
inline void start(Tile<NR>& t, const Rows& x, int64_t i0) {
  for (int r = 0; r < NR; ++r) {
    t.q[r] = x.q + (i0 + r) * x.K;
    t.d[r] = x.d + (i0 + r) * (x.K / 32);
    t.s[r] = static_cast<const float*>(x.s) + (i0 + r) * (x.K / 32);
    t.acc[r] = _mm256_setzero_ps();
    t.mins[r] = 0.f;
  }
}

template <int NR>
inline void start(kq::Tile<NR>& t, const Rows& x, int64_t i0) {
  for (int r = 0; r < NR; ++r) {
    t.q[r] = x.q + (i0 + r) * x.K;
    t.d[r] = x.d + (i0 + r) * (x.K / 256);
    t.bs[r] = static_cast<const int16_t*>(x.s) + (i0 + r) * (x.K / 16);
    t.acc[r] = _mm256_setzero_ps();
  }
}

template <int NR>
inline float result(const Tile<NR>& t, int r) { return hsum(t.acc[r]) + t.mins[r]; }

template <int NR>
inline float result(const kq::Tile<NR>& t, int r) { return hsum(t.acc[r]); }

// How far ahead of the block being unpacked a thread asks for its weight bytes (_mm_prefetch, one
// request a cache line). Measured on a 2-core AVX-512 host (M = 1, 28 layers' Q4_K gate_up and down,
// 620 MiB): the hardware prefetcher alone kept the row kernels at ~12 GB/s of a 25 GB/s read probe;
// 4-12 KiB ahead, 18-21 GB/s (a thread's next rows: its share is contiguous). Prefetches past the
// weight's end are hints, never faults.
constexpr int64_t kPrefetchBytes = 8192;

template <class T>
inline void prefetch_block(const uint8_t* p) {
  for (int u = 0; u < T::kBytes; u += 64) _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetchBytes + u), _MM_HINT_T0);
}

// Rows i0..i0+NR-1 of x against weight row w: out[r * ldo] for r < NR. Block b of the weight row
// meets activation block b (the types' blocks are the activation's: 32, or 256 for the K-quants).
template <class T, int NR>
inline void dot_rows(const uint8_t* w, int64_t nblocks, const Rows& x, int64_t i0, float* out, int64_t ldo) {
  typename T::template TileT<NR> t;
  start(t, x, i0);
  for (int64_t b = 0; b < nblocks; ++b) {
    prefetch_block<T>(w + b * T::kBytes);
    T::template block<NR>(w + b * T::kBytes, t, b);
  }
  for (int r = 0; r < NR; ++r) out[r * ldo] = result(t, r);
}

// Weight rows w0 and w1 against row i0 of x (a decode step's M = 1): out[0], out[1], each the value
// dot_rows<T, 1> gives. Two independent chains in one loop, so the core overlaps one row's
// unpacking with the other's sums (~5 % over one row at a time, measured as kPrefetchBytes).
template <class T>
inline void dot_2w(const uint8_t* w0, const uint8_t* w1, int64_t nblocks, const Rows& x, int64_t i0, float* out) {
  typename T::template TileT<1> t0, t1;
  start(t0, x, i0);
  start(t1, x, i0);
  for (int64_t b = 0; b < nblocks; ++b) {
    prefetch_block<T>(w0 + b * T::kBytes);
    prefetch_block<T>(w1 + b * T::kBytes);
    T::template block<1>(w0 + b * T::kBytes, t0, b);
    T::template block<1>(w1 + b * T::kBytes, t1, b);
  }
  out[0] = result(t0, 0);
  out[1] = result(t1, 0);
}

constexpr int kRowChunk = 16;  // weight rows a thread takes through all tiles of x before the next
constexpr int kTileRows = 4;   // rows of x a weight block is unpacked for

// Output rows [j0, j1) of W (one thread's share): in chunks of kRowChunk, each chunk against x's
// rows in tiles of kTileRows.
template <class T>
void gemm_rows(const Rows& x, int M, const uint8_t* w, int64_t j0, int64_t j1, float* out, int64_t ldo) {
  const int64_t nblocks = x.K / T::kElems, row_bytes = nblocks * T::kBytes;
  for (int64_t jc = j0; jc < j1; jc += kRowChunk) {
    const int64_t je = std::min<int64_t>(jc + kRowChunk, j1);
    for (int i = 0; i < M; i += kTileRows) {
      const int rows = std::min(kTileRows, M - i);
      int64_t j = jc;
      if (rows == 1)
        for (; j + 1 < je; j += 2) dot_2w<T>(w + j * row_bytes, w + (j + 1) * row_bytes, nblocks, x, i, out + i * ldo + j);
      for (; j < je; ++j) {
        const uint8_t* wr = w + j * row_bytes;
        float* o = out + i * ldo + j;
        switch (rows) {
          case 4: dot_rows<T, 4>(wr, nblocks, x, i, o, ldo); break;
          case 3: dot_rows<T, 3>(wr, nblocks, x, i, o, ldo); break;
          case 2: dot_rows<T, 2>(wr, nblocks, x, i, o, ldo); break;
          default: dot_rows<T, 1>(wr, nblocks, x, i, o, ldo); break;
        }
      }
    }
  }
}

// Rows of x from which the K-quants take the panel GEMM (gguf_panel.h) instead of the row kernels.
// One thread, GFLOP/s, row kernels vs panels, two alternated rounds (host load 8-11): Q4_K
// 8960x1536 at 3 rows 76/55 vs 73/61, 4 rows 84/62 vs 94/77, 5 rows 72/52 vs 108/87; Q6_K
// 1536x8960 (a heavier unpacking: 48 gathers a 16 columns, not 32) at 4 rows 107/90 vs 56/53,
// 7 rows 105/91 vs 80/77, and from 16 rows the panels win (16 rows: 106-122 vs 163-188).
constexpr int kPanelMinRows = 4;
constexpr int kPanelMinRowsQ6K = 8;

template <class T>
void gemm_panels(const Rows& x, int M, const uint8_t* w, int64_t j0, int64_t j1, float* out, int64_t ldo) {
  kp::gemm_panels<T>(x.q, x.d, static_cast<const int16_t*>(x.s), M, x.K, w, j0, j1, out, ldo);
}

// gemm_rows of ggml `type`; false for a type without a kernel.
bool gemm_rows_of(int type, const Rows& x, int M, const uint8_t* w, int64_t j0, int64_t j1, float* out,
                  int64_t ldo) {
  if (M >= (type == 14 ? kPanelMinRowsQ6K : kPanelMinRows)) {
    switch (type) {
      case 12: gemm_panels<kq::Q4_K>(x, M, w, j0, j1, out, ldo); return true;
      case 13: gemm_panels<kq::Q5_K>(x, M, w, j0, j1, out, ldo); return true;
      case 14: gemm_panels<kq::Q6_K>(x, M, w, j0, j1, out, ldo); return true;
      default: break;
    }
  }
  switch (type) {
    case 2: gemm_rows<Q4_0>(x, M, w, j0, j1, out, ldo); return true;
    case 3: gemm_rows<Q4_1>(x, M, w, j0, j1, out, ldo); return true;
    case 6: gemm_rows<Q5_0>(x, M, w, j0, j1, out, ldo); return true;
    case 7: gemm_rows<Q5_1>(x, M, w, j0, j1, out, ldo); return true;
    case 8: gemm_rows<Q8_0>(x, M, w, j0, j1, out, ldo); return true;
    case 12: gemm_rows<kq::Q4_K>(x, M, w, j0, j1, out, ldo); return true;
    case 13: gemm_rows<kq::Q5_K>(x, M, w, j0, j1, out, ldo); return true;
    case 14: gemm_rows<kq::Q6_K>(x, M, w, j0, j1, out, ldo); return true;
    default: return false;
  }
}

bool is_k_quant(int type) { return type == 12 || type == 13 || type == 14; }

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

// x float32 [M, K] (row stride ldx; K a multiple of 256) -> the K-quants' activation: per block
// of 256, q int8 [M, K], d float32 [M, K / 256] and the int16 sums of each 16, bs [M, K / 16]
// (gguf_kquants.h).
void gguf_quantize_rows_k(const float* x, int64_t ldx, int M, int64_t K, int8_t* q, float* d, int16_t* bs) {
  kq::quantize_rows_k(x, ldx, M, K, q, d, bs);
}

// out [M, N] float32 (row stride ldo) = x @ W^T for W the N rows of ggml `type` blocks at w (each
// row K / block elements blocks, contiguous), x given as gguf_quantize_rows' q, d, s for the
// 32-weight types or gguf_quantize_rows_k's q, d, bs for the K-quants (12-14). Returns 0, or -1
// for a type without a kernel.
int gguf_gemm(int type, const int8_t* q, const float* d, const void* s, int M, int64_t K, const uint8_t* w,
              int64_t N, float* out, int64_t ldo) {
  if (!gguf_gemm_supported(type)) return -1;
  const Rows x{q, d, s, K};
#pragma omp parallel
  {
    const int nt = omp_get_num_threads(), th = omp_get_thread_num();
    gemm_rows_of(type, x, M, w, N * th / nt, N * (th + 1) / nt, out, ldo);
  }
  return 0;
}

// A whole linear layer in one call (ops.gguf_linear's fast path): out [M, sum of rows] float32 (row
// stride ldo) = x @ W^T, W given as nseg segments of types[i] blocks at ptrs[i], rows[i] output rows
// from column firsts[i]. x float32 [M, K] (row stride ldx) is quantized here, once per activation
// block its segments take, into this thread's scratch; then one parallel region in which each
// thread takes an equal share of every segment's rows (one fork and join for a fused q/k/v or
// gate/up layer, where a call per segment took one each). Returns 0, or -1 (nothing written) for a
// type without a kernel or a K its blocks do not divide.
int gguf_linear(const float* x, int64_t ldx, int M, int64_t K, int nseg, const int32_t* types,
                const int64_t* firsts, const int64_t* rows, const uint64_t* ptrs, float* out, int64_t ldo) {
  bool need32 = false, need256 = false;
  for (int i = 0; i < nseg; ++i) {
    if (!gguf_gemm_supported(types[i]) || K % (is_k_quant(types[i]) ? 256 : 32)) return -1;
    (is_k_quant(types[i]) ? need256 : need32) = true;
  }
  thread_local std::vector<int8_t> q32, q256;
  thread_local std::vector<float> d32, s32, d256;
  thread_local std::vector<int16_t> bs256;
  Rows x32{nullptr, nullptr, nullptr, K}, x256{nullptr, nullptr, nullptr, K};
  if (need32) {
    q32.resize(M * K);
    d32.resize(M * K / 32);
    s32.resize(M * K / 32);
    gguf_quantize_rows(x, ldx, M, K, q32.data(), d32.data(), s32.data());
    x32 = Rows{q32.data(), d32.data(), s32.data(), K};
  }
  if (need256) {
    q256.resize(M * K);
    d256.resize(M * K / 256);
    bs256.resize(M * K / 16);
    kq::quantize_rows_k(x, ldx, M, K, q256.data(), d256.data(), bs256.data());
    x256 = Rows{q256.data(), d256.data(), bs256.data(), K};
  }
#pragma omp parallel
  {
    const int nt = omp_get_num_threads(), th = omp_get_thread_num();
    for (int i = 0; i < nseg; ++i) {
      const int64_t n = rows[i];
      gemm_rows_of(types[i], is_k_quant(types[i]) ? x256 : x32, M, reinterpret_cast<const uint8_t*>(ptrs[i]),
                   n * th / nt, n * (th + 1) / nt, out + firsts[i], ldo);
    }
  }
  return 0;
}

}  // extern "C"
