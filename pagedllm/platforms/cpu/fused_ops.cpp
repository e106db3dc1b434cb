// Elementwise CPU kernels around the matmuls, one pass over memory each, where PyTorch eager runs
// 2-9 ATen ops (each a thread-pool dispatch over a ~50k-element tensor): the residual add fused
// with RMSNorm (vLLM's fused_add_rms_norm), RMSNorm per attention head in place, SiLU(gate) * up
// (vLLM's silu_and_mul), Gemma's RMSNorm and GELU-tanh(gate) * up, rotate-half RoPE in place, and
// the int8 linear's per-token quantization and epilogue. Same operations in the same order and with
// the same roundings as transformers' Llama and Gemma modules (bf16: each intermediate rounded to
// bf16 where transformers rounds it); built with -ffp-contract=off so no multiply-add is fused.
// Differences from ATen: RMSNorm's mean of squares is summed in another order (fp32: last-bit
// differences), SiLU's and GELU's exp is our own polynomial (within 2 ulp), and GELU-tanh is
// computed in a form without cancellation (gelu_tanh64). Plain C ABI (ctypes); x rows may be
// strided, the last dim contiguous.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include <omp.h>

#include "cpu_math.h"
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

using pagedllm_cpu::as_float;
using pagedllm_cpu::put;
template <typename T>
inline float rnd(float f) {  // f rounded to T and back: the rounding of a stored intermediate
  T t;
  put(&t, f);
  return as_float(t);
}

// exp(x), x clamped to [-87.3, 88.3] (exp(88.3) = 2.2e38: silu's 1 + exp(-g) stays finite).
inline float exp_f(float x) { return pagedllm_cpu::exp_clamped(std::fmin(std::fmax(x, -87.3f), 88.3f)); }

#if defined(__AVX512F__)
inline __m512 exp_f16(__m512 x) {  // exp_f on 16 lanes
  return pagedllm_cpu::exp_clamped16(_mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.3f)));
}
#elif defined(__AVX2__) && defined(__FMA__)
inline __m256 exp_f8(__m256 x) {  // exp_f on 8 lanes
  return pagedllm_cpu::exp_clamped8(_mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f)));
}
#endif

// s[c] = g[c] / (1 + exp(-g[c])) for c < 64.
inline void silu64(const float* g, float* s) {
#if defined(__AVX512F__)
  for (int c = 0; c < 64; c += 16) {
    const __m512 v = _mm512_loadu_ps(g + c);
    _mm512_storeu_ps(s + c, _mm512_div_ps(v, _mm512_add_ps(_mm512_set1_ps(1.0f), exp_f16(_mm512_sub_ps(_mm512_setzero_ps(), v)))));
  }
#elif defined(__AVX2__) && defined(__FMA__)
  for (int c = 0; c < 64; c += 8) {  // the scalar loop (GCC keeps its exp scalar) took 8x longer
    const __m256 v = _mm256_loadu_ps(g + c);
    _mm256_storeu_ps(s + c, _mm256_div_ps(v, _mm256_add_ps(_mm256_set1_ps(1.0f), exp_f8(_mm256_sub_ps(_mm256_setzero_ps(), v)))));
  }
#else
  for (int c = 0; c < 64; ++c) s[c] = g[c] / (1.0f + exp_f(-g[c]));
#endif
}

// s[c] = GELU(g[c]), tanh approximation (Hendrycks & Gimpel, 2016; PyTorch's gelu(approximate="tanh")),
// for c < 64: 0.5 g (1 + tanh(z)), z = sqrt(2/pi) (g + 0.044715 g^3), computed as g / (1 + exp(-2z)),
// the same value without the cancellation of 1 + tanh(z) for g < 0 (where PyTorch's form loses up to
// ~1e-7 |g|); z in PyTorch's order of operations. Past -2z = 88 (g < -10) the value is below 1e-37:
// 0 (PyTorch's -0 too), where exp's clamp would leave g / 2e38.
inline void gelu_tanh64(const float* g, float* s) {
  constexpr float kBeta = 0.7978845608028654f, kKappa = 0.044715f, kFlush = 88.0f;
#if defined(__AVX512F__)
  for (int c = 0; c < 64; c += 16) {
    const __m512 x = _mm512_loadu_ps(g + c);
    const __m512 cube = _mm512_mul_ps(_mm512_mul_ps(x, x), x);
    const __m512 z =
        _mm512_mul_ps(_mm512_set1_ps(kBeta), _mm512_add_ps(x, _mm512_mul_ps(_mm512_set1_ps(kKappa), cube)));
    const __m512 m2z = _mm512_mul_ps(_mm512_set1_ps(-2.0f), z);
    const __m512 r = _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), exp_f16(m2z)));
    const __mmask16 tiny = _mm512_cmp_ps_mask(m2z, _mm512_set1_ps(kFlush), _CMP_GT_OQ);
    _mm512_storeu_ps(s + c, _mm512_mask_mul_ps(r, tiny, x, _mm512_setzero_ps()));
  }
#elif defined(__AVX2__) && defined(__FMA__)
  for (int c = 0; c < 64; c += 8) {
    const __m256 x = _mm256_loadu_ps(g + c);
    const __m256 cube = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
    const __m256 z =
        _mm256_mul_ps(_mm256_set1_ps(kBeta), _mm256_add_ps(x, _mm256_mul_ps(_mm256_set1_ps(kKappa), cube)));
    const __m256 m2z = _mm256_mul_ps(_mm256_set1_ps(-2.0f), z);
    const __m256 r = _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), exp_f8(m2z)));
    const __m256 tiny = _mm256_cmp_ps(m2z, _mm256_set1_ps(kFlush), _CMP_GT_OQ);
    _mm256_storeu_ps(s + c, _mm256_blendv_ps(r, _mm256_mul_ps(x, _mm256_setzero_ps()), tiny));
  }
#else
  for (int c = 0; c < 64; ++c) {
    const float x = g[c], z = kBeta * (x + kKappa * (x * x * x));
    s[c] = -2.0f * z > kFlush ? x * 0.0f : x / (1.0f + exp_f(-2.0f * z));
  }
#endif
}

constexpr int64_t kMinWork = 16384;  // elements below which one thread does it all

// 1 / sqrt(mean(buf^2) + eps), the squares summed in 16 lanes (every RMSNorm here sums in this order).
inline float inv_rms(const float* buf, int hidden, float eps) {
  float acc[16] = {};
  int c = 0;
  for (; c + 16 <= hidden; c += 16) {
#pragma omp simd
    for (int u = 0; u < 16; ++u) acc[u] += buf[c + u] * buf[c + u];
  }
  for (; c < hidden; ++c) acc[0] += buf[c] * buf[c];
  float ss = 0.0f;
  for (int u = 0; u < 16; ++u) ss += acc[u];
  return 1.0f / std::sqrt(ss / static_cast<float>(hidden) + eps);
}

// One row: residual <- residual + x (if rr); out <- w * rnd(r * rsqrt(mean(r^2) + eps)), r the new
// residual (or x). The row is read into float first, so out may be x itself.
template <typename T>
inline void rms_norm_row(const T* xr, T* rr, const T* w, T* orow, int hidden, float eps) {
  float buf[8192];  // the row in float (hidden <= 8192, checked by the caller)
  if (rr) {
    for (int c = 0; c < hidden; ++c) {
      const float v = rnd<T>(as_float(rr[c]) + as_float(xr[c]));
      put(&rr[c], v);
      buf[c] = v;
    }
  } else {
    for (int c = 0; c < hidden; ++c) buf[c] = as_float(xr[c]);
  }
  const float inv = inv_rms(buf, hidden, eps);
#pragma omp simd
  for (int c2 = 0; c2 < hidden; ++c2) put(&orow[c2], as_float(w[c2]) * rnd<T>(buf[c2] * inv));
}

// Gemma's RMSNorm of one row held in float: o[c] = buf[c] * rsqrt(mean(buf^2) + eps) * (1 + w[c]), all
// in float, rounded once at the end by the caller (transformers' Gemma2RMSNorm / Gemma3RMSNorm).
template <typename T>
inline void gemma_norm_row(const float* buf, const T* w, float* o, int hidden, float eps) {
  const float inv = inv_rms(buf, hidden, eps);
#pragma omp simd
  for (int c = 0; c < hidden; ++c) o[c] = buf[c] * inv * (1.0f + as_float(w[c]));
}

// residual <- residual + x (if residual); out <- w * rnd(r * rsqrt(mean(r^2) + eps)), r the new residual.
template <typename T>
void add_rms_norm(const T* x, int64_t x_stride, T* residual, const T* w, T* out, int64_t rows, int hidden,
                  float eps) {
#pragma omp parallel for schedule(static) if (rows * hidden >= kMinWork)
  for (int64_t i = 0; i < rows; ++i)
    rms_norm_row(x + i * x_stride, residual ? residual + i * hidden : nullptr, w, out + i * hidden, hidden, eps);
}

// In place, per head: x[i, h, :] <- RMSNorm(x[i, h, :]) with weight w [d] over head_dim: Qwen3's
// q/k norms (the row arithmetic of add_rms_norm), or Gemma 3's (kGemma: gemma_norm_row's).
template <typename T, bool kGemma>
void rms_norm_heads(T* x, int64_t tok_stride, int64_t head_stride, int64_t n, int heads, int d, const T* w,
                    float eps) {
#pragma omp parallel for schedule(static) if (n * heads * d >= kMinWork)
  for (int64_t i = 0; i < n; ++i)
    for (int h = 0; h < heads; ++h) {
      T* xr = x + i * tok_stride + h * head_stride;
      if (kGemma) {
        float buf[8192], o[8192];  // d <= 8192, checked by the caller
        for (int c = 0; c < d; ++c) buf[c] = as_float(xr[c]);
        gemma_norm_row(buf, w, o, d, eps);
        for (int c = 0; c < d; ++c) put(&xr[c], o[c]);
      } else {
        rms_norm_row<T>(xr, nullptr, w, xr, d, eps);
      }
    }
}

// Gemma's norms around the residual stream, per row: with w_add, residual <- rnd(residual +
// rnd(gnorm(x, w_add))) (transformers' `residual + post_norm(branch)`); without w_add but with a
// residual, residual <- rnd(residual + x) (Gemma 1's plain add); then, with w_out, out <-
// rnd(gnorm(r, w_out)), r the new residual (without either: x). gnorm: gemma_norm_row.
template <typename T>
void gemma_rms_norm(const T* x, int64_t x_stride, const T* w_add, float eps_add, T* residual, const T* w_out,
                    float eps_out, T* out, int64_t rows, int hidden) {
#pragma omp parallel for schedule(static) if (rows * hidden >= kMinWork)
  for (int64_t i = 0; i < rows; ++i) {
    const T* xr = x + i * x_stride;
    float buf[8192], o[8192];  // hidden <= 8192, checked by the caller
    for (int c = 0; c < hidden; ++c) buf[c] = as_float(xr[c]);
    if (w_add != nullptr) {
      T* rr = residual + i * hidden;
      gemma_norm_row(buf, w_add, o, hidden, eps_add);
      for (int c = 0; c < hidden; ++c) {
        const float v = rnd<T>(as_float(rr[c]) + rnd<T>(o[c]));
        put(&rr[c], v);
        buf[c] = v;
      }
    } else if (residual != nullptr) {
      T* rr = residual + i * hidden;
      for (int c = 0; c < hidden; ++c) {
        const float v = rnd<T>(as_float(rr[c]) + buf[c]);
        put(&rr[c], v);
        buf[c] = v;
      }
    }
    if (w_out != nullptr) {
      T* orow = out + i * hidden;
      gemma_norm_row(buf, w_out, o, hidden, eps_out);
      for (int c = 0; c < hidden; ++c) put(&orow[c], o[c]);
    }
  }
}

// out[i, :] <- rnd(act(gate)) * up, x[i] = [gate | up] (2 * inter); act: silu64 (silu(g) = g / (1 +
// exp(-g))) or gelu_tanh64. In chunks of 64 through float buffers, so that each loop is a plain
// vector loop.
template <typename T, void (*Act64)(const float*, float*)>
void act_and_mul(const T* x, int64_t x_stride, T* out, int64_t rows, int inter) {
  constexpr int C = 64;
#pragma omp parallel for schedule(static) if (rows * inter >= kMinWork)
  for (int64_t i = 0; i < rows; ++i) {
    const T* g = x + i * x_stride;
    const T* u = g + inter;
    T* o = out + i * inter;
    float gf[C], s[C];
    for (int c0 = 0; c0 < inter; c0 += C) {
      const int m = std::min(C, inter - c0);
      for (int c = 0; c < m; ++c) gf[c] = as_float(g[c0 + c]);
      for (int c = m; c < C; ++c) gf[c] = 0.0f;
      Act64(gf, s);
      for (int c = 0; c < m; ++c) put(&o[c0 + c], rnd<T>(s[c]) * as_float(u[c0 + c]));
    }
  }
}

// In place, rotate-half RoPE: x <- rnd(x * cos) + rnd(roll(x, D/2) * sin_signed), per head, where
// cos_sin[n] = [cos (D) | sin_signed (D)], sin_signed = [-sin, sin] (rotary_embedding.py).
template <typename T>
void rotary(T* x, int64_t tok_stride, int64_t head_stride, int64_t n, int heads, int d, const T* cos_sin) {
  const int half = d / 2;
#if defined(__AVX512F__)
  // float32 heads of 16 (a 1-layer, hidden-64 model's: issue 37's nano model): one vector a head, the
  // halves swapped by a lane shuffle; the same two products and sum per element as the loop below
  // (the scalar loop's gather through tmp kept it at ~40 cycles a head)
  if constexpr (std::is_same_v<T, float>) {
    if (d == 16) {
#pragma omp parallel for schedule(static) if (n * heads * d >= kMinWork)
      for (int64_t i = 0; i < n; ++i) {
        const __m512 c = _mm512_loadu_ps(cos_sin + i * 32), s = _mm512_loadu_ps(cos_sin + i * 32 + 16);
        for (int h = 0; h < heads; ++h) {
          float* xr = x + i * tok_stride + h * head_stride;
          const __m512 v = _mm512_loadu_ps(xr);
          const __m512 rolled = _mm512_shuffle_f32x4(v, v, _MM_SHUFFLE(1, 0, 3, 2));
          _mm512_storeu_ps(xr, _mm512_add_ps(_mm512_mul_ps(v, c), _mm512_mul_ps(rolled, s)));
        }
      }
      return;
    }
  }
#endif
#pragma omp parallel for schedule(static) if (n * heads * d >= kMinWork)
  for (int64_t i = 0; i < n; ++i) {
    const T* cs = cos_sin + i * 2 * d;
    const T* sn = cs + d;
    for (int h = 0; h < heads; ++h) {
      T* xr = x + i * tok_stride + h * head_stride;
      float tmp[1024];  // the head's row before rotation (d <= 1024, checked by the caller)
      for (int c = 0; c < d; ++c) tmp[c] = as_float(xr[c]);
#pragma omp simd
      for (int c = 0; c < d; ++c) {
        const float rolled = tmp[c < half ? c + half : c - half];
        put(&xr[c], rnd<T>(tmp[c] * as_float(cs[c])) + rnd<T>(rolled * as_float(sn[c])));
      }
    }
  }
}

// W8A8 around torch._int_mm (layers/quantization/int8.py), each one pass instead of 4-9 ATen ops,
// with PyTorch's operations and roundings so that the results are bit-identical:
// per-token quantization q = round_half_even(x * ((1 / amax) * 127)) (PyTorch's 127 / tensor is a
// reciprocal, then a multiply), amax = max(max|x|, 1e-12), scale = amax / 127; and the epilogue
// out = rnd(float(acc) * sx[i] * sw[j] (+ bias[j])).
template <typename T>
void quantize_rows(const T* x, int64_t x_stride, int64_t m, int k, int8_t* q, float* scale) {
#pragma omp parallel for schedule(static) if (m * k >= kMinWork)
  for (int64_t i = 0; i < m; ++i) scale[i] = pagedllm_cpu::quantize_row(x + i * x_stride, k, q + i * k, 0);
}

template <typename T>
void int8_epilogue(const int32_t* acc, int64_t m, int n, const float* sx, const float* sw, const T* bias, T* out) {
  constexpr int kCols = 1024;  // work items of one row's columns: a single row still splits over threads
  const int64_t col_blocks = (n + kCols - 1) / kCols;
#pragma omp parallel for schedule(static) if (m * n >= kMinWork)
  for (int64_t it = 0; it < m * col_blocks; ++it) {
    const int64_t i = it / col_blocks;
    const int j0 = static_cast<int>(it % col_blocks) * kCols, j1 = std::min(n, j0 + kCols);
    const int32_t* a = acc + i * n;
    T* o = out + i * n;
    const float s = sx[i];
    if (bias) {
#pragma omp simd
      for (int j = j0; j < j1; ++j) put(&o[j], static_cast<float>(a[j]) * s * sw[j] + as_float(bias[j]));
    } else {
#pragma omp simd
      for (int j = j0; j < j1; ++j) put(&o[j], static_cast<float>(a[j]) * s * sw[j]);
    }
  }
}

// out[i] <- the index of the first maximum of row i of x [rows, n] (row stride x_stride, n >= 1),
// a NaN counting as larger than any number (the first NaN wins), as torch.argmax. Two passes: the
// row's max (a vector reduction that also notes NaNs), then the first position holding it. ATen's
// argmax over SmolLM2's [48, 49152] logits took 0.61 ms where its amax took 0.05.
void argmax_rows(const float* x, int64_t x_stride, int64_t rows, int64_t n, int64_t* out) {
#pragma omp parallel for schedule(static) if (rows * n >= kMinWork)
  for (int64_t i = 0; i < rows; ++i) {
    const float* xr = x + i * x_stride;
    float m = -INFINITY;
    bool nan = false;
    int64_t k = 0;
#if defined(__AVX512F__)
    // four running maxima, 64 a step (one made each vmaxps wait on the last: 4 cycles a vector); the
    // max does not depend on the order (the sign of a zero max may, but the search below compares with ==)
    __m512 mx = _mm512_set1_ps(-INFINITY), mx1 = mx, mx2 = mx, mx3 = mx;
    __mmask16 unord = 0;
    for (; k + 64 <= n; k += 64) {
      const __m512 v0 = _mm512_loadu_ps(xr + k), v1 = _mm512_loadu_ps(xr + k + 16);
      const __m512 v2 = _mm512_loadu_ps(xr + k + 32), v3 = _mm512_loadu_ps(xr + k + 48);
      mx = _mm512_max_ps(v0, mx), mx1 = _mm512_max_ps(v1, mx1), mx2 = _mm512_max_ps(v2, mx2), mx3 = _mm512_max_ps(v3, mx3);
      unord |= _mm512_cmp_ps_mask(v0, v0, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(v1, v1, _CMP_UNORD_Q) |
               _mm512_cmp_ps_mask(v2, v2, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(v3, v3, _CMP_UNORD_Q);
    }
    mx = _mm512_max_ps(_mm512_max_ps(mx, mx1), _mm512_max_ps(mx2, mx3));
    for (; k + 16 <= n; k += 16) {
      const __m512 v = _mm512_loadu_ps(xr + k);
      mx = _mm512_max_ps(v, mx);  // a NaN in v yields mx (the second operand): NaNs never win here
      unord |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    }
    m = _mm512_reduce_max_ps(mx);
    nan = unord != 0;
#elif defined(__AVX2__)
    __m256 mx = _mm256_set1_ps(-INFINITY), unord = _mm256_setzero_ps();
    for (; k + 8 <= n; k += 8) {
      const __m256 v = _mm256_loadu_ps(xr + k);
      mx = _mm256_max_ps(v, mx);  // as above: a NaN in v yields mx
      unord = _mm256_or_ps(unord, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
    nan = _mm256_movemask_ps(unord) != 0;
#endif
    for (; k < n; ++k) {
      m = std::max(m, xr[k]);  // (m < NaN) is false: NaNs never win here either
      nan |= xr[k] != xr[k];
    }
    k = 0;
#if defined(__AVX512F__)
    const __m512 mv = _mm512_set1_ps(m);
    for (; k + 16 <= n; k += 16) {  // the first lane that is m (or NaN), 16 at a time
      const __m512 v = _mm512_loadu_ps(xr + k);
      const __mmask16 hit = nan ? _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) : _mm512_cmp_ps_mask(v, mv, _CMP_EQ_OQ);
      if (hit) {
        k += __builtin_ctz(hit);
        break;
      }
    }
#elif defined(__AVX2__)
    const __m256 mv = _mm256_set1_ps(m);
    for (; k + 8 <= n; k += 8) {  // the first lane that is m (or NaN), 8 at a time
      const __m256 v = _mm256_loadu_ps(xr + k);
      const int hit = _mm256_movemask_ps(nan ? _mm256_cmp_ps(v, v, _CMP_UNORD_Q) : _mm256_cmp_ps(v, mv, _CMP_EQ_OQ));
      if (hit) {
        k += __builtin_ctz(hit);
        break;
      }
    }
#endif
    while (k < n && (nan ? xr[k] == xr[k] : xr[k] != m)) ++k;
    out[i] = k;
  }
}

}  // namespace

extern "C" {

int pagedllm_fused_ops_abi_version() { return 1; }

void add_rms_norm_f32(const float* x, int64_t xs, float* res, const float* w, float* out, int64_t rows, int hidden,
                      float eps) {
  add_rms_norm(x, xs, res, w, out, rows, hidden, eps);
}
void add_rms_norm_bf16(const uint16_t* x, int64_t xs, uint16_t* res, const uint16_t* w, uint16_t* out, int64_t rows,
                       int hidden, float eps) {
  add_rms_norm(x, xs, res, w, out, rows, hidden, eps);
}
void silu_and_mul_f32(const float* x, int64_t xs, float* out, int64_t rows, int inter) {
  act_and_mul<float, silu64>(x, xs, out, rows, inter);
}
void silu_and_mul_bf16(const uint16_t* x, int64_t xs, uint16_t* out, int64_t rows, int inter) {
  act_and_mul<uint16_t, silu64>(x, xs, out, rows, inter);
}
void gelu_tanh_and_mul_f32(const float* x, int64_t xs, float* out, int64_t rows, int inter) {
  act_and_mul<float, gelu_tanh64>(x, xs, out, rows, inter);
}
void gelu_tanh_and_mul_bf16(const uint16_t* x, int64_t xs, uint16_t* out, int64_t rows, int inter) {
  act_and_mul<uint16_t, gelu_tanh64>(x, xs, out, rows, inter);
}
void gemma_rms_norm_f32(const float* x, int64_t xs, const float* w_add, float eps_add, float* res, const float* w_out,
                        float eps_out, float* out, int64_t rows, int hidden) {
  gemma_rms_norm(x, xs, w_add, eps_add, res, w_out, eps_out, out, rows, hidden);
}
void gemma_rms_norm_bf16(const uint16_t* x, int64_t xs, const uint16_t* w_add, float eps_add, uint16_t* res,
                         const uint16_t* w_out, float eps_out, uint16_t* out, int64_t rows, int hidden) {
  gemma_rms_norm(x, xs, w_add, eps_add, res, w_out, eps_out, out, rows, hidden);
}
void rms_norm_heads_f32(float* x, int64_t ts, int64_t hs, int64_t n, int heads, int d, const float* w, float eps) {
  rms_norm_heads<float, false>(x, ts, hs, n, heads, d, w, eps);
}
void rms_norm_heads_bf16(uint16_t* x, int64_t ts, int64_t hs, int64_t n, int heads, int d, const uint16_t* w,
                         float eps) {
  rms_norm_heads<uint16_t, false>(x, ts, hs, n, heads, d, w, eps);
}
void gemma_rms_norm_heads_f32(float* x, int64_t ts, int64_t hs, int64_t n, int heads, int d, const float* w,
                              float eps) {
  rms_norm_heads<float, true>(x, ts, hs, n, heads, d, w, eps);
}
void gemma_rms_norm_heads_bf16(uint16_t* x, int64_t ts, int64_t hs, int64_t n, int heads, int d, const uint16_t* w,
                               float eps) {
  rms_norm_heads<uint16_t, true>(x, ts, hs, n, heads, d, w, eps);
}
void rotary_f32(float* x, int64_t ts, int64_t hs, int64_t n, int heads, int d, const float* cs) {
  rotary(x, ts, hs, n, heads, d, cs);
}
void rotary_bf16(uint16_t* x, int64_t ts, int64_t hs, int64_t n, int heads, int d, const uint16_t* cs) {
  rotary(x, ts, hs, n, heads, d, cs);
}

void quantize_rows_f32(const float* x, int64_t xs, int64_t m, int k, int8_t* q, float* scale) {
  quantize_rows(x, xs, m, k, q, scale);
}
void quantize_rows_bf16(const uint16_t* x, int64_t xs, int64_t m, int k, int8_t* q, float* scale) {
  quantize_rows(x, xs, m, k, q, scale);
}
void int8_epilogue_f32(const int32_t* acc, int64_t m, int n, const float* sx, const float* sw, const float* bias,
                       float* out) {
  int8_epilogue(acc, m, n, sx, sw, bias, out);
}
void argmax_rows_f32(const float* x, int64_t xs, int64_t rows, int64_t n, int64_t* out) {
  argmax_rows(x, xs, rows, n, out);
}
void int8_epilogue_bf16(const int32_t* acc, int64_t m, int n, const float* sx, const float* sw, const uint16_t* bias,
                        uint16_t* out) {
  int8_epilogue(acc, m, n, sx, sw, bias, out);
}

}  // extern "C"
