// Helpers shared by this package's CPU kernels (platforms/cpu/paged_attention.cpp,
// platforms/cpu/fused_ops.cpp), compiled into each by platforms/cpu/build.py (-I this folder).
#pragma once

#include <cstdint>
#include <cstring>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>

namespace pagedllm_cpu {

inline float bf16_to_float(uint16_t x) {  // bf16 bits are the top half of a float's
  uint32_t u = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// Round to nearest even; NaN stays NaN (quiet bit kept). Branch-free, so loops over it vectorise.
inline uint16_t float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? (u >> 16) | 0x40 : rounded);
}

inline float as_float(float x) { return x; }
inline float as_float(uint16_t x) { return bf16_to_float(x); }
// *p <- f in p's type (bf16: rounded as float_to_bf16).
inline void put(float* p, float f) { *p = f; }
inline void put(uint16_t* p, float f) { *p = float_to_bf16(f); }

// Per-token int8 quantization of one row x[0, k) (layers/quantization/int8.py, bit for bit):
// amax = max(max|x|, 1e-12), q[c] = round_half_even(x[c] * ((1 / amax) * 127)) (PyTorch's
// 127 / tensor is a reciprocal, then a multiply), stored as int8 xor `flip` (0x80: the value + 128
// as the unsigned byte vpdpbusd takes). Returns the row's scale amax / 127.
template <typename T, typename Q>
inline float quantize_row(const T* x, int k, Q* q, int flip) {
  float amax = 0.0f;
#pragma omp simd reduction(max : amax)
  for (int c = 0; c < k; ++c) amax = std::max(amax, std::fabs(as_float(x[c])));
  amax = std::max(amax, 1e-12f);
  const float inv = (1.0f / amax) * 127.0f;
#pragma omp simd
  for (int c = 0; c < k; ++c) q[c] = static_cast<Q>(static_cast<int8_t>(std::nearbyint(as_float(x[c]) * inv)) ^ flip);
  return amax / 127.0f;
}

// exp(x) for x already clamped into [-87.3, 88.3] by the caller (Cephes expf: Cody-Waite range
// reduction + degree-6 polynomial, ~1 ulp); branch-free.
inline float exp_clamped(float x) {
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.0f;
  const int32_t e = (static_cast<int32_t>(n) + 127) << 23;
  float s;
  std::memcpy(&s, &e, sizeof s);
  return y * s;
}

#if defined(__AVX512F__)
// float_to_bf16 on 16 lanes (the same rounding, NaNs kept quiet), as 16 bf16 in a __m256i.
inline __m256i float_to_bf16_16(__m512 f) {
  const __m512i u = _mm512_castps_si512(f);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb)), 16);
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                _mm512_set1_epi32(0x7f800000));
  const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
  return _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, rounded, quiet));
}

// exp_clamped on 16 lanes (the same reduction and polynomial; GCC does not vectorise the scalar one).
inline __m512 exp_clamped16(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(_mm512_add_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                                      _mm512_set1_ps(0.5f)),
                                        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_add_ps(_mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(0.693359375f))),
                                 _mm512_mul_ps(n, _mm512_set1_ps(2.12194440e-4f)));
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(y, r), r, r), _mm512_set1_ps(1.0f));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
// float_to_bf16 on 8 lanes (the same rounding, NaNs kept quiet), as 8 bf16 in a __m128i.
inline __m128i float_to_bf16_8(__m256 f) {
  const __m256i u = _mm256_castps_si256(f);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb)), 16);
  const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
  const __m256i r = _mm256_blendv_epi8(rounded, quiet, _mm256_castps_si256(_mm256_cmp_ps(f, f, _CMP_UNORD_Q)));
  // both halves < 2^16: packus keeps them; it packs within 128-bit lanes, so gather qwords 0 and 2
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08));
}

// exp_clamped on 8 lanes (AVX2; the same reduction and polynomial as exp_clamped16).
inline __m256 exp_clamped8(__m256 x) {
  const __m256 n = _mm256_floor_ps(_mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                                 _mm256_set1_ps(0.5f)));
  const __m256 r = _mm256_add_ps(_mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693359375f))),
                                 _mm256_mul_ps(n, _mm256_set1_ps(2.12194440e-4f)));
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(y, r), r, r), _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}
#endif

}  // namespace pagedllm_cpu
