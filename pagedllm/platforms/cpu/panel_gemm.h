// The loop structure shared by the packed-panel GEMMs (platforms/cpu/float_gemm.cpp: float32/bf16;
// platforms/cpu/int8_gemm.cpp: int8 VNNI): the weight in panels of 16 output columns, each thread an equal,
// contiguous share of the panels, taken in runs of up to kRunPanels (AVX-512: 4, 64 columns); each
// run against all rows of x in register tiles of MR rows (AVX-512: MR * NV = 24 zmm accumulators;
// AVX2: one panel, 6 rows x 2 ymm = 12). From kPrefetchMinRows rows the row tiles share out the
// prefetch of the thread's next run into L2. The kernels supply the tile.
#pragma once

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace pagedllm_cpu {

constexpr int kPanel = 16;  // output columns per packed panel (one zmm of float32 or int32, two ymm)
// Valid columns of a run's last panel, bit c for column c (the AVX-512 tiles use it as a __mmask16).
using PanelMask = uint16_t;
// Rows from which the next panels are prefetched. A SmolLM2 step's float linears (30 layers + LM
// head, 2 threads, ms, without -> with): float32 24 rows 20.7 -> 16.0, 48 rows 35.3 -> 30.0; bf16
// 24 rows 11.5 -> 8.5, 48 rows 18.7 -> 15.8. Under it the loop streams the weights at memory speed
// already (1 row: 49 GB/s) and extra prefetches measured 3-10 % slower.
constexpr int kPrefetchMinRows = 12;

#if defined(__AVX512F__)
constexpr int kRunPanels = 4;
// Rows of a register tile of NV panels: 24 accumulators.
template <int NV>
constexpr int tile_rows() {
  return NV == 4 ? 6 : NV == 3 ? 8 : NV == 2 ? 12 : 24;
}
#else
// AVX2 has 16 ymm registers: one panel (2 ymm) a tile, 6 rows (12 accumulators, 2 for the panel's
// k row, 1 broadcast: BLIS's 6 x 16 Haswell kernel).
constexpr int kRunPanels = 1;
template <int NV>
constexpr int tile_rows() {
  return 6;
}
#endif

// The next panels' weights into L2 while a tile computes: `lines` cache lines from `pf`, at most
// `per_k` a k step. Without it each new run of panels starts on DRAM latency (weights are read
// once a step, from memory; for every row tile after the first they come from L2).
struct Prefetch {
  const char* pf;
  int lines, per_k;
};

// One k step of a tile's prefetch: up to per_k more of its `lines` lines from `pf`. A tile copies
// the Prefetch fields into locals first and calls this with them: reading them through the struct
// inside the k loop made GCC 12 keep the int8 tile's accumulators on the stack (2x slower).
inline void prefetch_step(const char* pf, int lines, int per_k, int& done) {
  for (int u = 0; u < per_k && done < lines; ++u, ++done) _mm_prefetch(pf + 64 * static_cast<int64_t>(done), _MM_HINT_T1);
}

template <int R>
using Int = std::integral_constant<int, R>;

// f(Int<rows>{}) for rows in [R, MR]: the tile's row count as a compile-time constant.
template <int R, int MR, typename F>
inline void with_rows(int rows, F&& f) {
  if constexpr (R <= MR) {
    if (rows == R) return f(Int<R>{});
    with_rows<R + 1, MR>(rows, f);
  }
}

// All M rows against one run of NV panels: tile(Int<rows>{}, first row, prefetch) for each row
// tile, in k `steps` each; the tiles share out the prefetch of `pf_bytes` at `pf`.
template <int NV, typename Tile>
inline void for_each_row_tile(int M, int steps, const char* pf, int64_t pf_bytes, Tile&& tile) {
  constexpr int MR = tile_rows<NV>();
  const int tiles = (M + MR - 1) / MR;
  const int lines = M >= kPrefetchMinRows ? static_cast<int>((pf_bytes + 63) / 64) : 0;
  const int per_tile = (lines + tiles - 1) / tiles;
  for (int t = 0; t < tiles; ++t) {
    const int i0 = t * MR;
    const int first = std::min(lines, t * per_tile), n = std::min(lines, first + per_tile) - first;
    const Prefetch p{pf + 64 * static_cast<int64_t>(first), n, (n + steps - 1) / std::max(steps, 1)};
    with_rows<1, MR>(std::min(MR, M - i0), [&](auto rows) { tile(rows, i0, p); });
  }
}

// Inside a parallel region, this thread's share of the P panels of an N-column weight:
// run(Int<NV>{}, first panel, mask of the last panel's valid columns, panels in the next run).
template <typename Run>
inline void for_each_panel_run(int N, Run&& run) {
  const int P = (N + kPanel - 1) / kPanel;
  const PanelMask last_tail = N % kPanel ? static_cast<PanelMask>((1u << (N % kPanel)) - 1) : 0xffff;
  const int nt = omp_get_num_threads(), t = omp_get_thread_num();
  const int p0 = static_cast<int>(int64_t{P} * t / nt), p1 = static_cast<int>(int64_t{P} * (t + 1) / nt);
  for (int p = p0; p < p1;) {
    const int nv = std::min(int{kRunPanels}, p1 - p);
    const PanelMask tail = p + nv == P ? last_tail : 0xffff;
    const int next = std::min(int{kRunPanels}, p1 - p - nv);
#if defined(__AVX512F__)
    switch (nv) {
      case 4: run(Int<4>{}, p, tail, next); break;
      case 3: run(Int<3>{}, p, tail, next); break;
      case 2: run(Int<2>{}, p, tail, next); break;
      default: run(Int<1>{}, p, tail, next); break;
    }
#else
    run(Int<1>{}, p, tail, next);
#endif
    p += nv;
  }
}

}  // namespace pagedllm_cpu
#endif  // __AVX512F__ || __AVX2__ && __FMA__
