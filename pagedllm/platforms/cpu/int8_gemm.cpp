// int8 GEMMs for CPUs with AVX512-VNNI: out[m, n] = sum_k a[m, k] * w[n, k], int32 and exact, for
// the W8A8 linear layers (layers/quantization/int8.py): a small-batch kernel over the layer's own
// weight when a step has few tokens (below), and a panel GEMM over a packed weight for any number
// of rows, which the LM head uses (further down).
//
// Small batches: there torch._int_mm (oneDNN's s8s8s32 gemm) streams the weight at a third of the memory bandwidth
// (SmolLM2, 4 rows: 14 GB/s where fp32 weights stream at 40); this kernel reads each weight row
// once per call, in place (the [n, k] int8 weight the layer already holds), and keeps a tile of
// 16 output sums (1 x 16, 2 x 8, 3 x 5 or 4 x 4) in 16 registers.
//
// Both: vpdpbusd multiplies unsigned bytes by signed bytes (four pairs summed into each int32 lane), so
// the activations are offset by 128 (a xor 0x80 = a + 128 as an unsigned byte) and 128 * wsum[j]
// (wsum[j] = sum_k w[j, k], computed once at load) is subtracted at the end: integer arithmetic
// throughout, hence bit-identical to torch._int_mm. No overflow: |partial sum| <= k * 255 * 127 <
// 2^31 for k < 66,000. Plain C ABI (ctypes); a's rows may be strided.
//
// AVX2 (no VNNI): the panel GEMM only, with the same packed layout and the same exact integers
// (further down); torch._int_mm ran at 2 GOP/s on such a CPU, a reference loop.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include <omp.h>

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>

#include "cpu_math.h"
#include "panel_gemm.h"
#define PAGEDLLM_VNNI 1
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include "cpu_math.h"
#include "panel_gemm.h"
#define PAGEDLLM_INT8_AVX2 1
#endif
#if defined(PAGEDLLM_VNNI) || defined(PAGEDLLM_INT8_AVX2)
#define PAGEDLLM_INT8_PANELS 1
#endif

namespace {

#ifdef PAGEDLLM_INT8_PANELS
// Bytes of one packed panel (the layout: above the VNNI panel GEMM): 16 columns x 4 k a 64-byte row.
inline int64_t panel_bytes(int k) { return int64_t{64} * ((k + 3) / 4); }
#endif

#ifdef PAGEDLLM_VNNI
// {sum(v[0]), ..., sum(v[15])} of int32 lanes: a transposing add tree (45 shuffles/adds).
inline __m512i hsum16_epi32(const __m512i* v) {
  __m512i x[8], y[4], z[2];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: {a0+a2, b0+b2, a1+a3, b1+b3}
    x[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(v[2 * i], v[2 * i + 1]),
                            _mm512_unpackhi_epi32(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)  // per lane: {a, b, c, d} partial sums of that lane
    y[i] = _mm512_add_epi32(_mm512_unpacklo_epi64(x[2 * i], x[2 * i + 1]),
                            _mm512_unpackhi_epi64(x[2 * i], x[2 * i + 1]));
  for (int i = 0; i < 2; ++i)
    z[i] = _mm512_add_epi32(_mm512_shuffle_i32x4(y[2 * i], y[2 * i + 1], 0x88),
                            _mm512_shuffle_i32x4(y[2 * i], y[2 * i + 1], 0xdd));
  return _mm512_add_epi32(_mm512_shuffle_i32x4(z[0], z[1], 0x88), _mm512_shuffle_i32x4(z[0], z[1], 0xdd));
}

// Rows [0, MR) of a (already offset to unsigned bytes) times weight rows j0 .. j0 + NC - 1
// (indices past n - 1 repeat the last row; only valid columns are stored); MR * NC <= 16:
// acc[r * NC + c] holds 16 partial sums of (row r, column j0 + c).
template <int MR, int NC>
inline void tile(const uint8_t* a, int k, const int8_t* w, const int32_t* wsum, int n, int j0, int32_t* out,
                 int64_t ldo) {
  static_assert(MR * NC <= 16, "16 accumulators");
  const int8_t* wr[NC];
  for (int c = 0; c < NC; ++c) wr[c] = w + static_cast<int64_t>(std::min(j0 + c, n - 1)) * k;
  __m512i acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_si512();
  int kk = 0;
  for (; kk + 64 <= k; kk += 64) {
    __m512i ar[MR];
    for (int r = 0; r < MR; ++r) ar[r] = _mm512_loadu_si512(a + r * k + kk);
    for (int c = 0; c < NC; ++c) {
      const __m512i wc = _mm512_loadu_si512(wr[c] + kk);
      for (int r = 0; r < MR; ++r) acc[r * NC + c] = _mm512_dpbusd_epi32(acc[r * NC + c], ar[r], wc);
    }
  }
  if (kk < k) {  // the last k % 64 bytes: weights masked to 0, so whatever a holds there adds 0
    const __mmask64 mask = ~0ULL >> (64 - (k - kk));
    __m512i ar[MR];
    for (int r = 0; r < MR; ++r) ar[r] = _mm512_maskz_loadu_epi8(mask, a + r * k + kk);
    for (int c = 0; c < NC; ++c) {
      const __m512i wc = _mm512_maskz_loadu_epi8(mask, wr[c] + kk);
      for (int r = 0; r < MR; ++r) acc[r * NC + c] = _mm512_dpbusd_epi32(acc[r * NC + c], ar[r], wc);
    }
  }
  alignas(64) int32_t s[16];
  _mm512_store_si512(s, hsum16_epi32(acc));
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NC && j0 + c < n; ++c) out[r * ldo + j0 + c] = s[r * NC + c] - 128 * wsum[j0 + c];
}

constexpr int kPrefetchGroups = 4;

// All m rows against the NC columns of group g, MR rows a tile (then single rows).
template <int MR, int NC>
inline void tiles(const uint8_t* a, int m, int k, const int8_t* w, const int32_t* wsum, int n, int g, int32_t* out) {
  const int j0 = g * NC;
  // The weight rows of the group kPrefetchGroups ahead, into L2: each row is only k bytes (a few
  // cache lines), too short a stream for the hardware prefetcher to reach full bandwidth.
  const int jp = j0 + kPrefetchGroups * NC;
  if (jp < n) {
    const char* p = reinterpret_cast<const char*>(w + static_cast<int64_t>(jp) * k);
    const int64_t bytes = static_cast<int64_t>(std::min(NC, n - jp)) * k;
    for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(p + off, _MM_HINT_T1);
  }
  int i0 = 0;
  for (; i0 + MR <= m; i0 += MR)
    tile<MR, NC>(a + static_cast<int64_t>(i0) * k, k, w, wsum, n, j0, out + static_cast<int64_t>(i0) * n, n);
  for (; i0 < m; ++i0)
    tile<1, NC>(a + static_cast<int64_t>(i0) * k, k, w, wsum, n, j0, out + static_cast<int64_t>(i0) * n, n);
}

template <int MR, int NC>
void gemm(const uint8_t* a, int m, int k, const int8_t* w, const int32_t* wsum, int n, int32_t* out) {
  const int groups = (n + NC - 1) / NC;
#pragma omp parallel for schedule(static) if (static_cast<int64_t>(n) * k >= 65536)
  for (int g = 0; g < groups; ++g) tiles<MR, NC>(a, m, k, w, wsum, n, g, out);
}

// ---- The panel GEMM: the weight packed once at load, any number of rows. ----
// Packed layout, P = ceil(n / 16) panels of 16 columns, K4 = ceil(k / 4) groups of 4 k:
//   [P][K4][16][4] int8, element (j, c) at (j / 16) * 64 * K4 + (c / 4) * 64 + (j % 16) * 4 + c % 4,
//   zero past n and k. One 64-byte row of a panel is what vpdpbusd multiplies with 4 bytes of a
//   row of a (broadcast): 16 columns, 4 k each. The loops around the register tile (panels per
//   thread, row tiles, prefetch of the next panels) are panel_gemm.h's, as for the float GEMM.

// One register tile: rows [i0, i0 + MR) of a (offset bytes, lda apart) against NV panels from w;
// store(i, v, sums, mask) receives row i's exact int32 sums for the 16 columns of panel v.
template <int MR, int NV, typename Store>
inline void panel_tile(const uint8_t* a, int64_t lda, const int8_t* w, int64_t ps, const int32_t* wsum,
                       int k4, __mmask16 tail, const pagedllm_cpu::Prefetch& pf, Store&& store) {
  __m512i acc[MR][NV];
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_setzero_si512();
  int done = 0;
  const char* const pf_at = pf.pf;
  const int pf_lines = pf.lines, pf_per_k = pf.per_k;
  for (int kk = 0; kk < k4; ++kk) {
    pagedllm_cpu::prefetch_step(pf_at, pf_lines, pf_per_k, done);
    __m512i b[NV];
    for (int v = 0; v < NV; ++v) b[v] = _mm512_loadu_si512(w + v * ps + 64 * static_cast<int64_t>(kk));
    for (int i = 0; i < MR; ++i) {
      int32_t quad;  // a[i, 4kk .. 4kk + 3] + 128, as the 4 unsigned bytes vpdpbusd takes
      std::memcpy(&quad, a + i * lda + 4 * kk, sizeof(quad));
      const __m512i av = _mm512_set1_epi32(quad);
      for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_dpbusd_epi32(acc[i][v], av, b[v]);
    }
  }
  for (int v = 0; v < NV; ++v) {
    const __mmask16 m = v == NV - 1 ? tail : 0xffff;
    // minus 128 * sum_k w[j, k]: the offset added to a
    const __m512i corr = _mm512_slli_epi32(_mm512_maskz_loadu_epi32(m, wsum + 16 * v), 7);
    for (int i = 0; i < MR; ++i) store(i, v, _mm512_sub_epi32(acc[i][v], corr), m);
  }
}

// au [m, lda_u] (a + 128, rows padded) against the packed weight, store as in panel_tile, with
// row i0 + i of each tile passed as (i0 + i). Inside a parallel region.
template <typename Store>
inline void panel_loops(const uint8_t* au, int64_t lda_u, int m, int k4, const int8_t* wp, int64_t ps,
                        const int32_t* wsum, int n, Store&& store) {
  pagedllm_cpu::for_each_panel_run(n, [&](auto nv, int p, __mmask16 tail, int next) {
    constexpr int NV = decltype(nv)::value;
    const int8_t* w = wp + p * ps;
    const char* pf = reinterpret_cast<const char*>(w + NV * ps);  // the thread's next run, right after
    pagedllm_cpu::for_each_row_tile<NV>(m, k4, pf, next * ps, [&](auto rows, int i0, const pagedllm_cpu::Prefetch& pr) {
      panel_tile<decltype(rows)::value, NV>(au + i0 * lda_u, lda_u, w, ps, wsum + 16 * p, k4, tail, pr,
                                            [&](int i, int v, __m512i sums, __mmask16 mask) {
                                              store(i0 + i, 16 * (p + v), sums, mask);
                                            });
    });
  });
}

// 16 floats to T at p (mask: the valid lanes); bf16 rounded as pagedllm_cpu::float_to_bf16.
inline void store16(float* p, __m512 f, __mmask16 mask) { _mm512_mask_storeu_ps(p, mask, f); }
inline void store16(uint16_t* p, __m512 f, __mmask16 mask) {
  _mm256_mask_storeu_epi16(p, mask, pagedllm_cpu::float_to_bf16_16(f));
}

inline __m512 load16f(const float* p, __mmask16 mask) { return _mm512_maskz_loadu_ps(mask, p); }
inline __m512 load16f(const uint16_t* p, __mmask16 mask) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, p)), 16));
}

// The whole W8A8 linear on the panels, for rows of x in T (float or bf16): each row quantized
// (amax, scale, int8 values offset by 128) straight into the GEMM's input buffer, the int32 sums
// turned into T in the tile (rnd(float(sum) * sx[i] * sw[j] (+ bias[j]))). The same operations,
// in the same order, as quantize_rows + int8_panel_gemm + int8_epilogue (platforms/cpu/fused_ops.cpp), so the
// same bits; this file is built with -ffp-contract=off, so no product is fused into an add.
template <typename T>
void panel_linear(const T* x, int64_t ldx, int m, int k, const int8_t* wp, const int32_t* wsum, const float* sw,
                  const T* bias, int n, T* out) {
  const int k4 = (k + 3) / 4;
  const int64_t lda_u = 4 * int64_t{k4};
  std::vector<uint8_t> au(static_cast<size_t>(m) * lda_u, 0);
  std::vector<float> sx(m);
  const int64_t ps = panel_bytes(k);
#pragma omp parallel
  {
#pragma omp for schedule(static)
    for (int i = 0; i < m; ++i) sx[i] = pagedllm_cpu::quantize_row(x + i * ldx, k, au.data() + i * lda_u, 0x80);
    // (the implicit barrier: every row is quantized before any tile reads it)
    panel_loops(au.data(), lda_u, m, k4, wp, ps, wsum, n, [&](int i, int j0, __m512i sums, __mmask16 mask) {
      __m512 f = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(sums), _mm512_set1_ps(sx[i])),
                               _mm512_maskz_loadu_ps(mask, sw + j0));
      if (bias) f = _mm512_add_ps(f, load16f(bias + j0, mask));
      store16(out + static_cast<int64_t>(i) * n + j0, f, mask);
    });
  }
}
#endif  // PAGEDLLM_VNNI

#ifdef PAGEDLLM_INT8_AVX2
// ---- The panel GEMM on AVX2, the same packed layout. ----
// vpmaddubsw multiplies unsigned bytes by signed bytes and adds pairs into int16 with saturation.
// As in llama.cpp's AVX2 dot products, |a| (an unsigned byte: -128 gives 128) times sign(a) * w
// (vpsignb) gives the same products, a pair sums to at most 2 * 128 * 127 = 32,512 < 2^15 (never
// saturates), and vpmaddwd by ones adds the pairs into int32 lanes: exact. It needs w in
// [-127, 127] (vpsignb cannot negate -128), which is all the int8 method writes (int8.py: QMAX).
// No offset, so no wsum correction.
// A 64-byte panel row is two ymm: columns 0-7 and 8-15, 4 k each.
using pagedllm_cpu::PanelMask;
using pagedllm_cpu::Prefetch;

// Rows [0, MR) of a (lda apart), MR <= 3 (6 accumulators, 2 panel halves, ones and 4 temporaries
// in 16 ymm), against the panel at w: store(i, sums of columns 0-7, of 8-15).
template <int MR, typename Store>
inline void panel_tile3(const int8_t* a, int64_t lda, const int8_t* w, int k4, const Prefetch& pf, Store&& store) {
  static_assert(MR >= 1 && MR <= 3, "3 rows at most");
  __m256i acc[MR][2];
  for (int i = 0; i < MR; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_si256();
  const __m256i ones = _mm256_set1_epi16(1);
  int done = 0;
  const char* const pf_at = pf.pf;
  const int pf_lines = pf.lines, pf_per_k = pf.per_k;
  for (int kk = 0; kk < k4; ++kk) {
    pagedllm_cpu::prefetch_step(pf_at, pf_lines, pf_per_k, done);
    const __m256i b0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 64 * static_cast<int64_t>(kk)));
    const __m256i b1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 64 * static_cast<int64_t>(kk) + 32));
    for (int i = 0; i < MR; ++i) {
      int32_t quad;  // a[i, 4kk .. 4kk + 3]
      std::memcpy(&quad, a + i * lda + 4 * kk, sizeof(quad));
      const __m256i av = _mm256_set1_epi32(quad), au = _mm256_abs_epi8(av);
      acc[i][0] = _mm256_add_epi32(acc[i][0], _mm256_madd_epi16(_mm256_maddubs_epi16(au, _mm256_sign_epi8(b0, av)), ones));
      acc[i][1] = _mm256_add_epi32(acc[i][1], _mm256_madd_epi16(_mm256_maddubs_epi16(au, _mm256_sign_epi8(b1, av)), ones));
    }
  }
  for (int i = 0; i < MR; ++i) store(i, acc[i][0], acc[i][1]);
}

// A tile of panel_gemm.h's MR (<= 6) rows as tiles of at most 3 (the second reads the panel from
// L1/L2; the first takes the prefetch).
template <int MR, typename Store>
inline void panel_tile(const int8_t* a, int64_t lda, const int8_t* w, int k4, const Prefetch& pf, Store&& store) {
  constexpr int R0 = MR < 3 ? MR : 3;
  panel_tile3<R0>(a, lda, w, k4, pf, store);
  if constexpr (MR > R0)
    panel_tile3<MR - R0>(a + R0 * lda, lda, w, k4, Prefetch{nullptr, 0, 0},
                         [&](int i, __m256i lo, __m256i hi) { store(R0 + i, lo, hi); });
}

// a [m, lda] (int8, rows padded with zeros to 4k4 bytes) against the packed weight:
// store(row, first column, sums of its 16 columns as two ymm, valid columns). In a parallel region.
template <typename Store>
inline void panel_loops(const int8_t* a, int64_t lda, int m, int k4, const int8_t* wp, int64_t ps, int n,
                        Store&& store) {
  pagedllm_cpu::for_each_panel_run(n, [&](auto, int p, PanelMask tail, int next) {
    const int8_t* w = wp + p * ps;
    const int cols = __builtin_popcount(tail);
    pagedllm_cpu::for_each_row_tile<1>(m, k4, reinterpret_cast<const char*>(w + ps), next * ps,
                                       [&](auto rows, int i0, const Prefetch& pr) {
      panel_tile<decltype(rows)::value>(a + i0 * lda, lda, w, k4, pr, [&](int i, __m256i lo, __m256i hi) {
        alignas(32) int32_t sums[16];
        _mm256_store_si256(reinterpret_cast<__m256i*>(sums), lo);
        _mm256_store_si256(reinterpret_cast<__m256i*>(sums + 8), hi);
        store(i0 + i, 16 * p, sums, cols);
      });
    });
  });
}

// The W8A8 linear as the VNNI panel_linear (the same bits as quantize_rows + int8_panel_gemm +
// int8_epilogue): rows quantized to int8 (no offset) into the GEMM's input, the epilogue per tile.
template <typename T>
void panel_linear(const T* x, int64_t ldx, int m, int k, const int8_t* wp, const float* sw, const T* bias, int n,
                  T* out) {
  const int k4 = (k + 3) / 4;
  const int64_t lda = 4 * int64_t{k4};
  std::vector<int8_t> aq(static_cast<size_t>(m) * lda, 0);
  std::vector<float> sx(m);
  const int64_t ps = panel_bytes(k);
#pragma omp parallel
  {
#pragma omp for schedule(static)
    for (int i = 0; i < m; ++i) sx[i] = pagedllm_cpu::quantize_row(x + i * ldx, k, aq.data() + i * lda, 0);
    panel_loops(aq.data(), lda, m, k4, wp, ps, n, [&](int i, int j0, const int32_t* sums, int cols) {
      T* o = out + static_cast<int64_t>(i) * n + j0;
      const float s = sx[i];
      for (int c = 0; c < cols; ++c)  // int8_epilogue's expression and order
        pagedllm_cpu::put(&o[c], bias ? static_cast<float>(sums[c]) * s * sw[j0 + c] + pagedllm_cpu::as_float(bias[j0 + c])
                                      : static_cast<float>(sums[c]) * s * sw[j0 + c]);
    });
  }
}
#endif  // PAGEDLLM_INT8_AVX2

}  // namespace

extern "C" {

// 2 where this build has the panel GEMM on AVX512-VNNI, 1 where on AVX2, else 0.
int int8_panel_level() {
#if defined(PAGEDLLM_VNNI)
  return 2;
#elif defined(PAGEDLLM_INT8_PANELS)
  return 1;
#else
  return 0;
#endif
}

// 1 where this build has the small-batch kernel (the compiler targeted AVX512-VNNI and AVX512-BW), else 0.
int int8_gemm_available() {
#ifdef PAGEDLLM_VNNI
  return 1;
#else
  return 0;
#endif
}

// a int8 [m, k] (row stride lda), w int8 [n, k] contiguous, wsum int32 [n], out int32 [m, n].
// Threads split the columns; each thread's weight rows are read once, for all m rows.
void int8_gemm(const int8_t* a, int64_t lda, int m, int k, const int8_t* w, const int32_t* wsum, int n,
               int32_t* out) {
#ifdef PAGEDLLM_VNNI
  std::vector<uint8_t> au(static_cast<size_t>(m) * k);  // a + 128 as unsigned bytes, rows packed
  for (int i = 0; i < m; ++i)
    for (int c = 0; c < k; ++c) au[static_cast<size_t>(i) * k + c] = static_cast<uint8_t>(a[i * lda + c] ^ 0x80);
  // 16 accumulators a tile: one row x 16 columns, 2 x 8, 3 x 5, else 4 x 4 (and 1 x 4 for the rest).
  switch (m) {
    case 1: gemm<1, 16>(au.data(), m, k, w, wsum, n, out); break;
    case 2: gemm<2, 8>(au.data(), m, k, w, wsum, n, out); break;
    case 3: gemm<3, 5>(au.data(), m, k, w, wsum, n, out); break;
    default: gemm<4, 4>(au.data(), m, k, w, wsum, n, out); break;
  }
#else
  (void)a, (void)lda, (void)m, (void)k, (void)w, (void)wsum, (void)n, (void)out;
#endif
}

// Elements of the packed form of an int8 [n, k] weight (see the panel GEMM above).
int64_t int8_panel_elems(int n, int k) {
#ifdef PAGEDLLM_INT8_PANELS
  return panel_bytes(k) * ((n + 15) / 16);
#else
  (void)n, (void)k;
  return 0;
#endif
}

// w int8 [n, k] contiguous -> out, int8_panel_elems(n, k) bytes.
void int8_panel_pack(const int8_t* w, int n, int k, int8_t* out) {
#ifdef PAGEDLLM_INT8_PANELS
  const int P = (n + 15) / 16;
  const int64_t ps = panel_bytes(k);
  std::memset(out, 0, static_cast<size_t>(ps * P));
#pragma omp parallel for schedule(static)
  for (int p = 0; p < P; ++p)
    for (int j = p * 16; j < std::min(n, p * 16 + 16); ++j)
      for (int c = 0; c < k; ++c) out[p * ps + (c / 4) * 64 + (j % 16) * 4 + c % 4] = w[static_cast<int64_t>(j) * k + c];
#else
  (void)w, (void)n, (void)k, (void)out;
#endif
}

// The packed form back to w int8 [n, k] contiguous (the inverse of int8_panel_pack).
void int8_panel_unpack(const int8_t* packed, int n, int k, int8_t* w) {
#ifdef PAGEDLLM_INT8_PANELS
  const int P = (n + 15) / 16;
  const int64_t ps = panel_bytes(k);
  const int k4_full = k / 4;  // whole groups of 4 k: one 4-byte copy each
#pragma omp parallel for schedule(static)
  for (int p = 0; p < P; ++p)
    for (int j = p * 16; j < std::min(n, p * 16 + 16); ++j) {
      int8_t* row = w + static_cast<int64_t>(j) * k;
      const int8_t* src = packed + p * ps + (j % 16) * 4;
      for (int kk = 0; kk < k4_full; ++kk) std::memcpy(row + 4 * kk, src + 64 * static_cast<int64_t>(kk), 4);
      for (int c = 4 * k4_full; c < k; ++c) row[c] = src[(c / 4) * 64 + c % 4];
    }
#else
  (void)packed, (void)n, (void)k, (void)w;
#endif
}

// a int8 [m, k] (row stride lda) @ the packed weight's transpose -> out int32 [m, n] (exact).
void int8_panel_gemm(const int8_t* a, int64_t lda, int m, int k, const int8_t* wp, const int32_t* wsum, int n,
                     int32_t* out) {
#ifdef PAGEDLLM_VNNI
  const int k4 = (k + 3) / 4;
  const int64_t lda_u = 4 * int64_t{k4};
  std::vector<uint8_t> au(static_cast<size_t>(m) * lda_u, 0);  // a + 128, rows padded to 4 bytes
  for (int i = 0; i < m; ++i)
    for (int c = 0; c < k; ++c) au[i * lda_u + c] = static_cast<uint8_t>(a[i * lda + c] ^ 0x80);
  const int64_t ps = panel_bytes(k);
#pragma omp parallel
  panel_loops(au.data(), lda_u, m, k4, wp, ps, wsum, n, [&](int i, int j0, __m512i sums, __mmask16 mask) {
    _mm512_mask_storeu_epi32(out + static_cast<int64_t>(i) * n + j0, mask, sums);
  });
#elif defined(PAGEDLLM_INT8_AVX2)
  (void)wsum;
  const int k4 = (k + 3) / 4;
  const int64_t lda_p = 4 * int64_t{k4};
  std::vector<int8_t> ap(static_cast<size_t>(m) * lda_p, 0);  // a, rows padded to 4 bytes
  for (int i = 0; i < m; ++i) std::memcpy(&ap[i * lda_p], a + i * lda, k);
  const int64_t ps = panel_bytes(k);
#pragma omp parallel
  panel_loops(ap.data(), lda_p, m, k4, wp, ps, n, [&](int i, int j0, const int32_t* sums, int cols) {
    std::memcpy(out + static_cast<int64_t>(i) * n + j0, sums, sizeof(int32_t) * cols);
  });
#else
  (void)a, (void)lda, (void)m, (void)k, (void)wp, (void)wsum, (void)n, (void)out;
#endif
}

// The W8A8 linear on the packed weight, x [m, k] (row stride ldx) in float32 or bf16 -> out [m, n]
// in the same dtype: quantize_rows + int8_panel_gemm + int8_epilogue in one call, the same bits.
// sw: the weight's float32 scales [n]; bias [n] in x's dtype, or null.
void int8_panel_linear_f32(const float* x, int64_t ldx, int m, int k, const int8_t* wp, const int32_t* wsum,
                           const float* sw, const float* bias, int n, float* out) {
#if defined(PAGEDLLM_VNNI)
  panel_linear(x, ldx, m, k, wp, wsum, sw, bias, n, out);
#elif defined(PAGEDLLM_INT8_AVX2)
  (void)wsum;
  panel_linear(x, ldx, m, k, wp, sw, bias, n, out);
#else
  (void)x, (void)ldx, (void)m, (void)k, (void)wp, (void)wsum, (void)sw, (void)bias, (void)n, (void)out;
#endif
}
void int8_panel_linear_bf16(const uint16_t* x, int64_t ldx, int m, int k, const int8_t* wp, const int32_t* wsum,
                            const float* sw, const uint16_t* bias, int n, uint16_t* out) {
#if defined(PAGEDLLM_VNNI)
  panel_linear(x, ldx, m, k, wp, wsum, sw, bias, n, out);
#elif defined(PAGEDLLM_INT8_AVX2)
  (void)wsum;
  panel_linear(x, ldx, m, k, wp, sw, bias, n, out);
#else
  (void)x, (void)ldx, (void)m, (void)k, (void)wp, (void)wsum, (void)sw, (void)bias, (void)n, (void)out;
#endif
}

}  // extern "C"
