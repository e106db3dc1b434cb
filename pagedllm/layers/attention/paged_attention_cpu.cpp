// Paged attention for CPUs: reads K/V in place through the block table (no gathered copy of the
// context), one online softmax per query row over blocks (Kwon et al., SOSP 2023, PagedAttention
// kernel; Dao et al., 2022, FlashAttention; Milakov & Gimelshein, 2018, online softmax).
//
// Flat batch of B sequences: sequence b owns query rows query_start_loc[b] .. query_start_loc[b+1]
// (T_b new tokens at positions seq_lens[b] - T_b .. seq_lens[b] - 1); decodes (T_b = 1) and prefill
// chunks over a cached prefix mix freely. One work item = (sequence, KV head, tile of queries): its
// rows are the G = H / Hkv query heads of that KV head times the tile's tokens, so K/V are read once
// for the whole group (grouped-query attention without expanding K/V).
//
// Layouts (all contiguous, checked by the Python caller):
//   q, out      [N, H, D]                         float32 or bfloat16 (raw uint16)
//   k/v cache   [num_blocks, block_size, Hkv, D]  same dtype as q
//   block_tables [B, bt_stride] int32; seq_lens [B] int32; query_start_loc [B + 1] int32
// Accumulation is float32. Plain C ABI (called through ctypes): no torch headers, builds in seconds.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

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

struct Item {
  int seq, kv_head, q_begin, q_end;  // q_* are token offsets within the sequence's new tokens
};

template <typename T>
void paged_attention(const T* q, const T* k_cache, const T* v_cache, T* out, const int32_t* block_tables,
                     int64_t bt_stride, const int32_t* seq_lens, const int32_t* query_start_loc, int num_seqs,
                     int num_heads, int num_kv_heads, int head_dim, int block_size, float scale, int window,
                     float soft_cap) {
  const int G = num_heads / num_kv_heads, D = head_dim, bs = block_size;
  const int64_t tok_stride = static_cast<int64_t>(num_kv_heads) * D;  // between tokens of a block
  const int64_t blk_stride = tok_stride * bs;
  std::vector<Item> items;
  for (int b = 0; b < num_seqs; ++b) {
    const int t = query_start_loc[b + 1] - query_start_loc[b];
    for (int h = 0; h < num_kv_heads; ++h)
      for (int t0 = 0; t0 < t; t0 += kQueryTile) items.push_back({b, h, t0, std::min(t, t0 + kQueryTile)});
  }
  const int num_items = static_cast<int>(items.size());

#pragma omp parallel
  {
    // Per-thread scratch: rows x (query, running max, running sum, accumulator), one block of
    // scores, and one K/V row converted to float.
    const int max_rows = G * kQueryTile;
    std::vector<float> qf(static_cast<size_t>(max_rows) * D), acc(static_cast<size_t>(max_rows) * D);
    std::vector<float> m(max_rows), l(max_rows), s(static_cast<size_t>(max_rows) * bs);
    std::vector<float> kf(static_cast<size_t>(bs) * D), vf(D);
    std::vector<int> row_pos(max_rows);

#pragma omp for schedule(dynamic, 1)
    for (int it = 0; it < num_items; ++it) {
      const Item& w = items[it];
      const int seq_len = seq_lens[w.seq];
      const int t_new = query_start_loc[w.seq + 1] - query_start_loc[w.seq];
      const int first_pos = seq_len - t_new + w.q_begin;   // position of the tile's first query
      const int last_pos = seq_len - t_new + w.q_end - 1;  // ... and of its last
      const int rows = (w.q_end - w.q_begin) * G;
      // Row r = token i, head g of the group: r = i * G + g.
      for (int i = w.q_begin; i < w.q_end; ++i) {
        const int64_t tok = query_start_loc[w.seq] + i;
        for (int g = 0; g < G; ++g) {
          const int r = (i - w.q_begin) * G + g;
          load_row(q + (tok * num_heads + w.kv_head * G + g) * D, &qf[static_cast<size_t>(r) * D], D);
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
        const int64_t base = static_cast<int64_t>(table[blk]) * blk_stride + w.kv_head * D +
                             static_cast<int64_t>(j0 - blk * bs) * tok_stride;
        const float* kp;
        if constexpr (sizeof(T) == sizeof(float)) {
          kp = nullptr;
        } else {
          for (int j = 0; j < n; ++j) load_row(k_cache + base + j * tok_stride, &kf[static_cast<size_t>(j) * D], D);
        }
        // Scores and the block's online-softmax update, row by row.
        for (int r = 0; r < rows; ++r) {
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
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int c = 0; c < D; ++c) dot += qr[c] * kp[c];
            float sc = dot * scale;
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
        // acc[r] += p[r][j] * v_j, each V row read once for all rows.
        for (int j = 0; j < n; ++j) {
          const float* vp;
          if constexpr (sizeof(T) == sizeof(float)) {
            vp = reinterpret_cast<const float*>(v_cache) + base + j * tok_stride;
          } else {
            load_row(v_cache + base + j * tok_stride, vf.data(), D);
            vp = vf.data();
          }
          for (int r = 0; r < rows; ++r) {
            const float pj = s[static_cast<size_t>(r) * bs + j];
            if (pj == 0.0f) continue;
            float* ar = &acc[static_cast<size_t>(r) * D];
#pragma omp simd
            for (int c = 0; c < D; ++c) ar[c] += pj * vp[c];
          }
        }
      }
      for (int i = w.q_begin; i < w.q_end; ++i) {
        const int64_t tok = query_start_loc[w.seq] + i;
        for (int g = 0; g < G; ++g) {
          const int r = (i - w.q_begin) * G + g;
          store_row(&acc[static_cast<size_t>(r) * D], out + (tok * num_heads + w.kv_head * G + g) * D, D,
                    1.0f / l[r]);
        }
      }
    }
  }
}

}  // namespace

extern "C" {

int pagedllm_kernel_abi_version() { return 1; }

void paged_attention_f32(const float* q, const float* k_cache, const float* v_cache, float* out,
                         const int32_t* block_tables, int64_t bt_stride, const int32_t* seq_lens,
                         const int32_t* query_start_loc, int num_seqs, int num_heads, int num_kv_heads, int head_dim,
                         int block_size, float scale, int window, float soft_cap) {
  paged_attention<float>(q, k_cache, v_cache, out, block_tables, bt_stride, seq_lens, query_start_loc, num_seqs,
                         num_heads, num_kv_heads, head_dim, block_size, scale, window, soft_cap);
}

void paged_attention_bf16(const uint16_t* q, const uint16_t* k_cache, const uint16_t* v_cache, uint16_t* out,
                          const int32_t* block_tables, int64_t bt_stride, const int32_t* seq_lens,
                          const int32_t* query_start_loc, int num_seqs, int num_heads, int num_kv_heads,
                          int head_dim, int block_size, float scale, int window, float soft_cap) {
  paged_attention<uint16_t>(q, k_cache, v_cache, out, block_tables, bt_stride, seq_lens, query_start_loc,
                            num_seqs, num_heads, num_kv_heads, head_dim, block_size, scale, window, soft_cap);
}

}  // extern "C"
