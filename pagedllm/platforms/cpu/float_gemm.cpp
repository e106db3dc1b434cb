// Float GEMM of the linear layers on AVX-512 and AVX2 CPUs: y[M, N] = x[M, K] @ W[N, K]^T (+ bias),
// float32, or bfloat16 (AVX512-BF16 vdpbf16ps; AVX2 without AVX-512: bf16 widened to float32 as it
// loads, where oneDNN's emulated bf16 matmul made a SmolLM2 decode step 7x slower than float32),
// float32 accumulation. W is packed once after loading into 16-column panels; each thread takes a
// contiguous, equal share of the panels, and its register tile (AVX-512: MR rows x 16*NV columns,
// 24 accumulators; AVX2: 6 rows x 16 columns, 12) streams K from the packed panels with every row
// of x broadcast from memory (the classic BLIS-style microkernel: Van Zee & van de Geijn, 2015).
// The loops around the tile (panels per thread, row tiles, prefetch) are panel_gemm.h's.
//
// Why not oneDNN's packed linear: at decode-sized M (1-128 rows) and N of a few hundred columns,
// oneDNN splits the work unevenly over 2 threads; this loop measured 1.4-1.6x faster there
// (SmolLM2's qkv/o/down shapes, M = 48) and at least as fast at M = 2,048 (benchmarks/README.md
// section 10).
//
// Packed layout, P = ceil(N / 16) panels, columns past N zero:
//   float32:  [P][K][16]            element (n, k) at (n / 16) * 16 * K + k * 16 + n % 16
//   bfloat16: [P][ceil(K / 2)][16][2] pairs of consecutive k (vdpbf16ps multiplies pairs), a K
//             tail padded with zero; on AVX2, [P][K + K % 2][16] as float32's (the same size)
// Plain C ABI (ctypes): no torch headers.
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_math.h"
#include "panel_gemm.h"

namespace {

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define PAGEDLLM_FLOAT_GEMM 1
using pagedllm_cpu::kPanel;
using pagedllm_cpu::PanelMask;
using pagedllm_cpu::Prefetch;
#endif

#if defined(__AVX512F__)

inline __m512 bf16x16_to_f32_masked(const uint16_t* p, __mmask16 m) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}
// Accumulators <- bias (or 0); the last of NV vectors may be a partial panel (mask `tail`).
template <typename T, int MR, int NV>
inline void init_acc(__m512 (&acc)[MR][NV], const T* bias, __mmask16 tail) {
  for (int v = 0; v < NV; ++v) {
    __m512 b = _mm512_setzero_ps();
    if (bias != nullptr) {
      const __mmask16 m = v == NV - 1 ? tail : 0xffff;
      if constexpr (sizeof(T) == 4) b = _mm512_maskz_loadu_ps(m, bias + kPanel * v);
      else b = bf16x16_to_f32_masked(bias + kPanel * v, m);
    }
    for (int i = 0; i < MR; ++i) acc[i][v] = b;
  }
}

template <typename T, int MR, int NV>
inline void store_acc(const __m512 (&acc)[MR][NV], T* y, int64_t ldy, __mmask16 tail) {
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < NV; ++v) {
      const __mmask16 m = v == NV - 1 ? tail : 0xffff;
      if constexpr (sizeof(T) == 4) _mm512_mask_storeu_ps(y + i * ldy + kPanel * v, m, acc[i][v]);
#if defined(__AVX512BF16__)
      else  // round to nearest even, as PyTorch rounds
        _mm256_mask_storeu_epi16(y + i * ldy + kPanel * v, m, (__m256i)_mm512_cvtneps_pbh(acc[i][v]));
#endif
    }
}

// y[MR, 16*NV] = x[MR, K] @ panels (pstride elements apart) + bias.
template <int MR, int NV>
inline void tile(const float* x, int64_t ldx, const float* w, int64_t pstride, const float* bias, float* y,
                 int64_t ldy, int K, __mmask16 tail, const Prefetch& pf) {
  __m512 acc[MR][NV];
  init_acc<float, MR, NV>(acc, bias, tail);
  int done = 0;
  const char* const pf_at = pf.pf;
  const int pf_lines = pf.lines, pf_per_k = pf.per_k;
  for (int k = 0; k < K; ++k) {
    pagedllm_cpu::prefetch_step(pf_at, pf_lines, pf_per_k, done);
    __m512 b[NV];
    for (int v = 0; v < NV; ++v) b[v] = _mm512_loadu_ps(w + v * pstride + kPanel * k);
    for (int i = 0; i < MR; ++i) {
      const __m512 a = _mm512_set1_ps(x[i * ldx + k]);
      for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_fmadd_ps(a, b[v], acc[i][v]);
    }
  }
  store_acc<float, MR, NV>(acc, y, ldy, tail);
}

#if defined(__AVX512BF16__)
template <int MR, int NV>
inline void tile(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t pstride, const uint16_t* bias,
                 uint16_t* y, int64_t ldy, int K, __mmask16 tail, const Prefetch& pf) {
  __m512 acc[MR][NV];
  init_acc<uint16_t, MR, NV>(acc, bias, tail);
  const int pairs = K / 2;
  int done = 0;
  const char* const pf_at = pf.pf;
  const int pf_lines = pf.lines, pf_per_k = pf.per_k;
  for (int kk = 0; kk < pairs; ++kk) {
    pagedllm_cpu::prefetch_step(pf_at, pf_lines, pf_per_k, done);
    __m512i b[NV];
    for (int v = 0; v < NV; ++v) b[v] = _mm512_loadu_si512(w + v * pstride + 2 * kPanel * kk);
    for (int i = 0; i < MR; ++i) {
      uint32_t pair;  // x[i, 2kk] and x[i, 2kk + 1], the pair vdpbf16ps multiplies with each column's
      std::memcpy(&pair, x + i * ldx + 2 * kk, sizeof(pair));
      const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
      for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_dpbf16_ps(acc[i][v], a, (__m512bh)b[v]);
    }
  }
  if (K % 2) {  // the last k alone: its pair's second half is zero in the packed panel and here
    __m512i b[NV];
    for (int v = 0; v < NV; ++v) b[v] = _mm512_loadu_si512(w + v * pstride + 2 * kPanel * pairs);
    for (int i = 0; i < MR; ++i) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[i * ldx + K - 1]));
      for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_dpbf16_ps(acc[i][v], a, (__m512bh)b[v]);
    }
  }
  store_acc<uint16_t, MR, NV>(acc, y, ldy, tail);
}
#endif
#elif defined(PAGEDLLM_FLOAT_GEMM)
// AVX2. float32: y[MR, 16] = x[MR, K] @ one panel + bias; a partial panel (bits of `tail`) goes
// through a 16-column scratch row (loads and stores past N would leave the tensors).
// bfloat16 (no bf16 multiply on these CPUs): float32 arithmetic on widened values, rounded to bf16
// (nearest even) once at the end. gemm widens x to float32 once a call; the panels are k-major as
// float32's ([P][K][16], not pairs), and the tile widens each k row of 16 columns as it loads it
// (zero extension and a shift per 8: bf16 bits are the top half of a float's). The products and
// float32 sums are those of the float32 tile on the widened values; half the weight bytes make it
// 1.5-1.7x the float32 tile at 1 row and 1.05-1.1x at 48 (benchmarks/README.md section 17).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  return _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
// A tile's MR x 16 float32 results into y: all columns, or the first `cols` (a partial panel)
// through a scratch row.
template <int MR>
inline void store_tile(const __m256 (&acc)[MR][2], float* y, int64_t ldy, int cols) {
  for (int i = 0; i < MR; ++i) {
    if (cols == kPanel) {
      _mm256_storeu_ps(y + i * ldy, acc[i][0]);
      _mm256_storeu_ps(y + i * ldy + 8, acc[i][1]);
    } else {
      float row[kPanel];
      _mm256_storeu_ps(row, acc[i][0]);
      _mm256_storeu_ps(row + 8, acc[i][1]);
      std::memcpy(y + i * ldy, row, sizeof(float) * cols);
    }
  }
}
// Rounded to bf16. Not inlined: inlined, GCC kept the rounding's constants in registers through
// the tile's k loop and spilled accumulators to the stack at every k step (2x slower).
template <int MR>
__attribute__((noinline)) void store_tile(const __m256 (&acc)[MR][2], uint16_t* y, int64_t ldy, int cols) {
  for (int i = 0; i < MR; ++i) {
    uint16_t row[kPanel];
    _mm_storeu_si128(reinterpret_cast<__m128i*>(row), pagedllm_cpu::float_to_bf16_8(acc[i][0]));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(row + 8), pagedllm_cpu::float_to_bf16_8(acc[i][1]));
    std::memcpy(y + i * ldy, row, sizeof(uint16_t) * cols);
  }
}

// TW: the panel's element (float32, or bf16 widened here); TY: bias and output (float32 or bf16).
template <int MR, int NV, typename TW, typename TY>
inline void tile(const float* x, int64_t ldx, const TW* w, int64_t pstride, const TY* bias, TY* y, int64_t ldy,
                 int K, PanelMask tail, const Prefetch& pf) {
  static_assert(NV == 1, "AVX2 tiles take one panel");
  (void)pstride;
  const int cols = __builtin_popcount(tail);
  float b16[kPanel] = {};
  if (bias != nullptr)
    for (int c = 0; c < cols; ++c) b16[c] = pagedllm_cpu::as_float(bias[c]);
  __m256 acc[MR][2];
  for (int i = 0; i < MR; ++i) acc[i][0] = _mm256_loadu_ps(b16), acc[i][1] = _mm256_loadu_ps(b16 + 8);
  int done = 0;
  const char* const pf_at = pf.pf;
  const int pf_lines = pf.lines, pf_per_k = pf.per_k;
  for (int k = 0; k < K; ++k) {
    pagedllm_cpu::prefetch_step(pf_at, pf_lines, pf_per_k, done);
    const __m256 b0 = load8(w + kPanel * k), b1 = load8(w + kPanel * k + 8);
    for (int i = 0; i < MR; ++i) {
      const __m256 a = _mm256_broadcast_ss(x + i * ldx + k);
      acc[i][0] = _mm256_fmadd_ps(a, b0, acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(a, b1, acc[i][1]);
    }
  }
  if constexpr (sizeof(TY) == 4) {
    store_tile<MR>(acc, y, ldy, cols);
  } else {  // a copy: with acc's own address passed on, GCC stored acc to the stack at every k step
    __m256 out[MR][2];
    for (int i = 0; i < MR; ++i) out[i][0] = acc[i][0], out[i][1] = acc[i][1];
    store_tile<MR>(out, y, ldy, cols);
  }
}

#define PAGEDLLM_WIDEN_BF16 1
#endif  // __AVX512F__ / AVX2

#if defined(PAGEDLLM_FLOAT_GEMM)
// Rows of x per pass over the panels for prefill-sized steps (0: all rows in one pass). AVX2: a
// 192-row block of x (442 KiB at K = 576) is reread from L2 by every panel, where all 2,048 rows
// came from L3; SmolLM2's 4 shapes at 2,048 rows measured 1.02-1.10x (512 rows: neutral, so
// from 768 rows). AVX-512 keeps one pass, as measured on its host.
#if defined(__AVX512F__)
constexpr int kRowBlock = 0;
#else
constexpr int kRowBlock = 192;
#endif

// Whether T's panels hold k pairs (bf16 for vdpbf16ps) or k rows (float32; AVX2's widened bf16).
#if defined(PAGEDLLM_WIDEN_BF16)
template <typename T>
constexpr bool kPairs = false;
#else
template <typename T>
constexpr bool kPairs = sizeof(T) == 2;
#endif
// Elements of one packed panel (the same count either way: an odd K is padded to pairs).
template <typename T>
inline int64_t panel_elems(int K) {
  return sizeof(T) == 4 ? int64_t{kPanel} * K : int64_t{kPanel} * 2 * ((K + 1) / 2);
}

// Inside a parallel region, this thread's panels against all M rows of x (XT: T, or float32 where
// the tile widens bf16).
template <typename T, typename XT>
void thread_panels(const XT* x, int64_t ldx, const T* w_packed, const T* bias, T* y, int64_t ldy, int M, int N,
                   int K) {
  const int64_t ps = panel_elems<T>(K);
  const int steps = kPairs<T> ? (K + 1) / 2 : K;  // k steps of a tile
  const int rb = kRowBlock > 0 && M >= 4 * kRowBlock ? kRowBlock : M;
  for (int r0 = 0; r0 < M; r0 += rb) {  // each thread keeps its panels for every row block: no barrier
    const int mr = std::min(rb, M - r0);
    const XT* xr = x + r0 * ldx;
    T* yr = y + r0 * ldy;
    pagedllm_cpu::for_each_panel_run(N, [&](auto nv, int p, PanelMask tail, int next) {
      constexpr int NV = decltype(nv)::value;
      const T* b = bias ? bias + kPanel * p : nullptr;
      const T* wp = w_packed + p * ps;
      const char* pf = reinterpret_cast<const char*>(wp + NV * ps);  // the thread's next run, right after
      const int64_t pf_bytes = next * ps * static_cast<int64_t>(sizeof(T));
      pagedllm_cpu::for_each_row_tile<NV>(mr, steps, pf, pf_bytes, [&](auto rows, int i0, const Prefetch& pr) {
        tile<decltype(rows)::value, NV>(xr + i0 * ldx, ldx, wp, ps, b, yr + i0 * ldy + kPanel * p, ldy, K, tail, pr);
      });
    });
  }
}

template <typename T>
void gemm(const T* x, int64_t ldx, const T* w_packed, const T* bias, T* y, int64_t ldy, int M, int N, int K) {
#if defined(PAGEDLLM_WIDEN_BF16)
  if constexpr (sizeof(T) == 2) {
    // x widened once (every thread's tiles read all of it); the buffer grows, never shrinks, per
    // calling thread
    static thread_local std::vector<float> wide;
    if (wide.size() < static_cast<size_t>(M) * K) wide.resize(static_cast<size_t>(M) * K);
    float* xf = wide.data();
#pragma omp parallel
    {
#pragma omp for schedule(static)
      for (int i = 0; i < M; ++i)
        for (int k = 0; k < K; ++k) xf[int64_t{i} * K + k] = pagedllm_cpu::bf16_to_float(x[i * ldx + k]);
      thread_panels(static_cast<const float*>(xf), int64_t{K}, w_packed, bias, y, ldy, M, N, K);  // after the barrier
    }
  } else
#endif
  {
#pragma omp parallel
    thread_panels(x, ldx, w_packed, bias, y, ldy, M, N, K);
  }
}

template <typename T>
void pack(const T* w, int N, int K, T* out) {
  const int P = (N + kPanel - 1) / kPanel;
  const int64_t ps = panel_elems<T>(K);
  std::memset(out, 0, sizeof(T) * ps * P);
#pragma omp parallel for schedule(static)
  for (int p = 0; p < P; ++p)
    for (int c = 0; c < kPanel && p * kPanel + c < N; ++c) {
      const T* row = w + static_cast<int64_t>(p * kPanel + c) * K;
      T* dst = out + p * ps;
      for (int k = 0; k < K; ++k) {
        if constexpr (!kPairs<T>) dst[int64_t{k} * kPanel + c] = row[k];
        else dst[int64_t{k / 2} * 2 * kPanel + 2 * c + k % 2] = row[k];
      }
    }
}
#endif  // PAGEDLLM_FLOAT_GEMM

}  // namespace

extern "C" {

// 1 where this build has the float32 kernel (AVX-512 or AVX2 + FMA), 2 where it also has the
// bfloat16 one (AVX512-BF16, or AVX2's widening tile), else 0.
int float_gemm_level() {
#if (defined(__AVX512F__) && defined(__AVX512BF16__)) || defined(PAGEDLLM_WIDEN_BF16)
  return 2;
#elif defined(PAGEDLLM_FLOAT_GEMM)
  return 1;
#else
  return 0;
#endif
}

#if defined(PAGEDLLM_FLOAT_GEMM)
int64_t float_gemm_packed_elems_f32(int N, int K) { return panel_elems<float>(K) * ((N + kPanel - 1) / kPanel); }
int64_t float_gemm_packed_elems_bf16(int N, int K) { return panel_elems<uint16_t>(K) * ((N + kPanel - 1) / kPanel); }
void float_gemm_pack_f32(const float* w, int N, int K, float* out) { pack(w, N, K, out); }
void float_gemm_f32(const float* x, int64_t ldx, const float* w, const float* bias, float* y, int64_t ldy, int M,
                    int N, int K) {
  gemm(x, ldx, w, bias, y, ldy, M, N, K);
}
#if defined(__AVX512BF16__) || defined(PAGEDLLM_WIDEN_BF16)
void float_gemm_pack_bf16(const uint16_t* w, int N, int K, uint16_t* out) { pack(w, N, K, out); }
void float_gemm_bf16(const uint16_t* x, int64_t ldx, const uint16_t* w, const uint16_t* bias, uint16_t* y,
                     int64_t ldy, int M, int N, int K) {
  gemm(x, ldx, w, bias, y, ldy, M, N, K);
}
#endif
#endif

}  // extern "C"
