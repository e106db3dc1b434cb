// Paged attention for CPUs: reads K/V in place through the block table (no gathered copy of the
// context), one online softmax per query row over blocks (Kwon et al., SOSP 2023, PagedAttention
// kernel; Dao et al., 2022, FlashAttention; Milakov & Gimelshein, 2018, online softmax).
//
// Flat batch of B sequences: sequence b owns query rows query_start_loc[b] .. query_start_loc[b+1]
// (T_b new tokens at positions seq_lens[b] - T_b .. seq_lens[b] - 1); decodes (T_b = 1) and prefill
// chunks over a cached prefix mix freely. One work item = (sequence, KV head, tile of queries), or a
// whole decode sequence (all its KV heads) when the batch has sequences enough for every thread;
// with fewer than 2 items a thread, a decode's keys split into parts, one item each, merged after
// (split_decodes, merge_parts). The rows of a KV head are its G = H / Hkv query heads times the
// tile's tokens, so K/V are read once for the whole group (grouped-query attention without expanding
// K/V).
//
// Layouts (all contiguous, checked by the Python caller):
//   q, out      [N, H, D]                         float32 or bfloat16 (raw uint16)
//   k/v cache   [num_blocks, block_size, Hkv, D]  same dtype as q, or
//               [num_blocks, block_size + S, Hkv, D] int8: each block's rows of values, then in the
//               S = ceil(4 * block_size / D) rows after them its float32 scales [block_size, Hkv]
//               (x ~ value * scale, scale = max|x| / 127 per (token, KV head) row; kv_write_int8)
//   block_tables [B, bt_stride] int32; seq_lens [B] int32; query_start_loc [B + 1] int32
// Sequences with more than max_query_len new tokens (when > 0) are skipped: the caller runs those.
// window > 0: a query at position p sees keys p - window < j <= p (sliding window); window < 0: keys
// in its own chunk of -window positions, floor(p / C) * C <= j <= p (Llama 4's chunked attention).
// sinks [H] float32 or null: attention sinks (gpt-oss), one logit per query head that joins every
// softmax denominator with no value: out = sum_j e^(s_j - m) v_j / (sum_j e^(s_j - m) + e^(sink - m)).
// Accumulation is float32. Plain C ABI (called through ctypes): no torch headers, builds in seconds.
//
// Two implementations of the same computation: with AVX-512 (or AVX2 + FMA) and head_dim % 16 == 0,
// paged_attention_vec (chunks of 512 keys, 16 scores per transposing add tree, bf16 dot products
// on AVX512-BF16, K/V prefetched into L2 ahead of use, the next KV head's or item's K during P.V:
// the loop is memory-bound, and prefetching into L2 measured 1.4x faster than into L1 or none, 3 % to
// 13 % faster again with the prefetches during P.V; an int8 cache in a bf16 model on AVX512-VNNI
// takes its dot products in int16 (paged_attention_vec's kVnni); on AVX2 each chunk's rows are first read
// once with bare loads, see touch_rows); elsewhere the portable paged_attention (one block at a
// time). The vector path's building blocks, per instruction set, are paged_attention_simd.h's.
// tests/test_attention_kernel.py runs both against the torch reference. On AVX2 the vector path's
// 16 lanes are two ymm (F16); with the cache in L2 it computes a SmolLM2 decode layer at batch 48
// in 0.51 ms where the portable loops take 1.2 (from DRAM: 56-60 against 62-65 ms for 30 layers,
// memory-bound).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include <omp.h>

#include "cpu_math.h"
#include "paged_attention_simd.h"

namespace {

constexpr int kQueryTile = 16;  // query tokens per work item in a prefill chunk

using pagedllm_cpu::bf16_to_float;
using pagedllm_cpu::float_to_bf16;

// The first key position a query at position p sees (see `window` above).
inline int first_visible(int p, int window) {
  if (window > 0) return std::max(0, p - window + 1);
  return window < 0 ? p / -window * -window : 0;
}

// 1 / the softmax denominator of a row whose running max is m and sum l, with query head `head`'s
// attention sink (sinks null: none) as one more logit that has no value row.
inline float inv_denominator(float m, float l, const float* sinks, int head) {
  return 1.0f / (sinks == nullptr ? l : l + std::exp(sinks[head] - m));
}

// Token rows of one block: an int8 block has S more, holding its scales.
template <typename C>
inline int block_rows(int bs, int d) { return kInt8<C> ? bs + (4 * bs + d - 1) / d : bs; }
// The float32 scale at byte offset `off` of an int8 cache.
inline float scale_at(const int8_t* cache, int64_t off) {
  float s;
  std::memcpy(&s, cache + off, sizeof(float));
  return s;
}
// Where an int8 cache's slot lives: its block's offset (blk_stride apart) and its row in the block.
struct Int8Slot {
  int64_t block_off;
  int in;
};
inline Int8Slot int8_slot(int64_t slot, int block_size, int64_t blk_stride) {
  return {slot / block_size * blk_stride, static_cast<int>(slot % block_size)};
}

// Byte offset of the scale of (token `in` of the block at `block_off`, KV head h).
inline int64_t scale_offset(int64_t block_off, int bs, int in, int num_kv_heads, int h, int d) {
  return block_off + static_cast<int64_t>(bs) * num_kv_heads * d + (static_cast<int64_t>(in) * num_kv_heads + h) * 4;
}

// One online-softmax step for a query row: scores sr[0, n) (-inf where masked) whose max is bmax
// are folded into the row's running max m, sum l and accumulator acc[0, d) (rescaled when the max
// grows); sr becomes the unnormalised probabilities, 0 where masked (all 0 when nothing is visible).
inline void softmax_fold(float* sr, int n, float bmax, float& m, float& l, float* acc, int d) {
  if (bmax == -INFINITY) {
    std::fill(sr, sr + n, 0.0f);
    return;
  }
  const float m_new = std::max(m, bmax);
  const float corr = exp_nonpos(m - m_new);  // m = -inf -> 0 (acc and l are 0 then)
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int j = 0; j < n; ++j) {
    const float e = exp_nonpos(sr[j] - m_new);
    sr[j] = sr[j] == -INFINITY ? 0.0f : e;
    sum += sr[j];
  }
  l = l * corr + sum;
  m = m_new;
  if (corr != 1.0f) {
#pragma omp simd
    for (int c = 0; c < d; ++c) acc[c] *= corr;
  }
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

inline void dequant_row(const int8_t* src, float scale, float* dst, int d) {
#pragma omp simd
  for (int i = 0; i < d; ++i) dst[i] = static_cast<float>(src[i]) * scale;
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
    for (int c = 0; c < row_bytes<T>(d); c += 64)
      __builtin_prefetch(reinterpret_cast<const char*>(p + j * stride) + c);
}

struct Item {
  int seq, h_begin, h_end, q_begin, q_end;  // KV heads [h_begin, h_end); q_* index the sequence's new tokens
  int k_begin = 0, k_end = 1 << 30;          // keys [k_begin, k_end) (a part of a split decode)
  int part = -1;                             // its slot in the parts' partial results; -1: not split
};

// A decode's keys split into parts when there are too few items to keep the threads busy (one
// sequence: at most num_kv_heads items, one thread for a model with one KV head). Each part keeps
// its unnormalized accumulator with its running max and sum; merge_parts combines them (the
// PagedAttention paper's v2 kernel, flash-decoding). Parts hold at least kMinPartKeys keys.
constexpr int kMinPartKeys = 256;

struct Split {
  Item item;                   // the decode item split (its sequence and KV head)
  int first_part, num_parts;  // its parts' slots in the partial results
};

struct Parts {
  std::vector<Item> items;
  std::vector<Split> splits;
  int num_parts = 0;
  int G = 0, D = 0;
  // the parts' partial results: [part][G] running max and sum, [part][G][D] accumulator
  std::vector<float> m, l, acc;
};

// A decode item takes all KV heads of its sequence when there are sequences enough to keep every
// thread busy: it then reads each block of the cache as one contiguous run.
std::vector<Item> make_items(const int32_t* query_start_loc, int num_seqs, int num_kv_heads, int max_query_len) {
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
  return items;
}

// make_items, with each decode item's keys split into parts where the items are fewer than 2 per
// thread; items[i].part indexes the partial results (G query heads of D each), splits the parts of
// each decode that was split.
Parts split_decodes(std::vector<Item> items, const int32_t* seq_lens, const int32_t* query_start_loc, int G, int D) {
  Parts out;
  out.G = G, out.D = D;
  const int threads = omp_get_max_threads();
  const int n = static_cast<int>(items.size());
  const int want = n >= 2 * threads ? 1 : (2 * threads + n - 1) / n;  // parts per decode item
  for (const Item& w : items) {
    const int t = query_start_loc[w.seq + 1] - query_start_loc[w.seq];
    const int parts = t == 1 && w.h_end - w.h_begin == 1 ? std::min(want, seq_lens[w.seq] / kMinPartKeys) : 1;
    if (parts <= 1) {
      out.items.push_back(w);
      continue;
    }
    out.splits.push_back({w, out.num_parts, parts});
    const int len = seq_lens[w.seq], step = (len + parts - 1) / parts;
    for (int p = 0; p < parts; ++p) {
      Item x = w;
      x.k_begin = p * step, x.k_end = std::min(len, (p + 1) * step), x.part = out.num_parts++;
      out.items.push_back(x);
    }
  }
  out.m.resize(static_cast<size_t>(out.num_parts) * G);
  out.l.resize(out.m.size());
  out.acc.resize(out.m.size() * D);
  return out;
}

// A split decode part's G rows (its running max, sum and unnormalized accumulator) into the parts'
// partial results, for merge_parts.
inline void keep_part(Parts& parts, int part, const float* m, const float* l, const float* acc) {
  const size_t G = parts.G, D = parts.D;
  std::copy(m, m + G, &parts.m[part * G]);
  std::copy(l, l + G, &parts.l[part * G]);
  std::copy(acc, acc + G * D, &parts.acc[part * G * D]);
}

// The split decodes' outputs from their parts: with M = max_p m_p, out = sum_p e^(m_p - M) acc_p /
// sum_p e^(m_p - M) l_p, for each of the G query heads of the split's KV head. A part that saw no
// visible key has m = -inf, l = 0: weight 0.
template <typename T>
void merge_parts(const Parts& parts, const int32_t* query_start_loc, int num_heads, const float* sinks, T* out) {
  const int splits = static_cast<int>(parts.splits.size()), G = parts.G, D = parts.D;
  const auto &pm = parts.m, &pl = parts.l, &pacc = parts.acc;  // [part][G], [part][G], [part][G][D]
  if (splits == 0) return;
#pragma omp parallel for schedule(static) if (splits * G * D >= 4096)
  for (int i = 0; i < splits; ++i) {
    const int p0 = parts.splits[i].first_part, np = parts.splits[i].num_parts;
    const Item& w = parts.splits[i].item;
    const int64_t tok = query_start_loc[w.seq];
    std::vector<float> acc(D);
    for (int g = 0; g < G; ++g) {
      float mx = -INFINITY;
      for (int p = p0; p < p0 + np; ++p) mx = std::max(mx, pm[static_cast<size_t>(p) * G + g]);
      float l = 0.0f;
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int p = p0; p < p0 + np; ++p) {
        const float m = pm[static_cast<size_t>(p) * G + g];
        const float e = m == -INFINITY ? 0.0f : std::exp(m - mx);
        l += e * pl[static_cast<size_t>(p) * G + g];
        const float* a = &pacc[(static_cast<size_t>(p) * G + g) * D];
        for (int c = 0; c < D; ++c) acc[c] += e * a[c];
      }
      store_row(acc.data(), out + (tok * num_heads + w.h_begin * G + g) * D, D,
                inv_denominator(mx, l, sinks, w.h_begin * G + g));
    }
  }
}

// T: q/out; C: the cache (T, or int8_t). kHeadDim > 0: head_dim fixed at compile time (unrolled loops).
template <typename T, typename C, int kHeadDim>
void paged_attention(const T* q, const C* k_cache, const C* v_cache, T* out, const int32_t* block_tables,
                     int64_t bt_stride, const int32_t* seq_lens, const int32_t* query_start_loc, int num_seqs,
                     int num_heads, int num_kv_heads, int head_dim, int block_size, float scale, int window,
                     float soft_cap, int max_query_len, const float* sinks) {
  const int G = num_heads / num_kv_heads, bs = block_size;
  const int D = kHeadDim > 0 ? kHeadDim : head_dim;
  const int64_t tok_stride = static_cast<int64_t>(num_kv_heads) * D;  // between tokens of a block
  const int64_t blk_stride = tok_stride * block_rows<C>(bs, D);
  constexpr bool kDirect = std::is_same_v<C, float>;  // K/V rows used in place, else converted
  Parts parts = split_decodes(make_items(query_start_loc, num_seqs, num_kv_heads, max_query_len), seq_lens,
                              query_start_loc, G, D);
  const std::vector<Item>& items = parts.items;
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
      const int lo = std::max(w.k_begin, first_visible(first_pos, window));
      const int hi = std::min(last_pos, w.k_end - 1);  // keys [lo, hi]
      const int32_t* table = block_tables + static_cast<int64_t>(w.seq) * bt_stride;

      for (int blk = lo / bs; blk * bs <= hi; ++blk) {
        const int j0 = std::max(blk * bs, lo), j1 = std::min((blk + 1) * bs, hi + 1);  // keys [j0, j1)
        const int n = j1 - j0;
        // The next block's K/V rows are prefetched (per KV head, before this block's P.V) so that
        // DRAM latency hides behind this block's arithmetic: measured -15 % time per layer.
        const bool has_next = (blk + 1) * bs <= hi;
        const int64_t next_blk = has_next ? static_cast<int64_t>(table[blk + 1]) * blk_stride : 0;
        for (int h = w.h_begin; h < w.h_end; ++h) {
          const int64_t blk_off = static_cast<int64_t>(table[blk]) * blk_stride;
          const int64_t base = blk_off + h * D + static_cast<int64_t>(j0 - blk * bs) * tok_stride;
          const int r0 = (h - w.h_begin) * head_rows;
          // Row j of this block's keys as float (bf16 widened, int8 dequantized) into kf / vf.
          auto widen = [&](const C* cache, int j, float* dst) {
            if constexpr (kInt8<C>)
              dequant_row(cache + base + j * tok_stride,
                          scale_at(cache, scale_offset(blk_off, bs, j0 - blk * bs + j, num_kv_heads, h, D)), dst, D);
            else
              load_row(cache + base + j * tok_stride, dst, D);
          };
          const float* kp;
          if constexpr (kDirect) {
            kp = nullptr;
          } else {
            for (int j = 0; j < n; ++j) widen(k_cache, j, &kf[static_cast<size_t>(j) * D]);
          }
          // Scores and the block's online-softmax update, row by row.
          for (int r = r0; r < r0 + head_rows; ++r) {
            const float* qr = &qf[static_cast<size_t>(r) * D];
            float* sr = &s[static_cast<size_t>(r) * bs];
            const int p = row_pos[r], first = first_visible(p, window);
            float bmax = -INFINITY;
            for (int j = 0; j < n; ++j) {
              const int pos = j0 + j;
              if constexpr (kDirect) {
                kp = k_cache + base + j * tok_stride;
              } else {
                kp = &kf[static_cast<size_t>(j) * D];
              }
              float sc = dot(qr, kp, D) * scale;
              if (soft_cap > 0.0f) sc = soft_cap * std::tanh(sc / soft_cap);
              const bool visible = pos <= p && pos >= first;
              sr[j] = visible ? sc : -INFINITY;
              bmax = std::max(bmax, sr[j]);
            }
            softmax_fold(sr, n, bmax, m[r], l[r], &acc[static_cast<size_t>(r) * D], D);
          }
          // acc[r] += sum_j p[r][j] * v_j: V rows (L1-resident after the first row) stream through
          // one row's accumulator, which stays in registers when D is a compile-time constant.
          if constexpr (!kDirect) {
            for (int j = 0; j < n; ++j) widen(v_cache, j, &vf[static_cast<size_t>(j) * D]);
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
              if constexpr (kDirect) {
                vp = v_cache + base + j * tok_stride;
              } else {
                vp = &vf[static_cast<size_t>(j) * D];
              }
#pragma omp simd
              for (int c = 0; c < D; ++c) ar[c] += pj * vp[c];
            }
          }
        }
      }
      if (w.part >= 0) {
        keep_part(parts, w.part, m.data(), l.data(), acc.data());
        continue;
      }
      for (int h = w.h_begin; h < w.h_end; ++h)
        for (int i = w.q_begin; i < w.q_end; ++i) {
          const int64_t tok = query_start_loc[w.seq] + i;
          for (int g = 0; g < G; ++g) {
            const int r = (h - w.h_begin) * head_rows + (i - w.q_begin) * G + g;
            store_row(&acc[static_cast<size_t>(r) * D], out + (tok * num_heads + h * G + g) * D, D,
                      inv_denominator(m[r], l[r], sinks, h * G + g));
          }
        }
    }
  }
  merge_parts(parts, query_start_loc, num_heads, sinks, out);
}

#ifdef PAGEDLLM_VEC
// The same computation with AVX-512 (or AVX2) for head_dim % 16 == 0, over chunks of up to KC keys rather
// than one block at a time: the scores of a chunk (keys taken through the block table across block
// boundaries) are computed 16 at a time per query row with one transposing add tree, then masked,
// exponentiated and summed as whole vectors, and only then folded into the running softmax (one
// rescale per chunk, as in flash-decoding); P.V then streams each V row once for several rows.
// An int8 cache: each 16 keys are widened once into a small buffer (as T: exact, see int8_row_to)
// for the dot products of all rows, the scores then scaled by each key's scale; each V row's scale
// is folded into the probabilities before P.V, which widens the V rows as it streams them.
template <typename T, typename C, int kHeadDim>
void paged_attention_vec(const T* q, const C* k_cache, const C* v_cache, T* out, const int32_t* block_tables,
                         int64_t bt_stride, const int32_t* seq_lens, const int32_t* query_start_loc, int num_seqs,
                         int num_heads, int num_kv_heads, int head_dim, int block_size, float scale, int window,
                         float soft_cap, int max_query_len, const float* sinks) {
  constexpr int KC = 512;  // keys per chunk (a multiple of 16)
  const int G = num_heads / num_kv_heads, bs = block_size;
  const int D = kHeadDim > 0 ? kHeadDim : head_dim;
  const int64_t tok_stride = static_cast<int64_t>(num_kv_heads) * D;
  const int64_t blk_stride = tok_stride * block_rows<C>(bs, D);
  Parts parts = split_decodes(make_items(query_start_loc, num_seqs, num_kv_heads, max_query_len), seq_lens,
                              query_start_loc, G, D);
  const std::vector<Item>& items = parts.items;
  const int num_items = static_cast<int>(items.size());

#pragma omp parallel
  {
    const int max_rows = std::max(num_kv_heads, kQueryTile) * G;
    std::vector<T> qt(static_cast<size_t>(max_rows) * D);
    std::vector<float> acc(static_cast<size_t>(max_rows) * D), m(max_rows), l(max_rows);
    std::vector<float> s(static_cast<size_t>(max_rows) * KC);
    std::vector<int> row_pos(max_rows);
    std::vector<int64_t> off(KC), sc_off(kInt8<C> ? KC : 0);  // sc_off: the key's scale for KV head 0
    std::vector<const C*> kp(KC), vp(KC), k_next(KC);  // k_next: rows to prefetch during P.V
    const int num_threads = omp_get_num_threads();
    std::vector<float> k_scale(kInt8<C> ? KC : 0), v_scale(kInt8<C> ? KC : 0);
    std::vector<T> kw(kInt8<C> ? 16 * D : 0);  // 16 int8 key rows widened
    const T* kw_rows[16];
    for (int j = 0; j < 16 && kInt8<C>; ++j) kw_rows[j] = &kw[static_cast<size_t>(j) * D];
#ifdef PAGEDLLM_VNNI
    constexpr bool kVnni = std::is_same_v<T, uint16_t> && kInt8<C> && kHeadDim > 0 && kHeadDim % 64 == 0;
#else
    constexpr bool kVnni = false;
#endif
    // kVnni: the query rows quantized to int16 (and their scales), 16 key rows widened to int16
    std::vector<int16_t> qi(kVnni ? static_cast<size_t>(max_rows) * D : 0), kw16(kVnni ? 16 * D : 0);
    std::vector<float> q_scale(kVnni ? max_rows : 0);
    const int16_t* kw16_rows[16];
    for (int j = 0; j < 16 && kVnni; ++j) kw16_rows[j] = &kw16[static_cast<size_t>(j) * D];

#pragma omp for schedule(dynamic, 1)
    for (int it = 0; it < num_items; ++it) {
      const Item& w = items[it];
      const int seq_len = seq_lens[w.seq];
      const int t_new = query_start_loc[w.seq + 1] - query_start_loc[w.seq];
      const int first_pos = seq_len - t_new + w.q_begin;
      const int last_pos = seq_len - t_new + w.q_end - 1;
      const int head_rows = (w.q_end - w.q_begin) * G;
      const int rows = head_rows * (w.h_end - w.h_begin);
      for (int h = w.h_begin; h < w.h_end; ++h)
        for (int i = w.q_begin; i < w.q_end; ++i) {
          const int64_t tok = query_start_loc[w.seq] + i;
          const int r0 = (h - w.h_begin) * head_rows + (i - w.q_begin) * G;
          std::memcpy(&qt[static_cast<size_t>(r0) * D], q + (tok * num_heads + h * G) * D, sizeof(T) * G * D);
          for (int g = 0; g < G; ++g) row_pos[r0 + g] = seq_len - t_new + i;
        }
#ifdef PAGEDLLM_VNNI
      if constexpr (kVnni)
        for (int r = 0; r < rows; ++r)
          q_scale[r] = quantize_i16(reinterpret_cast<const uint16_t*>(&qt[static_cast<size_t>(r) * D]),
                                    &qi[static_cast<size_t>(r) * D], D);
#endif
      std::fill(m.begin(), m.begin() + rows, -INFINITY);
      std::fill(l.begin(), l.begin() + rows, 0.0f);
      std::fill(acc.begin(), acc.begin() + static_cast<size_t>(rows) * D, 0.0f);
      const int lo = std::max(w.k_begin, first_visible(first_pos, window));
      const int hi = std::min(last_pos, w.k_end - 1);  // keys [lo, hi]
      const int32_t* table = block_tables + static_cast<int64_t>(w.seq) * bt_stride;

      // Bytes of one token row this item reads (its KV heads); with touching, keys a chunk so that
      // the chunk's K and V fit in kTouchBytes.
      const int seg_bytes = (w.h_end - w.h_begin) * row_bytes<C>(D);
      const int kc = kTouchBytes > 0 ? std::max(16, std::min(KC, (kTouchBytes / (2 * seg_bytes)) & ~15)) : KC;
      for (int c0 = lo; c0 <= hi; c0 += kc) {
        const int n = std::min(kc, hi + 1 - c0);
        const int npad = (n + 15) & ~15;
        for (int j = 0, blk = c0 / bs, in = c0 % bs; j < n; ++j) {  // walk the block table
          off[j] = static_cast<int64_t>(table[blk]) * blk_stride + in * tok_stride;
          if constexpr (kInt8<C>) {
            sc_off[j] = scale_offset(static_cast<int64_t>(table[blk]) * blk_stride, bs, in, num_kv_heads, 0, D);
            __builtin_prefetch(reinterpret_cast<const char*>(k_cache) + sc_off[j], 0, 2);
            __builtin_prefetch(reinterpret_cast<const char*>(v_cache) + sc_off[j], 0, 2);
          }
          if (++in == bs) in = 0, ++blk;
        }
#ifdef PAGEDLLM_AVX2
        touch_rows(k_cache, v_cache, off.data(), n, static_cast<int64_t>(w.h_begin) * D, seg_bytes);
#endif
        for (int j = n; j < npad; ++j) {  // padding keys repeat the last (masked)
          off[j] = off[n - 1];
          if constexpr (kInt8<C>) sc_off[j] = sc_off[n - 1];
        }
        for (int h = w.h_begin; h < w.h_end; ++h) {
          for (int j = 0; j < npad; ++j) kp[j] = k_cache + off[j] + h * D, vp[j] = v_cache + off[j] + h * D;
          const int r0 = (h - w.h_begin) * head_rows;
          const F16 vscale = set1_16(scale);
          for (int j0 = 0; j0 < npad; j0 += 16) {  // each 16 keys from L1 for all rows of the head
            // K rows two groups ahead (one ahead measured 4-8 % slower: DRAM latency is not hidden);
            // not where the chunk was touched (AVX2): its rows are in L2, and these prefetches cost
            // 8-10 % of the kernel's time there with the cache hot.
            if (kTouchBytes == 0 && j0 + 32 < npad)
              for (int j = j0 + 32; j < std::min(npad, j0 + 48); ++j)
                for (int c = 0; c < row_bytes<C>(D); c += 64)
                  __builtin_prefetch(reinterpret_cast<const char*>(kp[j]) + c, 0, 2);
            if (kTouchBytes == 0)
              for (int j = j0; j < j0 + 16; ++j)  // this head's V rows, for P.V after the scores
                for (int c = 0; c < row_bytes<C>(D); c += 64)
                  __builtin_prefetch(reinterpret_cast<const char*>(vp[j]) + c, 0, 2);
#ifdef PAGEDLLM_VNNI
            if constexpr (kVnni) {
              for (int j = 0; j < 16; ++j) {  // scale lines were prefetched by the table walk
                for (int c = 0; c < D; c += 32)
                  _mm512_storeu_si512(&kw16[static_cast<size_t>(j) * D + c],
                                      _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(kp[j0 + j] + c))));
                k_scale[j0 + j] = scale_at(k_cache, sc_off[j0 + j] + 4 * h) * scale;
              }
              const F16 ks = load16(&k_scale[j0]);
              for (int r = r0; r < r0 + head_rows; ++r)
                store16(&s[static_cast<size_t>(r) * KC + j0],
                        mul16(dot16_i16<kHeadDim>(&qi[static_cast<size_t>(r) * D], kw16_rows), mul16(ks, set1_16(q_scale[r]))));
              continue;
            }
#endif
            if constexpr (kInt8<C>) {
              for (int j = 0; j < 16; ++j) {  // scale lines were prefetched by the table walk
                int8_row_to(kp[j0 + j], &kw[static_cast<size_t>(j) * D], D);
                k_scale[j0 + j] = scale_at(k_cache, sc_off[j0 + j] + 4 * h) * scale;
              }
              const F16 ks = load16(&k_scale[j0]);
              for (int r = r0; r < r0 + head_rows; ++r)
                store16(&s[static_cast<size_t>(r) * KC + j0],
                        mul16(dot16<kHeadDim>(&qt[static_cast<size_t>(r) * D], kw_rows, D), ks));
            } else {
              for (int r = r0; r < r0 + head_rows; ++r)
                store16(&s[static_cast<size_t>(r) * KC + j0],
                        mul16(dot16<kHeadDim>(&qt[static_cast<size_t>(r) * D], &kp[j0], D), vscale));
            }
          }
          if constexpr (kInt8<C>)
            for (int j = 0; j < n; ++j) v_scale[j] = scale_at(v_cache, sc_off[j] + 4 * h);
          for (int r = r0; r < r0 + head_rows; ++r) {
            float* sr = &s[static_cast<size_t>(r) * KC];
            const int p = row_pos[r];
            if (soft_cap > 0.0f)
              for (int j = 0; j < n; ++j) sr[j] = soft_cap * std::tanh(sr[j] / soft_cap);
            // Visible keys: j < n, position <= p, inside the window (or chunk).
            const int vis_hi = std::min(n, p - c0 + 1);                        // j < vis_hi
            const int vis_lo = std::max(0, first_visible(p, window) - c0);  // j >= vis_lo
#ifdef PAGEDLLM_AVX512
            // Masked to -inf, and the max, 16 at a time (GCC kept this loop scalar: a chain of maxss).
            const __m512i lo_v = _mm512_set1_epi32(vis_lo), hi_v = _mm512_set1_epi32(vis_hi);
            const __m512 neg_inf = _mm512_set1_ps(-INFINITY);
            __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
            __m512 vmax = neg_inf;
            for (int j = 0; j < npad; j += 16, idx = _mm512_add_epi32(idx, _mm512_set1_epi32(16))) {
              const __mmask16 live = _mm512_cmp_epi32_mask(idx, lo_v, _MM_CMPINT_NLT) &
                                     _mm512_cmp_epi32_mask(idx, hi_v, _MM_CMPINT_LT);
              const __m512 x = _mm512_mask_blend_ps(live, neg_inf, _mm512_loadu_ps(sr + j));
              _mm512_storeu_ps(sr + j, x);
              vmax = _mm512_max_ps(vmax, x);
            }
            const float bmax = _mm512_reduce_max_ps(vmax);
#else
            const float bmax = mask_max16(sr, npad, vis_lo, vis_hi);
#endif
            softmax_fold16(sr, npad, bmax, m[r], l[r], &acc[static_cast<size_t>(r) * D], D);
            if constexpr (kInt8<C>) {
#pragma omp simd
              for (int j = 0; j < n; ++j) sr[j] *= v_scale[j];
            }
          }
          // While P.V of a decode's KV head runs, the K rows of what comes next are prefetched: the
          // next KV head's, or after the item's last chunk the first KV head's of the item this
          // thread likely takes next (items are handed out in turn). Else memory would idle during
          // P.V (its V rows were prefetched with the scores): SmolLM2's batch-48 decode, 30 layers,
          // 2-18 % less time. Not in a prefill tile: 16 queries a key, its loop is compute-bound.
          const C* const* pf = nullptr;
          if (kTouchBytes == 0 && t_new == 1 && h + 1 < w.h_end) {
            for (int j = 0; j < npad; ++j) k_next[j] = kp[j] + D;
            pf = k_next.data();
          } else if (kTouchBytes == 0 && t_new == 1 && c0 + kc > hi && it + num_threads < num_items) {
            const Item& x = items[it + num_threads];
            const int xt = query_start_loc[x.seq + 1] - query_start_loc[x.seq];
            const int xlo = std::max(x.k_begin, first_visible(seq_lens[x.seq] - xt + x.q_begin, window));
            const int xn = std::min(npad, std::min(seq_lens[x.seq], x.k_end) - xlo);  // its table has keys < seq_len
            const int32_t* xtab = block_tables + static_cast<int64_t>(x.seq) * bt_stride;
            for (int j = 0, blk = xlo / bs, in = xlo % bs; j < xn; ++j) {  // one division, not one a key
              k_next[j] = k_cache + static_cast<int64_t>(xtab[blk]) * blk_stride + in * tok_stride + x.h_begin * D;
              if (++in == bs) in = 0, ++blk;
            }
            if (xn > 0) {  // the rows past its keys repeat its last
              std::fill(k_next.begin() + xn, k_next.begin() + npad, k_next[xn - 1]);
              pf = k_next.data();
            }
          }
#ifdef PAGEDLLM_VNNI
          if constexpr (kVnni) {
            pv_rows_i16<kHeadDim>(&s[static_cast<size_t>(r0) * KC], KC, vp.data(), n, &acc[static_cast<size_t>(r0) * D],
                                  head_rows, pf);
            continue;
          }
#endif
          pv_rows<kHeadDim>(&s[static_cast<size_t>(r0) * KC], KC, vp.data(), n, &acc[static_cast<size_t>(r0) * D],
                            head_rows, D, pf);
        }
      }
      if (w.part >= 0) {
        keep_part(parts, w.part, m.data(), l.data(), acc.data());
        continue;
      }
      for (int r = 0; r < rows; ++r) {
        const int h = w.h_begin + r / head_rows, i = w.q_begin + (r % head_rows) / G, g = r % G;
        const int64_t tok = query_start_loc[w.seq] + i;
        store_row(&acc[static_cast<size_t>(r) * D], out + (tok * num_heads + h * G + g) * D, D,
                  inv_denominator(m[r], l[r], sinks, h * G + g));
      }
    }
  }
  merge_parts(parts, query_start_loc, num_heads, sinks, out);
}
#endif  // PAGEDLLM_VEC

// The cache rows a step writes are cold (a decode step's one row per sequence, scattered): plain
// stores wait on each line's read-for-ownership, a few rows at a time. Prefetching the lines
// `kWriteAhead` tokens ahead with write intent keeps many in flight, and from 4,096 elements both
// threads write: SmolLM2's 48 decode tokens over 30 layers took 5.0 ms a step, now 1.1-1.4 (as
// non-temporal stores did).
constexpr int64_t kWriteAhead = 4;
inline void prefetch_for_write(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(c + b, 1, 3);
}

// Quantize this step's K and V rows into an int8 cache (symmetric per (token, KV head) row:
// scale = max|x| / 127, value = round-half-even(x * (127 / max|x|)); an all-zero row stores 0s
// and scale 0). The same float32 operations as the torch reference (layers/attention/kv_quant.py),
// so both write identical bytes. k/v: [N, Hkv, D] with token strides k_stride/v_stride (elements)
// and contiguous heads; slot_mapping [N] int64; the caches [num_blocks, block_rows, Hkv, D].
template <typename T>
void kv_write_int8(const T* k, int64_t k_stride, const T* v, int64_t v_stride, const int64_t* slot_mapping,
                   int64_t n, int num_kv_heads, int d, int block_size, int8_t* k_cache, int8_t* v_cache) {
  const int64_t tok_stride = static_cast<int64_t>(num_kv_heads) * d;
  const int64_t blk_stride = tok_stride * block_rows<int8_t>(block_size, d);
#pragma omp parallel for schedule(static) if (n * num_kv_heads * d >= 4096)
  for (int64_t t = 0; t < n; ++t) {
    if (t + kWriteAhead < n) {
      const Int8Slot a = int8_slot(slot_mapping[t + kWriteAhead], block_size, blk_stride);
      for (int8_t* cache : {k_cache, v_cache}) {
        prefetch_for_write(cache + a.block_off + a.in * tok_stride, tok_stride);
        prefetch_for_write(cache + scale_offset(a.block_off, block_size, a.in, num_kv_heads, 0, d), 4 * num_kv_heads);
      }
    }
    std::vector<float> x(d);
    const auto [blk_off, in] = int8_slot(slot_mapping[t], block_size, blk_stride);
    for (int kv = 0; kv < 2; ++kv) {
      const T* src = kv == 0 ? k + t * k_stride : v + t * v_stride;
      int8_t* cache = kv == 0 ? k_cache : v_cache;
      for (int h = 0; h < num_kv_heads; ++h, src += d) {
        int8_t* dst = cache + blk_off + in * tok_stride + h * d;
        load_row(src, x.data(), d);
        float amax = 0.0f;
        for (int i = 0; i < d; ++i) amax = std::max(amax, std::fabs(x[i]));
        const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        for (int i = 0; i < d; ++i)
          dst[i] = static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, std::nearbyint(x[i] * inv))));
        const float sc = amax / 127.0f;
        std::memcpy(cache + scale_offset(blk_off, block_size, in, num_kv_heads, h, d), &sc, sizeof(float));
      }
    }
  }
}

// Copy this step's K and V rows into a cache of their own dtype (what index_copy_ does, in one
// call for both): k/v [N, Hkv, D] with token strides k_stride/v_stride; caches [slots, Hkv, D].
template <typename T>
void kv_write(const T* k, int64_t k_stride, const T* v, int64_t v_stride, const int64_t* slot_mapping, int64_t n,
              int num_kv_heads, int d, T* k_cache, T* v_cache) {
  const int64_t row = static_cast<int64_t>(num_kv_heads) * d;
#pragma omp parallel for schedule(static) if (n * row >= 4096)
  for (int64_t t = 0; t < n; ++t) {
    if (t + kWriteAhead < n) {
      prefetch_for_write(k_cache + slot_mapping[t + kWriteAhead] * row, sizeof(T) * row);
      prefetch_for_write(v_cache + slot_mapping[t + kWriteAhead] * row, sizeof(T) * row);
    }
    std::memcpy(k_cache + slot_mapping[t] * row, k + t * k_stride, sizeof(T) * row);
    std::memcpy(v_cache + slot_mapping[t] * row, v + t * v_stride, sizeof(T) * row);
  }
}

// out[t] <- the int8 cache's rows at slot_mapping[t], dequantized (value * scale in float32, then
// rounded to T, as kv_quant.gather(...).to(dtype)); out [N, Hkv, D] contiguous.
template <typename T>
void kv_read_int8(const int8_t* cache, const int64_t* slot_mapping, int64_t n, int num_kv_heads, int d,
                  int block_size, T* out) {
  const int64_t tok_stride = static_cast<int64_t>(num_kv_heads) * d;
  const int64_t blk_stride = tok_stride * block_rows<int8_t>(block_size, d);
#pragma omp parallel for schedule(static) if (n * num_kv_heads >= 256)
  for (int64_t t = 0; t < n; ++t) {
    const auto [blk_off, in] = int8_slot(slot_mapping[t], block_size, blk_stride);
    std::vector<float> x(d);
    for (int h = 0; h < num_kv_heads; ++h) {
      dequant_row(cache + blk_off + in * tok_stride + h * d,
                  scale_at(cache, scale_offset(blk_off, block_size, in, num_kv_heads, h, d)), x.data(), d);
      store_row(x.data(), out + (t * num_kv_heads + h) * d, d, 1.0f);
    }
  }
}

}  // namespace

// Common head sizes get a specialisation; others run the same code with a runtime head_dim. 16 and
// 32 too (tiny test and draft models): at a runtime 16 P.V kept its accumulator in memory, one load
// and store a key, and a 16-wide decode took 1.8 us a sequence where the specialisation takes 1.2
// (bench overhead's nano model, batch 256; the same arithmetic in the same order, bit-identical).
#define PA_ARGS block_tables, bt_stride, seq_lens, query_start_loc, num_seqs, num_heads, num_kv_heads, head_dim, \
                block_size, scale, window, soft_cap, max_query_len, sinks
#ifdef PAGEDLLM_VEC
#define DISPATCH_VEC(T, C, ...)                                                        \
  if (head_dim % 16 == 0) switch (head_dim) {                                        \
      case 16: return paged_attention_vec<T, C, 16>(__VA_ARGS__, PA_ARGS);           \
      case 32: return paged_attention_vec<T, C, 32>(__VA_ARGS__, PA_ARGS);           \
      case 64: return paged_attention_vec<T, C, 64>(__VA_ARGS__, PA_ARGS);           \
      case 128: return paged_attention_vec<T, C, 128>(__VA_ARGS__, PA_ARGS);         \
      default: return paged_attention_vec<T, C, 0>(__VA_ARGS__, PA_ARGS);            \
    }
#else
#define DISPATCH_VEC(T, C, ...)
#endif
// Common head sizes get a specialisation; others run the same code with a runtime head_dim.
#define DISPATCH_HEAD_DIM(T, C, ...)                                        \
  DISPATCH_VEC(T, C, __VA_ARGS__)                                           \
  switch (head_dim) {                                                       \
    case 64: return paged_attention<T, C, 64>(__VA_ARGS__, PA_ARGS);        \
    case 128: return paged_attention<T, C, 128>(__VA_ARGS__, PA_ARGS);      \
    default: return paged_attention<T, C, 0>(__VA_ARGS__, PA_ARGS);         \
  }

extern "C" {

int pagedllm_kernel_abi_version() { return 4; }

int pagedllm_kernel_avx512() {
#ifdef PAGEDLLM_AVX512
  return 1;
#else
  return 0;
#endif
}

#define PA_PARAMS                                                                                              \
  const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens, const int32_t *query_start_loc,     \
      int num_seqs, int num_heads, int num_kv_heads, int head_dim, int block_size, float scale, int window,    \
      float soft_cap, int max_query_len, const float *sinks

void paged_attention_f32(const float* q, const float* k_cache, const float* v_cache, float* out, PA_PARAMS) {
  DISPATCH_HEAD_DIM(float, float, q, k_cache, v_cache, out);
}

void paged_attention_bf16(const uint16_t* q, const uint16_t* k_cache, const uint16_t* v_cache, uint16_t* out,
                          PA_PARAMS) {
  DISPATCH_HEAD_DIM(uint16_t, uint16_t, q, k_cache, v_cache, out);
}

void paged_attention_f32_i8(const float* q, const int8_t* k_cache, const int8_t* v_cache, float* out, PA_PARAMS) {
  DISPATCH_HEAD_DIM(float, int8_t, q, k_cache, v_cache, out);
}

void paged_attention_bf16_i8(const uint16_t* q, const int8_t* k_cache, const int8_t* v_cache, uint16_t* out,
                             PA_PARAMS) {
  DISPATCH_HEAD_DIM(uint16_t, int8_t, q, k_cache, v_cache, out);
}

void kv_write_f32(const float* k, int64_t ks, const float* v, int64_t vs, const int64_t* slots, int64_t n,
                  int num_kv_heads, int d, float* k_cache, float* v_cache) {
  kv_write(k, ks, v, vs, slots, n, num_kv_heads, d, k_cache, v_cache);
}

void kv_write_bf16(const uint16_t* k, int64_t ks, const uint16_t* v, int64_t vs, const int64_t* slots, int64_t n,
                   int num_kv_heads, int d, uint16_t* k_cache, uint16_t* v_cache) {
  kv_write(k, ks, v, vs, slots, n, num_kv_heads, d, k_cache, v_cache);
}

void kv_write_int8_f32(const float* k, int64_t ks, const float* v, int64_t vs, const int64_t* slots, int64_t n,
                       int num_kv_heads, int d, int block_size, int8_t* k_cache, int8_t* v_cache) {
  kv_write_int8(k, ks, v, vs, slots, n, num_kv_heads, d, block_size, k_cache, v_cache);
}

void kv_write_int8_bf16(const uint16_t* k, int64_t ks, const uint16_t* v, int64_t vs, const int64_t* slots,
                        int64_t n, int num_kv_heads, int d, int block_size, int8_t* k_cache, int8_t* v_cache) {
  kv_write_int8(k, ks, v, vs, slots, n, num_kv_heads, d, block_size, k_cache, v_cache);
}

void kv_read_int8_f32(const int8_t* cache, const int64_t* slots, int64_t n, int num_kv_heads, int d, int block_size,
                      float* out) {
  kv_read_int8(cache, slots, n, num_kv_heads, d, block_size, out);
}

void kv_read_int8_bf16(const int8_t* cache, const int64_t* slots, int64_t n, int num_kv_heads, int d, int block_size,
                       uint16_t* out) {
  kv_read_int8(cache, slots, n, num_kv_heads, d, block_size, out);
}

}  // extern "C"
