// Small-batch int8 GEMM for CPUs with AVX512-VNNI: out[m, n] = sum_k a[m, k] * w[n, k], int32 and
// exact, for the W8A8 linear layers (layers/quantization/int8.py) when a step has few tokens.
// There torch._int_mm (oneDNN's s8s8s32 gemm) streams the weight at a third of the memory bandwidth
// (SmolLM2, 4 rows: 14 GB/s where fp32 weights stream at 40); this kernel reads each weight row
// once per call, in place (the [n, k] int8 weight the layer already holds), and keeps a tile of
// 16 output sums (1 x 16, 2 x 8, 3 x 5 or 4 x 4) in 16 registers.
//
// vpdpbusd multiplies unsigned bytes by signed bytes (four pairs summed into each int32 lane), so
// the activations are offset by 128 (a xor 0x80 = a + 128 as an unsigned byte) and 128 * wsum[j]
// (wsum[j] = sum_k w[j, k], computed once at load) is subtracted at the end: integer arithmetic
// throughout, hence bit-identical to torch._int_mm. No overflow: |partial sum| <= k * 255 * 127 <
// 2^31 for k < 66,000. Plain C ABI (ctypes); a's rows may be strided.
#include <algorithm>
#include <cstdint>
#include <vector>

#include <omp.h>

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define PAGEDLLM_VNNI 1
#endif

namespace {

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
#endif  // PAGEDLLM_VNNI

}  // namespace

extern "C" {

// 1 where this build has the kernel (the compiler targeted AVX512-VNNI and AVX512-BW), else 0.
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

}  // extern "C"
