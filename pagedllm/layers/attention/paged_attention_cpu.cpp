// Paged attention for CPUs: reads K/V in place through the block table (no gathered copy of the
// context), one online softmax per query row over blocks (Kwon et al., SOSP 2023, PagedAttention
// kernel; Dao et al., 2022, FlashAttention; Milakov & Gimelshein, 2018, online softmax).
//
// Flat batch of B sequences: sequence b owns query rows query_start_loc[b] .. query_start_loc[b+1]
// (T_b new tokens at positions seq_lens[b] - T_b .. seq_lens[b] - 1); decodes (T_b = 1) and prefill
// chunks over a cached prefix mix freely. One work item = (sequence, KV head, tile of queries), or a
// whole decode sequence (all its KV heads) when the batch has sequences enough for every thread. The
// rows of a KV head are its G = H / Hkv query heads times the tile's tokens, so K/V are read once for
// the whole group (grouped-query attention without expanding K/V).
//
// Layouts (all contiguous, checked by the Python caller):
//   q, out      [N, H, D]                         float32 or bfloat16 (raw uint16)
//   k/v cache   [num_blocks, block_size, Hkv, D]  same dtype as q
//   block_tables [B, bt_stride] int32; seq_lens [B] int32; query_start_loc [B + 1] int32
// Sequences with more than max_query_len new tokens (when > 0) are skipped: the caller runs those.
// Accumulation is float32. Plain C ABI (called through ctypes): no torch headers, builds in seconds.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include <omp.h>

namespace {

constexpr int kQueryTile = 16;  // query tokens per work item in a prefill chunk

inline float bf16_to_float(uint16_t x) {
  uint32_t u = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline uint16_t float_to_bf16(float f) {  // round to nearest even (NaN stays NaN: quiet bit kept)
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// exp(x) for x <= 0 (Cephes expf: Cody-Waite range reduction + degree-6 polynomial, ~1 ulp);
// branch-free so the compiler vectorises the loops that call it.
inline float exp_nonpos(float x) {
  x = std::max(x, -87.0f);
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

template <typename T>
inline void load_row(const T* src, float* dst, int d);

template <>
inline void load_row<float>(const float* src, float* dst, int d) {
  std::memcpy(dst, src, sizeof(float) * d);
}

template <>
inline void load_row<uint16_t>(const uint16_t* src, float* dst, int d) {
#pragma omp simd
  for (int i = 0; i < d; ++i) dst[i] = bf16_to_float(src[i]);
}

inline void store_row(const float* src, float* dst, int d, float mul) {
#pragma omp simd
  for (int i = 0; i < d; ++i) dst[i] = src[i] * mul;
}

inline void store_row(const float* src, uint16_t* dst, int d, float mul) {
  for (int i = 0; i < d; ++i) dst[i] = float_to_bf16(src[i] * mul);
}

// q . k in float: 16 independent lanes the compiler vectorises, then a tree (a single running sum
// would make every dot a chain of dependent scalar adds). AVX-512 intrinsics here measured no faster.
inline float dot(const float* a, const float* b, int d) {
  constexpr int W = 16;
  float acc[W] = {};
  int c = 0;
  for (; c + W <= d; c += W) {
#pragma omp simd
    for (int u = 0; u < W; ++u) acc[u] += a[c + u] * b[c + u];
  }
  for (int u = 0; u < d % W; ++u) acc[u] += a[c + u] * b[c + u];
  for (int w = W / 2; w > 0; w /= 2) {
#pragma omp simd
    for (int u = 0; u < w; ++u) acc[u] += acc[u + w];
  }
  return acc[0];
}

// Ask for the K/V rows of one kv head in the next block while this one is computed.
template <typename T>
inline void prefetch_rows(const T* p, int n, int64_t stride, int d) {
  for (int j = 0; j < n; ++j)
    for (int c = 0; c < d * static_cast<int>(sizeof(T)); c += 64)
      __builtin_prefetch(reinterpret_cast<const char*>(p + j * stride) + c);
}

struct Item {
  int seq, h_begin, h_end, q_begin, q_end;  // KV heads [h_begin, h_end); q_* index the sequence's new tokens
};

template <typename T, int kHeadDim>  // kHeadDim > 0: head_dim fixed at compile time (unrolled loops)
void paged_attention(const T* q, const T* k_cache, const T* v_cache, T* out, const int32_t* block_tables,
                     int64_t bt_stride, const int32_t* seq_lens, const int32_t* query_start_loc, int num_seqs,
                     int num_heads, int num_kv_heads, int head_dim, int block_size, float scale, int window,
                     float soft_cap, int max_query_len) {
  const int G = num_heads / num_kv_heads, bs = block_size;
  const int D = kHeadDim > 0 ? kHeadDim : head_dim;
  const int64_t tok_stride = static_cast<int64_t>(num_kv_heads) * D;  // between tokens of a block
  const int64_t blk_stride = tok_stride * bs;
  // A decode item takes all KV heads of its sequence when there are sequences enough to keep every
  // thread busy: it then reads each block of the cache as one contiguous run.
  const bool whole_seq = num_seqs >= 4 * omp_get_max_threads();
  std::vector<Item> items;
  for (int b = 0; b < num_seqs; ++b) {
    const int t = query_start_loc[b + 1] - query_start_loc[b];
    if (max_query_len > 0 && t > max_query_len) continue;  // left to the caller
    if (t == 1 && whole_seq) {
      items.push_back({b, 0, num_kv_heads, 0, 1});
      continue;
    }
    for (int h = 0; h < num_kv_heads; ++h)
      for (int t0 = 0; t0 < t; t0 += kQueryTile) items.push_back({b, h, h + 1, t0, std::min(t, t0 + kQueryTile)});
  }
  const int num_items = static_cast<int>(items.size());

#pragma omp parallel
  {
    // Per-thread scratch: rows x (query, running max, running sum, accumulator), one block of
    // scores, and one block of K and of V converted to float (bf16).
    const int max_rows = std::max(num_kv_heads, kQueryTile) * G;
    std::vector<float> qf(static_cast<size_t>(max_rows) * D), acc(static_cast<size_t>(max_rows) * D);
    std::vector<float> m(max_rows), l(max_rows), s(static_cast<size_t>(max_rows) * bs);
    std::vector<float> kf(static_cast<size_t>(bs) * D), vf(static_cast<size_t>(bs) * D);
    std::vector<int> row_pos(max_rows);

#pragma omp for schedule(dynamic, 1)
    for (int it = 0; it < num_items; ++it) {
      const Item& w = items[it];
      const int seq_len = seq_lens[w.seq];
      const int t_new = query_start_loc[w.seq + 1] - query_start_loc[w.seq];
      const int first_pos = seq_len - t_new + w.q_begin;   // position of the tile's first query
      const int last_pos = seq_len - t_new + w.q_end - 1;  // ... and of its last
      const int head_rows = (w.q_end - w.q_begin) * G;
      const int rows = head_rows * (w.h_end - w.h_begin);
      // Row r = (KV head, token i, head g of its group), in that order.
      for (int h = w.h_begin; h < w.h_end; ++h)
        for (int i = w.q_begin; i < w.q_end; ++i) {
          const int64_t tok = query_start_loc[w.seq] + i;
          for (int g = 0; g < G; ++g) {
            const int r = (h - w.h_begin) * head_rows + (i - w.q_begin) * G + g;
            load_row(q + (tok * num_heads + h * G + g) * D, &qf[static_cast<size_t>(r) * D], D);
            row_pos[r] = seq_len - t_new + i;
          }
        }
      std::fill(m.begin(), m.begin() + rows, -INFINITY);
      std::fill(l.begin(), l.begin() + rows, 0.0f);
      std::fill(acc.begin(), acc.begin() + static_cast<size_t>(rows) * D, 0.0f);
      const int lo = window > 0 ? std::max(0, first_pos - window + 1) : 0;
      const int32_t* table = block_tables + static_cast<int64_t>(w.seq) * bt_stride;

      for (int blk = lo / bs; blk * bs <= last_pos; ++blk) {
        const int j0 = std::max(blk * bs, lo), j1 = std::min((blk + 1) * bs, last_pos + 1);  // keys [j0, j1)
        const int n = j1 - j0;
        // The next block's K/V rows are prefetched (per KV head, before this block's P.V) so that
        // DRAM latency hides behind this block's arithmetic: measured -15 % time per layer.
        const bool has_next = (blk + 1) * bs <= last_pos;
        const int64_t next_blk = has_next ? static_cast<int64_t>(table[blk + 1]) * blk_stride : 0;
        for (int h = w.h_begin; h < w.h_end; ++h) {
          const int64_t base = static_cast<int64_t>(table[blk]) * blk_stride + h * D +
                               static_cast<int64_t>(j0 - blk * bs) * tok_stride;
          const int r0 = (h - w.h_begin) * head_rows;
          const float* kp;
          if constexpr (sizeof(T) == sizeof(float)) {
            kp = nullptr;
          } else {
            for (int j = 0; j < n; ++j) load_row(k_cache + base + j * tok_stride, &kf[static_cast<size_t>(j) * D], D);
          }
          // Scores and the block's online-softmax update, row by row.
          for (int r = r0; r < r0 + head_rows; ++r) {
            const float* qr = &qf[static_cast<size_t>(r) * D];
            float* sr = &s[static_cast<size_t>(r) * bs];
            const int p = row_pos[r];
            float bmax = -INFINITY;
            for (int j = 0; j < n; ++j) {
              const int pos = j0 + j;
              if constexpr (sizeof(T) == sizeof(float)) {
                kp = reinterpret_cast<const float*>(k_cache) + base + j * tok_stride;
              } else {
                kp = &kf[static_cast<size_t>(j) * D];
              }
              float sc = dot(qr, kp, D) * scale;
              if (soft_cap > 0.0f) sc = soft_cap * std::tanh(sc / soft_cap);
              const bool visible = pos <= p && (window <= 0 || pos > p - window);
              sr[j] = visible ? sc : -INFINITY;
              bmax = std::max(bmax, sr[j]);
            }
            if (bmax == -INFINITY) {  // nothing visible to this row in this block
              for (int j = 0; j < n; ++j) sr[j] = 0.0f;
              continue;
            }
            const float m_new = std::max(m[r], bmax);
            const float corr = exp_nonpos(m[r] - m_new);  // m[r] = -inf -> 0 (acc and l are 0 then)
            float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
            for (int j = 0; j < n; ++j) {
              const float e = exp_nonpos(sr[j] - m_new);
              sr[j] = sr[j] == -INFINITY ? 0.0f : e;
              sum += sr[j];
            }
            l[r] = l[r] * corr + sum;
            m[r] = m_new;
            if (corr != 1.0f) {
              float* ar = &acc[static_cast<size_t>(r) * D];
#pragma omp simd
              for (int c = 0; c < D; ++c) ar[c] *= corr;
            }
          }
          // acc[r] += sum_j p[r][j] * v_j: V rows (L1-resident after the first row) stream through
          // one row's accumulator, which stays in registers when D is a compile-time constant.
          if constexpr (sizeof(T) != sizeof(float)) {
            for (int j = 0; j < n; ++j) load_row(v_cache + base + j * tok_stride, &vf[static_cast<size_t>(j) * D], D);
          }
          if (has_next) {
            for (int j = 0; j < n; ++j) {
              const int64_t nx = next_blk + h * D + (j + j0 - blk * bs) * tok_stride;
              prefetch_rows(k_cache + nx, 1, 0, D);
              prefetch_rows(v_cache + nx, 1, 0, D);
            }
          }
          for (int r = r0; r < r0 + head_rows; ++r) {
            const float* pr = &s[static_cast<size_t>(r) * bs];
            float* ar = &acc[static_cast<size_t>(r) * D];
            for (int j = 0; j < n; ++j) {
              const float pj = pr[j];
              const float* vp;
              if constexpr (sizeof(T) == sizeof(float)) {
                vp = reinterpret_cast<const float*>(v_cache) + base + j * tok_stride;
              } else {
                vp = &vf[static_cast<size_t>(j) * D];
              }
#pragma omp simd
              for (int c = 0; c < D; ++c) ar[c] += pj * vp[c];
            }
          }
        }
      }
      for (int h = w.h_begin; h < w.h_end; ++h)
        for (int i = w.q_begin; i < w.q_end; ++i) {
          const int64_t tok = query_start_loc[w.seq] + i;
          for (int g = 0; g < G; ++g) {
            const int r = (h - w.h_begin) * head_rows + (i - w.q_begin) * G + g;
            store_row(&acc[static_cast<size_t>(r) * D], out + (tok * num_heads + h * G + g) * D, D, 1.0f / l[r]);
          }
        }
    }
  }
}

}  // namespace

// Common head sizes get a specialisation; others run the same code with a runtime head_dim.
#define DISPATCH_HEAD_DIM(T, ...)                                                                       \
  switch (head_dim) {                                                                                  \
    case 64: return paged_attention<T, 64>(__VA_ARGS__, block_tables, bt_stride, seq_lens,               \
                                           query_start_loc, num_seqs, num_heads, num_kv_heads, head_dim, \
                                           block_size, scale, window, soft_cap, max_query_len);                         \
    case 128: return paged_attention<T, 128>(__VA_ARGS__, block_tables, bt_stride, seq_lens,             \
                                             query_start_loc, num_seqs, num_heads, num_kv_heads, head_dim, \
                                             block_size, scale, window, soft_cap, max_query_len);                       \
    default: return paged_attention<T, 0>(__VA_ARGS__, block_tables, bt_stride, seq_lens,                \
                                          query_start_loc, num_seqs, num_heads, num_kv_heads, head_dim,  \
                                          block_size, scale, window, soft_cap, max_query_len);                          \
  }

extern "C" {

int pagedllm_kernel_abi_version() { return 2; }

void paged_attention_f32(const float* q, const float* k_cache, const float* v_cache, float* out,
                         const int32_t* block_tables, int64_t bt_stride, const int32_t* seq_lens,
                         const int32_t* query_start_loc, int num_seqs, int num_heads, int num_kv_heads, int head_dim,
                         int block_size, float scale, int window, float soft_cap, int max_query_len) {
  DISPATCH_HEAD_DIM(float, q, k_cache, v_cache, out);
}

void paged_attention_bf16(const uint16_t* q, const uint16_t* k_cache, const uint16_t* v_cache, uint16_t* out,
                          const int32_t* block_tables, int64_t bt_stride, const int32_t* seq_lens,
                          const int32_t* query_start_loc, int num_seqs, int num_heads, int num_kv_heads,
                          int head_dim, int block_size, float scale, int window, float soft_cap, int max_query_len) {
  DISPATCH_HEAD_DIM(uint16_t, q, k_cache, v_cache, out);
}

}  // extern "C"
