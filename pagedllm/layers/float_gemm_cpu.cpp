// Float GEMM of the linear layers on AVX-512 CPUs: y[M, N] = x[M, K] @ W[N, K]^T (+ bias), float32
// or bfloat16 (AVX512-BF16 vdpbf16ps), float32 accumulation. W is packed once after loading into
// 16-column panels; each thread takes a contiguous, equal share of the panels, and its register
// tile (MR rows x 16*NV columns, 24 accumulators) streams K from the packed panels with every row
// of x broadcast from memory (the classic BLIS-style microkernel: Van Zee & van de Geijn, 2015).
//
// Why not oneDNN's packed linear: at decode-sized M (1-128 rows) and N of a few hundred columns,
// oneDNN splits the work unevenly over 2 threads; this loop measured 1.4-1.6x faster there
// (SmolLM2's qkv/o/down shapes, M = 48) and at least as fast at M = 2,048 (benchmarks/README.md
// section 10).
//
// Packed layout, P = ceil(N / 16) panels, columns past N zero:
//   float32:  [P][K][16]            element (n, k) at (n / 16) * 16 * K + k * 16 + n % 16
//   bfloat16: [P][ceil(K / 2)][16][2] pairs of consecutive k (vdpbf16ps multiplies pairs), a K
//             tail padded with zero
// Plain C ABI (ctypes): no torch headers.
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace {

#if defined(__AVX512F__)
constexpr int kPanel = 16;  // columns per packed panel (one zmm of float32)
// Rows from which the next panels are prefetched. A SmolLM2 step's linears (30 layers + LM head,
// 2 threads, ms, without -> with): float32 24 rows 20.7 -> 16.0, 48 rows 35.3 -> 30.0; bf16 24 rows
// 11.5 -> 8.5, 48 rows 18.7 -> 15.8. Under it the loop streams the weights at memory speed already
// (1 row: 49 GB/s) and extra prefetches measured 3-10 % slower.
constexpr int kPrefetchMinRows = 12;

inline __m512 bf16x16_to_f32_masked(const uint16_t* p, __mmask16 m) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}
// The next panels' weights into L2 while this tile computes: `lines` cache lines from `pf`, at most
// `per_k` a k step. Without it each new run of panels starts on DRAM latency (weights are read
// once a step, from memory, for every row tile after the first they come from L2).
struct Prefetch {
  const char* pf;
  int lines, per_k;
  inline void step(int& done) const {
    for (int u = 0; u < per_k && done < lines; ++u, ++done) _mm_prefetch(pf + 64 * static_cast<int64_t>(done), _MM_HINT_T1);
  }
};

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
  for (int k = 0; k < K; ++k) {
    pf.step(done);
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
  for (int kk = 0; kk < pairs; ++kk) {
    pf.step(done);
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

// All M rows against NV consecutive panels: tiles of MR rows (24 accumulators), then the rest; the
// row tiles share out the prefetch of the next `pf_bytes` of weights at `pf`.
template <typename T, int NV>
void panels(const T* x, int64_t ldx, const T* w, int64_t pstride, const T* bias, T* y, int64_t ldy, int M, int K,
            __mmask16 tail, const char* pf, int64_t pf_bytes) {
  constexpr int MR = NV == 4 ? 6 : NV == 3 ? 8 : NV == 2 ? 12 : 24;
  const int tiles = (M + MR - 1) / MR, steps = sizeof(T) == 4 ? K : (K + 1) / 2;
  const int lines = M >= kPrefetchMinRows ? static_cast<int>((pf_bytes + 63) / 64) : 0;
  const int per_tile = (lines + tiles - 1) / tiles;
  auto prefetch = [&](int t) {
    const int first = std::min(lines, t * per_tile), n = std::min(lines, first + per_tile) - first;
    return Prefetch{pf + 64 * static_cast<int64_t>(first), n, (n + steps - 1) / std::max(steps, 1)};
  };
  int m = 0;
  for (; m + MR <= M; m += MR) tile<MR, NV>(x + m * ldx, ldx, w, pstride, bias, y + m * ldy, ldy, K, tail, prefetch(m / MR));
  const Prefetch last = prefetch(m / MR);
  x += m * ldx;
  y += m * ldy;
  switch (M - m) {
#define PAGEDLLM_ROWS(R) \
  case R:                \
    if constexpr (R < MR) tile<R, NV>(x, ldx, w, pstride, bias, y, ldy, K, tail, last); \
    break;
    PAGEDLLM_ROWS(1) PAGEDLLM_ROWS(2) PAGEDLLM_ROWS(3) PAGEDLLM_ROWS(4) PAGEDLLM_ROWS(5) PAGEDLLM_ROWS(6)
    PAGEDLLM_ROWS(7) PAGEDLLM_ROWS(8) PAGEDLLM_ROWS(9) PAGEDLLM_ROWS(10) PAGEDLLM_ROWS(11) PAGEDLLM_ROWS(12)
    PAGEDLLM_ROWS(13) PAGEDLLM_ROWS(14) PAGEDLLM_ROWS(15) PAGEDLLM_ROWS(16) PAGEDLLM_ROWS(17)
    PAGEDLLM_ROWS(18) PAGEDLLM_ROWS(19) PAGEDLLM_ROWS(20) PAGEDLLM_ROWS(21) PAGEDLLM_ROWS(22)
    PAGEDLLM_ROWS(23)
#undef PAGEDLLM_ROWS
    default:
      break;
  }
}

// Elements of one packed panel.
template <typename T>
inline int64_t panel_elems(int K) {
  return sizeof(T) == 4 ? int64_t{kPanel} * K : int64_t{kPanel} * 2 * ((K + 1) / 2);
}

template <typename T>
void gemm(const T* x, int64_t ldx, const T* w_packed, const T* bias, T* y, int64_t ldy, int M, int N, int K) {
  const int P = (N + kPanel - 1) / kPanel;
  const int64_t ps = panel_elems<T>(K);
  const __mmask16 last_tail = N % kPanel ? static_cast<__mmask16>((1u << (N % kPanel)) - 1) : 0xffff;
#pragma omp parallel
  {
    // Thread t of nt: panels [P t / nt, P (t + 1) / nt), in runs of 4 (64 columns), then 3, 2 or 1.
    const int nt = omp_get_num_threads(), t = omp_get_thread_num();
    const int p0 = static_cast<int>(int64_t{P} * t / nt), p1 = static_cast<int>(int64_t{P} * (t + 1) / nt);
    for (int p = p0; p < p1;) {
      const int nv = std::min(4, p1 - p);
      const __mmask16 tail = p + nv == P ? last_tail : 0xffff;
      const T* b = bias ? bias + kPanel * p : nullptr;
      const T* wp = w_packed + p * ps;
      T* yp = y + kPanel * p;
      // This thread's next run of panels, contiguous after this one.
      const char* pf = reinterpret_cast<const char*>(wp + nv * ps);
      const int64_t pf_bytes = static_cast<int64_t>(std::min(4, p1 - p - nv)) * ps * sizeof(T);
      switch (nv) {
        case 4: panels<T, 4>(x, ldx, wp, ps, b, yp, ldy, M, K, tail, pf, pf_bytes); break;
        case 3: panels<T, 3>(x, ldx, wp, ps, b, yp, ldy, M, K, tail, pf, pf_bytes); break;
        case 2: panels<T, 2>(x, ldx, wp, ps, b, yp, ldy, M, K, tail, pf, pf_bytes); break;
        default: panels<T, 1>(x, ldx, wp, ps, b, yp, ldy, M, K, tail, pf, pf_bytes); break;
      }
      p += nv;
    }
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
        if constexpr (sizeof(T) == 4) dst[int64_t{k} * kPanel + c] = row[k];
        else dst[int64_t{k / 2} * 2 * kPanel + 2 * c + k % 2] = row[k];
      }
    }
}
#endif  // __AVX512F__

}  // namespace

extern "C" {

// 1 where this build has the float32 kernel, 2 where it also has the bfloat16 one, else 0.
int float_gemm_level() {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  return 2;
#elif defined(__AVX512F__)
  return 1;
#else
  return 0;
#endif
}

#if defined(__AVX512F__)
int64_t float_gemm_packed_elems_f32(int N, int K) { return panel_elems<float>(K) * ((N + kPanel - 1) / kPanel); }
int64_t float_gemm_packed_elems_bf16(int N, int K) { return panel_elems<uint16_t>(K) * ((N + kPanel - 1) / kPanel); }
void float_gemm_pack_f32(const float* w, int N, int K, float* out) { pack(w, N, K, out); }
void float_gemm_f32(const float* x, int64_t ldx, const float* w, const float* bias, float* y, int64_t ldy, int M,
                    int N, int K) {
  gemm(x, ldx, w, bias, y, ldy, M, N, K);
}
#if defined(__AVX512BF16__)
void float_gemm_pack_bf16(const uint16_t* w, int N, int K, uint16_t* out) { pack(w, N, K, out); }
void float_gemm_bf16(const uint16_t* x, int64_t ldx, const uint16_t* w, const uint16_t* bias, uint16_t* y,
                     int64_t ldy, int M, int N, int K) {
  gemm(x, ldx, w, bias, y, ldy, M, N, K);
}
#endif
#endif

}  // extern "C"
