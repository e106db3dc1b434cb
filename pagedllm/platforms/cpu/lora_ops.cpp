// The batched LoRA op of one target linear on the CPU (S-LoRA / Punica's grouped shrink and expand), in
// one OpenMP region: for each group of tokens that share an adapter slot s (`order` lists the x rows in
// group order, `group_start` bounds each group, `group_slot` names its slot), and each of the
// target's n_slices output slices i (contiguous columns slice_bounds[i] .. slice_bounds[i + 1]):
//
//   shrink: h[p, i R + j] = sum_c x[order[p], c] A_s[i R + j, c]          (j < r = ranks[s])
//   expand: y[order[p], col] += sum_j h[p, i R + j] Bt_s[j, col]          (col in slice i)
//
// A [slots, n_slices R, in] and Bt [slots, R, out] (the scale folded in; R: max_rank) are the slot
// tables of pagedllm/lora/layers.py (LoRATarget.a, .b), in the element type of x and y (float32 or
// bf16 as raw uint16); h is float32 scratch [T, n_slices R] (T: the tokens with an adapter). Sums are
// float32 and y is rounded once (bf16: round to nearest even), so the result equals the
// per-token definition (pagedllm/lora/ops.py: lora_add_reference) up to float32 summation order.
// A slot whose rank is 0 (this target untouched by its adapter) is skipped. Rows of y outside `order`
// (base-model tokens) are not touched.
//
// Work: 4 tokens x 4 rows of A per shrink unit (16 float32 accumulators; the A rows are read once per
// 4 tokens), 4 tokens x 64 columns of Bt per expand unit; the units of all groups are shared out
// over the threads (decode: a few tokens per adapter, so the groups, not the tokens, give the
// parallelism). AVX-512 (F, BW, VL) kernels, a plain loop elsewhere. Called by the CPU layer runner
// (platforms/cpu/layer_runner.cpp) after each target linear, and from Python by platforms/cpu/lora_ops.py.
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu_math.h"

namespace {

using pagedllm_cpu::as_float;
using pagedllm_cpu::put;

constexpr int64_t TOK = 4;    // tokens per unit
constexpr int64_t ROWS = 4;   // rows of A per shrink unit
constexpr int64_t COLS = 64;  // columns of Bt per expand unit

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define PAGEDLLM_LORA_AVX512 1
inline __mmask16 tail_mask(int64_t left) { return left >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << left) - 1); }
inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(const uint16_t* p, __mmask16 m) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}
inline void add_store16(float* p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, _mm512_add_ps(load16(p, m), v)); }
inline void add_store16(uint16_t* p, __m512 v, __mmask16 m) {
  _mm256_mask_storeu_epi16(p, m, pagedllm_cpu::float_to_bf16_16(_mm512_add_ps(load16(p, m), v)));
}
#endif

// h rows hp[t] (t < TOK; tails repeat the last real row) <- x rows xr[t] . the A rows ar[q] (q < ROWS,
// likewise), written to hp[t][hc[q]] for the real ones (nt tokens, nq rows).
template <typename T>
void shrink_unit(const T* const* xr, const T* const* ar, int64_t in, float* const* hp, const int64_t* hc, int64_t nt,
                 int64_t nq) {
#ifdef PAGEDLLM_LORA_AVX512
  __m512 acc[TOK][ROWS];
  for (int t = 0; t < TOK; ++t)
    for (int q = 0; q < ROWS; ++q) acc[t][q] = _mm512_setzero_ps();
  for (int64_t c = 0; c < in; c += 16) {
    const __mmask16 m = tail_mask(in - c);
    __m512 xv[TOK];
    for (int t = 0; t < TOK; ++t) xv[t] = load16(xr[t] + c, m);
    for (int q = 0; q < ROWS; ++q) {
      const __m512 av = load16(ar[q] + c, m);
      for (int t = 0; t < TOK; ++t) acc[t][q] = _mm512_fmadd_ps(xv[t], av, acc[t][q]);
    }
  }
  for (int64_t t = 0; t < nt; ++t)
    for (int64_t q = 0; q < nq; ++q) hp[t][hc[q]] = _mm512_reduce_add_ps(acc[t][q]);
#else
  for (int64_t t = 0; t < nt; ++t)
    for (int64_t q = 0; q < nq; ++q) {
      float s = 0.0f;
      for (int64_t c = 0; c < in; ++c) s += as_float(xr[t][c]) * as_float(ar[q][c]);
      hp[t][hc[q]] = s;
    }
#endif
}

// y rows yr[t] (t < nt) columns [c0, c1) += sum_j hp[t][j] Bt[j, col] (j < r; Bt's row stride ldb).
template <typename T>
void expand_unit(const float* const* hp, const T* bt, int64_t ldb, int64_t r, T* const* yr, int64_t nt, int64_t c0,
                 int64_t c1) {
#ifdef PAGEDLLM_LORA_AVX512
  for (int64_t c = c0; c < c1; c += 64) {  // 4 vectors of 16 columns x TOK tokens
    __m512 acc[TOK][4];
    __mmask16 m[4];
    for (int v = 0; v < 4; ++v) {
      m[v] = c + 16 * v < c1 ? tail_mask(c1 - c - 16 * v) : static_cast<__mmask16>(0);
      for (int t = 0; t < TOK; ++t) acc[t][v] = _mm512_setzero_ps();
    }
    for (int64_t j = 0; j < r; ++j) {
      __m512 bv[4];
      for (int v = 0; v < 4; ++v) bv[v] = load16(bt + j * ldb + c + 16 * v, m[v]);
      for (int t = 0; t < TOK; ++t) {
        const __m512 hv = _mm512_set1_ps(hp[t][j]);
        for (int v = 0; v < 4; ++v) acc[t][v] = _mm512_fmadd_ps(hv, bv[v], acc[t][v]);
      }
    }
    for (int64_t t = 0; t < nt; ++t)
      for (int v = 0; v < 4; ++v)
        if (m[v]) add_store16(yr[t] + c + 16 * v, acc[t][v], m[v]);
  }
#else
  for (int64_t t = 0; t < nt; ++t)
    for (int64_t c = c0; c < c1; ++c) {
      float s = 0.0f;
      for (int64_t j = 0; j < r; ++j) s += hp[t][j] * as_float(bt[j * ldb + c]);
      put(yr[t] + c, as_float(yr[t][c]) + s);
    }
#endif
}

template <typename T>
void lora_add(const T* x, int64_t ldx, T* y, int64_t ldy, int64_t in, int64_t out, const T* a, const T* b,
              const int32_t* ranks, int64_t max_rank, int n_slices, const int64_t* slice_bounds, const int64_t* order,
              const int64_t* group_start, const int64_t* group_slot, int64_t num_groups, float* h) {
  const int64_t big_r = max_rank, hcols = n_slices * big_r;
  // Units of work, group by group: shrink (token blocks x row blocks over the n_slices r rows), expand
  // (token blocks x column blocks of each slice); first_*[g]: the first unit of group g.
  std::vector<int64_t> first_s(num_groups + 1, 0), first_e(num_groups + 1, 0), col_blocks(n_slices + 1, 0);
  for (int i = 0; i < n_slices; ++i)
    col_blocks[i + 1] = col_blocks[i] + (slice_bounds[i + 1] - slice_bounds[i] + COLS - 1) / COLS;
  for (int64_t g = 0; g < num_groups; ++g) {
    const int64_t r = ranks[group_slot[g]], tb = (group_start[g + 1] - group_start[g] + TOK - 1) / TOK;
    first_s[g + 1] = first_s[g] + (r > 0 ? tb * ((n_slices * r + ROWS - 1) / ROWS) : 0);
    first_e[g + 1] = first_e[g] + (r > 0 ? tb * col_blocks[n_slices] : 0);
  }
  if (first_s[num_groups] == 0) return;
#pragma omp parallel
  {
#pragma omp for schedule(static)
    for (int64_t u = 0; u < first_s[num_groups]; ++u) {
      const int64_t g = std::upper_bound(first_s.begin(), first_s.end(), u) - first_s.begin() - 1;
      const int64_t s = group_slot[g], r = ranks[s], rb_count = (n_slices * r + ROWS - 1) / ROWS;
      const int64_t tb = (u - first_s[g]) / rb_count, rb = (u - first_s[g]) % rb_count;
      const int64_t p0 = group_start[g] + tb * TOK, nt = std::min(TOK, group_start[g + 1] - p0);
      const int64_t q0 = rb * ROWS, nq = std::min(ROWS, n_slices * r - q0);
      const T* xr[TOK];
      float* hp[TOK];
      for (int64_t t = 0; t < TOK; ++t) {
        const int64_t p = p0 + std::min(t, nt - 1);
        xr[t] = x + order[p] * ldx;
        hp[t] = h + p * hcols;
      }
      const T* ar[ROWS];
      int64_t hc[ROWS];
      for (int64_t q = 0; q < ROWS; ++q) {
        const int64_t qq = q0 + std::min(q, nq - 1), row = (qq / r) * big_r + qq % r;  // slice qq / r, row qq % r
        ar[q] = a + (s * hcols + row) * in;
        hc[q] = row;
      }
      shrink_unit(xr, ar, in, hp, hc, nt, nq);
    }
#pragma omp for schedule(static)
    for (int64_t u = 0; u < first_e[num_groups]; ++u) {
      const int64_t g = std::upper_bound(first_e.begin(), first_e.end(), u) - first_e.begin() - 1;
      const int64_t s = group_slot[g], r = ranks[s], cb_all = col_blocks[n_slices];
      const int64_t tb = (u - first_e[g]) / cb_all, cb = (u - first_e[g]) % cb_all;
      const int i = static_cast<int>(std::upper_bound(col_blocks.begin(), col_blocks.end(), cb) - col_blocks.begin() - 1);
      const int64_t c0 = slice_bounds[i] + (cb - col_blocks[i]) * COLS, c1 = std::min(c0 + COLS, slice_bounds[i + 1]);
      const int64_t p0 = group_start[g] + tb * TOK, nt = std::min(TOK, group_start[g + 1] - p0);
      const float* hp[TOK];
      T* yr[TOK];
      for (int64_t t = 0; t < TOK; ++t) {
        const int64_t p = p0 + std::min(t, nt - 1);
        hp[t] = h + p * hcols + i * big_r;
        yr[t] = y + order[p] * ldy;
      }
      expand_unit(hp, b + s * big_r * out, out, r, yr, nt, c0, c1);
    }
  }
}

}  // namespace

extern "C" {

#define PAGEDLLM_LORA_ENTRY(sfx, T)                                                                                \
  void lora_add_##sfx(const void* x, int64_t ldx, void* y, int64_t ldy, int64_t in, int64_t out, const void* a,   \
                      const void* b, const int32_t* ranks, int64_t max_rank, int n_slices,                          \
                      const int64_t* slice_bounds, const int64_t* order, const int64_t* group_start,                \
                      const int64_t* group_slot, int64_t num_groups, float* h) {                                    \
    lora_add<T>(static_cast<const T*>(x), ldx, static_cast<T*>(y), ldy, in, out, static_cast<const T*>(a),         \
                static_cast<const T*>(b), ranks, max_rank, n_slices, slice_bounds, order, group_start, group_slot,  \
                num_groups, h);                                                                                      \
  }

PAGEDLLM_LORA_ENTRY(f32, float)
PAGEDLLM_LORA_ENTRY(bf16, uint16_t)

}  // extern "C"
