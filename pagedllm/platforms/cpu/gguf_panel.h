// The many-row GEMM over K-quant blocks (Q4_K, Q5_K, Q6_K) for gguf_gemm.cpp: prefill and batched
// decode, from gguf_gemm.cpp's kPanelMinRows rows of x.
//
// Why: the row kernels (gguf_kquants.h) unpack a weight block for every 4 rows of x, so at 48 rows
// the unpacking is done 12 times over and the GEMM ran at 74 GFLOP/s, a quarter of the float32 GEMM.
// Here a thread unpacks one super-block of kCols weight rows once into a Panel (as ggml's repacked
// Q4_K x Q8_K GEMM and the BLIS-style packed GEMMs do), then walks all rows of x over it in register
// tiles of R rows x kCols columns.
//
// The panel's layout is the VNNI one: a vector of int32 lanes is kLanes output columns, each lane 4
// consecutive k of its column, so the 4 activation bytes of a row broadcast to every lane. Weights
// stay unsigned bytes (Q4_K 0..15, Q5_K 0..31, Q6_K 0..63) for maddubs against the int8 activations
// (pairs exact in int16: 2 * 63 * 128 < 2^15), and each pair sum is multiplied by its column's
// sub-block scale in the same int32 lane by dpwssd (AVX512-VNNI), or madd + add. A super-block's int32
// total (|sum| < 256 * 63 * 128 * 128 < 2^31) goes to float once, times the weight's d and the
// activation's d. The second term, also in int32: Q4_K / Q5_K's minimums (-dmin m_s * the activation's
// sums of 16) and Q6_K's offset (-32 d sc_g * the same sums). The same integers as the row kernels;
// only the float additions' order differs.
//
// The unpacking gathers one dword of 16 columns' blocks a time: that dword's bytes are already a
// panel step's (Q4_K's qs dword gives step t's low nibbles and step t + 8's high ones), so the
// panel takes no byte shuffles. Measured on this Xeon (AVX512-VNNI, one thread): a zmm maddubs +
// dpwssd pair (64 products) issues about once a cycle (~310 GOP/s), vpdpbusd alone ~400; this GEMM
// ran at 245-265 GFLOP/s a core from 48 rows against the row kernels' 90-110 (benchmarks/README.md).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "gguf_kquants.h"

namespace kp {

constexpr int kCols = 64;   // output columns (weight rows) of a panel
constexpr int kSteps = 64;  // 4-k steps of a super-block

// One super-block of kCols weight rows, unpacked. w: step t's 4 weights of column j at w[t][j];
// sc: the int16 pair (scale, scale) of step t's sub-block (t / 8 for Q4_K / Q5_K's sub-blocks of 32,
// t / 4 for Q6_K's of 16); mn[p][j]: the int16 pair against the activation's sums of 16 2p and 2p + 1;
// d, dmin: the float factors of the main and the second term (Q6_K: dmin = d).
struct Panel {
  alignas(64) uint8_t w[kSteps][kCols][4];
  alignas(64) int32_t sc[16][kCols];
  alignas(64) int32_t mn[8][kCols];
  alignas(64) float d[kCols];
  alignas(64) float dmin[kCols];
};

// ---- the register tile: R rows x kTileVecs vectors of kLanes columns
#if defined(__AVX512BW__)
using VI = __m512i;
using VF = __m512;
constexpr int kLanes = 16, kTileVecs = 4, kTileRows = 4;
inline VI vload(const void* p) { return _mm512_loadu_si512(p); }
inline VI vzero() { return _mm512_setzero_si512(); }
inline VI vbcast(const void* p) {
  int32_t x;
  std::memcpy(&x, p, 4);
  return _mm512_set1_epi32(x);
}
inline VI vmaddubs(VI u, VI s) { return _mm512_maddubs_epi16(u, s); }
inline VI vdotw(VI acc, VI a, VI b) { return kq::madd_acc512(acc, a, b); }
inline VF vcvt(VI v) { return _mm512_cvtepi32_ps(v); }
inline VF vloadf(const float* p) { return _mm512_loadu_ps(p); }
inline void vstoref(float* p, VF v) { _mm512_storeu_ps(p, v); }
inline VF vfma(VF a, VF b, VF c) { return _mm512_fmadd_ps(a, b, c); }
inline VF vmulf(VF a, VF b) { return _mm512_mul_ps(a, b); }
inline VF vset1f(float x) { return _mm512_set1_ps(x); }
inline VI vset1(int x) { return _mm512_set1_epi32(x); }
inline VI vand(VI a, VI b) { return _mm512_and_si512(a, b); }
inline VI vor(VI a, VI b) { return _mm512_or_si512(a, b); }
inline VI vsrl16(VI a, int n) { return _mm512_srli_epi16(a, static_cast<unsigned>(n)); }
inline VI vsll16(VI a, int n) { return _mm512_slli_epi16(a, static_cast<unsigned>(n)); }
inline VI vsrl32(VI a, int n) { return _mm512_srli_epi32(a, static_cast<unsigned>(n)); }
inline VI vsll32(VI a, int n) { return _mm512_slli_epi32(a, static_cast<unsigned>(n)); }
inline VI vsra32(VI a, int n) { return _mm512_srai_epi32(a, static_cast<unsigned>(n)); }
inline void vstore(void* p, VI v) { _mm512_storeu_si512(p, v); }
inline VI vgather(const uint8_t* base, VI idx) { return _mm512_i32gather_epi32(idx, base, 1); }
inline VI vcolumns(int c0, int np, int64_t row_bytes) {  // byte offsets of columns c0.. (the last valid one repeated)
  const VI lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const VI j = _mm512_min_epi32(_mm512_add_epi32(_mm512_set1_epi32(c0), lane), _mm512_set1_epi32(np - 1));
  return _mm512_mullo_epi32(j, _mm512_set1_epi32(static_cast<int>(row_bytes)));
}
#else
using VI = __m256i;
using VF = __m256;
constexpr int kLanes = 8, kTileVecs = 2, kTileRows = 4;
inline VI vload(const void* p) { return kq::load(p); }
inline VI vzero() { return _mm256_setzero_si256(); }
inline VI vbcast(const void* p) {
  int32_t x;
  std::memcpy(&x, p, 4);
  return _mm256_set1_epi32(x);
}
inline VI vmaddubs(VI u, VI s) { return _mm256_maddubs_epi16(u, s); }
inline VI vdotw(VI acc, VI a, VI b) { return kq::madd_acc(acc, a, b); }
inline VF vcvt(VI v) { return _mm256_cvtepi32_ps(v); }
inline VF vloadf(const float* p) { return _mm256_loadu_ps(p); }
inline void vstoref(float* p, VF v) { _mm256_storeu_ps(p, v); }
inline VF vfma(VF a, VF b, VF c) { return _mm256_fmadd_ps(a, b, c); }
inline VF vmulf(VF a, VF b) { return _mm256_mul_ps(a, b); }
inline VF vset1f(float x) { return _mm256_set1_ps(x); }
inline VI vset1(int x) { return _mm256_set1_epi32(x); }
inline VI vand(VI a, VI b) { return _mm256_and_si256(a, b); }
inline VI vor(VI a, VI b) { return _mm256_or_si256(a, b); }
inline VI vsrl16(VI a, int n) { return _mm256_srli_epi16(a, n); }
inline VI vsll16(VI a, int n) { return _mm256_slli_epi16(a, n); }
inline VI vsrl32(VI a, int n) { return _mm256_srli_epi32(a, n); }
inline VI vsll32(VI a, int n) { return _mm256_slli_epi32(a, n); }
inline VI vsra32(VI a, int n) { return _mm256_srai_epi32(a, n); }
inline void vstore(void* p, VI v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v); }
inline VI vgather(const uint8_t* base, VI idx) {
  return _mm256_i32gather_epi32(reinterpret_cast<const int*>(base), idx, 1);
}
inline VI vcolumns(int c0, int np, int64_t row_bytes) {
  const VI j = _mm256_min_epi32(_mm256_add_epi32(_mm256_set1_epi32(c0), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)),
                                _mm256_set1_epi32(np - 1));
  return _mm256_mullo_epi32(j, _mm256_set1_epi32(static_cast<int>(row_bytes)));
}
#endif
// ---- unpacking: kLanes columns at a time, by gathers of one dword of each column's block (the
// step layout is such a dword's bytes: Q4_K's 4 bytes of qs give the low nibbles of step t and the
// high nibbles of step t + 8, no byte moves). idx: the kLanes columns' byte offsets from column 0.

// Q4_K / Q5_K (FIVE) blocks at blk0 + idx (layout: gguf_kquants.h's q45_k) as panel columns c0...
template <bool FIVE>
inline void unpack_q45_w(Panel& P, int c0, const uint8_t* blk0, VI idx) {
  const VI m4 = vset1(0x0f0f0f0f), b1 = vset1(0x01010101);
  const uint8_t* qs = blk0 + (FIVE ? 48 : 16);
  for (int u = 0; u < 8; ++u) {
    const VI h = FIVE ? vgather(blk0 + 16 + 4 * u, idx) : vzero();
    for (int c = 0; c < 4; ++c) {
      const VI g = vgather(qs + 32 * c + 4 * u, idx);
      VI lo = vand(g, m4), hi = vand(vsrl16(g, 4), m4);
      if (FIVE) {  // bits 2c (low nibbles' sub-block) and 2c + 1 of each qh byte to bit 4
        lo = vor(lo, vsll16(vand(vsrl16(h, 2 * c), b1), 4));
        hi = vor(hi, vsll16(vand(vsrl16(h, 2 * c + 1), b1), 4));
      }
      vstore(P.w[16 * c + u][c0], lo);
      vstore(P.w[16 * c + 8 + u][c0], hi);
    }
  }
}

// Q6_K blocks at blk0 + idx as panel columns c0...: weights 0..63 (q + 32). Step t = 32n + 8i + u:
// nibble (low for i < 2) of ql[64n + 32 (i & 1) + 4u..] under bits 2i, 2i + 1 of qh[32n + 4u..].
inline void unpack_q6_w(Panel& P, int c0, const uint8_t* blk0, VI idx) {
  const VI m4 = vset1(0x0f0f0f0f), m3 = vset1(0x03030303);
  for (int n = 0; n < 2; ++n)
    for (int u = 0; u < 8; ++u) {
      const VI h = vgather(blk0 + 128 + 32 * n + 4 * u, idx);
      for (int odd = 0; odd < 2; ++odd) {
        const VI l = vgather(blk0 + 64 * n + 32 * odd + 4 * u, idx);
        const int i0 = odd, i1 = odd + 2;
        vstore(P.w[32 * n + 8 * i0 + u][c0], vor(vand(l, m4), vsll16(vand(vsrl16(h, 2 * i0), m3), 4)));
        vstore(P.w[32 * n + 8 * i1 + u][c0], vor(vand(vsrl16(l, 4), m4), vsll16(vand(vsrl16(h, 2 * i1), m3), 4)));
      }
    }
}

// The int16 pair (v, v) of each dword lane's low 16 bits v.
inline VI vpair(VI v) { return vor(vand(v, vset1(0xffff)), vsll32(v, 16)); }

// Q4_K / Q5_K scales and minimums of the blocks at blk0 + idx as panel columns c0...: ggml's
// get_scale_min_k4 on 16 columns' 12 scale bytes at once (gguf_kquants.h's scales_mins).
inline void unpack_q45_scales(Panel& P, int c0, const uint8_t* blk0, VI idx) {
  const VI u0 = vgather(blk0 + 4, idx), u1 = vgather(blk0 + 8, idx), u2 = vgather(blk0 + 12, idx);
  const VI m6 = vset1(0x3f3f3f3f), m4 = vset1(0x0f0f0f0f), m2 = vset1(0x03030303), ff = vset1(0xff);
  const VI sc[2] = {vand(u0, m6), vor(vand(u2, m4), vsll32(vand(vsrl32(u0, 6), m2), 4))};
  const VI mn[2] = {vand(u1, m6), vor(vand(vsrl32(u2, 4), m4), vsll32(vand(vsrl32(u1, 6), m2), 4))};
  for (int s = 0; s < 8; ++s) {
    vstore(&P.sc[s][c0], vpair(vand(vsrl32(sc[s / 4], 8 * (s % 4)), ff)));
    vstore(&P.mn[s][c0], vpair(vand(vsrl32(mn[s / 4], 8 * (s % 4)), ff)));
  }
}

// Q6_K's 16 int8 scales of the blocks at blk0 + idx as panel columns c0...; the offset's -32 goes
// to the second term (32 sc against the activation's sums of 16).
inline void unpack_q6_scales(Panel& P, int c0, const uint8_t* blk0, VI idx) {
  for (int q4 = 0; q4 < 4; ++q4) {
    const VI v = vgather(blk0 + 192 + 4 * q4, idx);
    VI g[4];
    for (int e = 0; e < 4; ++e) g[e] = vsra32(vsll32(v, 24 - 8 * e), 24);  // byte e, sign-extended
    for (int e = 0; e < 4; ++e) vstore(&P.sc[4 * q4 + e][c0], vpair(g[e]));
    for (int e = 0; e < 4; e += 2)
      vstore(&P.mn[2 * q4 + e / 2][c0], vor(vand(vsll32(g[e], 5), vset1(0xffff)), vsll32(g[e + 1], 21)));
  }
}

// Column j's float factors: d and -dmin (Q4_K / Q5_K), d and -d (Q6_K).
template <bool Q6>
inline void unpack_factors(Panel& P, int j, const uint8_t* p) {
  P.d[j] = kq::half(p + (Q6 ? 208 : 0));
  P.dmin[j] = Q6 ? -P.d[j] : -kq::half(p + 2);
}

constexpr int kTileCols = kTileVecs * kLanes;

// The rows of x a tile takes, as gguf_kquants.h's quantize_rows_k wrote them, at super-block b:
// q + 256 b of row 0 (rows K apart), its sums of 16 (rows K / 16 apart), its scales (rows kb apart).
struct RowsAt {
  const int8_t* q;
  const int16_t* bs;
  const float* d;
  int64_t K, kb;
};

// c[r * kCols + col] += acc[r][v] (lanes of columns c0 + v kLanes) * f[col] * dx_r.
template <int R>
inline void flush(VI (&acc)[R][kTileVecs], const float* f, const RowsAt& x, float* c) {
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    const VF dx = vset1f(x.d[r * x.kb]);
#pragma GCC unroll 4
    for (int v = 0; v < kTileVecs; ++v) {
      float* cp = c + r * kCols + v * kLanes;
      vstoref(cp, vfma(vcvt(acc[r][v]), vmulf(vloadf(f + v * kLanes), dx), vloadf(cp)));
    }
  }
}

// Rows x (R of them) against panel columns [c0, c0 + kTileCols) of one super-block (SPS: steps a
// sub-block scale covers), added into c (float [R][kCols], this panel's sums, column c0 at c).
template <int R, int SPS>
inline void tile(const Panel& P, int c0, const RowsAt& x, float* c) {
  VI acc[R][kTileVecs];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < kTileVecs; ++v) acc[r][v] = vzero();
  for (int s = 0; s < kSteps / SPS; ++s) {
    VI sc[kTileVecs];
#pragma GCC unroll 4
    for (int v = 0; v < kTileVecs; ++v) sc[v] = vload(&P.sc[s][c0 + v * kLanes]);
#pragma GCC unroll 8
    for (int u = 0; u < SPS; ++u) {
      const int t = s * SPS + u;
      VI w[kTileVecs];
#pragma GCC unroll 4
      for (int v = 0; v < kTileVecs; ++v) w[v] = vload(P.w[t][c0 + v * kLanes]);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const VI a = vbcast(x.q + r * x.K + 4 * t);
#pragma GCC unroll 4
        for (int v = 0; v < kTileVecs; ++v) acc[r][v] = vdotw(acc[r][v], vmaddubs(w[v], a), sc[v]);
      }
    }
  }
  flush<R>(acc, P.d + c0, x, c);
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < kTileVecs; ++v) acc[r][v] = vzero();
#pragma GCC unroll 8
  for (int q = 0; q < 8; ++q) {
    VI m[kTileVecs];
#pragma GCC unroll 4
    for (int v = 0; v < kTileVecs; ++v) m[v] = vload(&P.mn[q][c0 + v * kLanes]);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const VI a = vbcast(x.bs + r * (x.K / 16) + 2 * q);
#pragma GCC unroll 4
      for (int v = 0; v < kTileVecs; ++v) acc[r][v] = vdotw(acc[r][v], m[v], a);
    }
  }
  flush<R>(acc, P.dmin + c0, x, c);
}

// Rows [0, M) of x against the panel: every column tile, rows in tiles of kTileRows (the last of
// 1..kTileRows - 1). c: float [M][kCols].
template <int SPS>
inline void panel_rows(const Panel& P, const RowsAt& x0, int M, float* c) {
  for (int i = 0; i < M; i += kTileRows) {
    const RowsAt x{x0.q + i * x0.K, x0.bs + i * (x0.K / 16), x0.d + i * x0.kb, x0.K, x0.kb};
    float* ci = c + static_cast<int64_t>(i) * kCols;
    for (int c0 = 0; c0 < kCols; c0 += kTileCols) {
      switch (std::min(kTileRows, M - i)) {
        case 4: tile<4, SPS>(P, c0, x, ci + c0); break;
        case 3: tile<3, SPS>(P, c0, x, ci + c0); break;
        case 2: tile<2, SPS>(P, c0, x, ci + c0); break;
        default: tile<1, SPS>(P, c0, x, ci + c0); break;
      }
    }
  }
}

// Output columns [j0, j1) of x @ W^T for W of K-quant type T (kq::Q4_K, kq::Q5_K, kq::Q6_K; rows of
// nblocks blocks) and x's M rows quantized per 256 (q int8 [M, K], d float [M, K / 256], bs int16
// [M, K / 16]): out[i * ldo + j]. One thread's share; its panel and sums are thread-local.
template <class T>
void gemm_panels(const int8_t* q, const float* d, const int16_t* bs, int M, int64_t K, const uint8_t* w,
                 int64_t j0, int64_t j1, float* out, int64_t ldo) {
  constexpr bool kQ6 = T::kBytes == 210;
  constexpr int kSps = kQ6 ? 4 : 8;
  const int64_t kb = K / 256, row_bytes = kb * T::kBytes;
  thread_local std::vector<Panel> panel_buf(1);
  thread_local std::vector<float> sums;
  Panel& P = panel_buf[0];
  sums.resize(static_cast<size_t>(M) * kCols);
  for (int64_t jp = j0; jp < j1; jp += kCols) {
    const int np = static_cast<int>(std::min<int64_t>(kCols, j1 - jp));
    std::fill(sums.begin(), sums.end(), 0.f);
    VI idx[kCols / kLanes];  // the missing columns of a last panel repeat its last column (never stored)
    for (int v = 0; v < kCols / kLanes; ++v) idx[v] = vcolumns(v * kLanes, np, row_bytes);
    for (int64_t b = 0; b < kb; ++b) {
      const uint8_t* blk0 = w + jp * row_bytes + b * T::kBytes;
      for (int v = 0; v < kCols / kLanes; ++v) {
        if constexpr (kQ6) {
          unpack_q6_w(P, v * kLanes, blk0, idx[v]);
          unpack_q6_scales(P, v * kLanes, blk0, idx[v]);
        } else {
          unpack_q45_w<T::kBytes == 176>(P, v * kLanes, blk0, idx[v]);
          unpack_q45_scales(P, v * kLanes, blk0, idx[v]);
        }
      }
      for (int j = 0; j < kCols; ++j) unpack_factors<kQ6>(P, j, blk0 + std::min(j, np - 1) * row_bytes);
      panel_rows<kSps>(P, RowsAt{q + 256 * b, bs + 16 * b, d + b, K, kb}, M, sums.data());
    }
    for (int i = 0; i < M; ++i)
      std::memcpy(out + i * ldo + jp, sums.data() + static_cast<int64_t>(i) * kCols, np * sizeof(float));
  }
}

}  // namespace kp
