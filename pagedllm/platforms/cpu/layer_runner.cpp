// The decoder layers of a Llama-family, Gemma or OLMo 2 / EXAONE 4 model, all of them in one call on the
// CPU: the same kernels, in the same order and on the same buffers' values as the Python layer loop
// (models/llama.py: LlamaDecoderLayer.forward_fused; models/gemma2.py: Gemma2DecoderLayer.forward;
// models/olmo2.py: Olmo2DecoderLayer.forward_fused),
// so the output is bit-identical; what goes is the Python between them (~0.7 ms a layer on a 2-core
// host: module calls, checks, a new tensor per op). It plays, for a CPU step, the part a CUDA graph
// plays on a GPU.
//
// The kernels live in their own libraries (platforms/cpu/fused_ops.cpp, platforms/cpu/float_gemm.cpp, platforms/cpu/int8_gemm.cpp,
// platforms/cpu/gguf_gemm.cpp: GGUF weights in their ggml blocks, attention/paged_attention_cpu.cpp,
// platforms/cpu/lora_ops.cpp: LoRA adapters after each target linear); Python hands their addresses in
// (RunnerKernels), so this file links against none of them. Elements are float32 or bfloat16 (raw uint16); `elem_size`
// bytes each. Plain C ABI (ctypes); the structs mirror platforms/cpu/layer_runner.py's ctypes.Structures.
#include <chrono>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_math.h"

extern "C" {

typedef void (*NormFn)(const void* x, int64_t x_stride, void* residual, const void* w, void* out, int64_t rows,
                       int hidden, float eps);
typedef void (*GemmFn)(const void* x, int64_t ldx, const void* w_packed, const void* bias, void* y, int64_t ldy,
                       int m, int n, int k);
// The W8A8 linear on a packed int8 weight (platforms/cpu/int8_gemm.cpp: int8_panel_linear_*): x [m, k] ->
// out [m, n] contiguous, x quantized per row inside; sw: the weight's float32 scales [n].
typedef void (*Int8LinearFn)(const void* x, int64_t ldx, int m, int k, const void* w_packed, const void* wsum,
                             const void* sw, const void* bias, int n, void* out);
// A linear over GGUF blocks (platforms/cpu/gguf_gemm.cpp: gguf_linear): x float32 [m, k] (row stride ldx)
// -> out float32 [m, sum of rows] (row stride ldo), the weight given as nseg segments of ggml blocks
// (types[i], rows[i] output rows from column firsts[i], at ptrs[i]); x quantized to int8 inside.
typedef int (*GgufLinearFn)(const float* x, int64_t ldx, int m, int64_t k, int nseg, const int32_t* types,
                            const int64_t* firsts, const int64_t* rows, const uint64_t* ptrs, float* out,
                            int64_t ldo);
typedef void (*RotaryFn)(void* x, int64_t tok_stride, int64_t head_stride, int64_t n, int heads, int d,
                         const void* cos_sin);
// In place: RMSNorm over d of each of the `heads` rows of each of n tokens (q/k norms).
typedef void (*HeadNormFn)(void* x, int64_t tok_stride, int64_t head_stride, int64_t n, int heads, int d,
                           const void* w, float eps);
// Gemma's norms around the residual stream (platforms/cpu/fused_ops.cpp: gemma_rms_norm).
typedef void (*GemmaNormFn)(const void* x, int64_t x_stride, const void* w_add, float eps_add, void* residual,
                            const void* w_out, float eps_out, void* out, int64_t rows, int hidden);
typedef void (*SiluMulFn)(const void* x, int64_t x_stride, void* out, int64_t rows, int inter);
typedef void (*KvWriteFn)(const void* k, int64_t k_stride, const void* v, int64_t v_stride, const int64_t* slots,
                          int64_t n, int num_kv_heads, int d, void* k_cache, void* v_cache);
// The int8 cache's write: quantizes each (token, KV head) row; block_size locates the scales.
typedef void (*KvWriteInt8Fn)(const void* k, int64_t k_stride, const void* v, int64_t v_stride, const int64_t* slots,
                              int64_t n, int num_kv_heads, int d, int block_size, void* k_cache, void* v_cache);
typedef void (*AttentionFn)(const void* q, const void* k_cache, const void* v_cache, void* out,
                            const int32_t* block_tables, int64_t bt_stride, const int32_t* seq_lens,
                            const int32_t* query_start_loc, int num_seqs, int num_heads, int num_kv_heads,
                            int head_dim, int block_size, float scale, int window, float soft_cap,
                            int max_query_len, const float* sinks);

// The batched LoRA op of one target linear (platforms/cpu/lora_ops.cpp: lora_add_*): y [m, out] (row
// stride ldy) += each grouped token's B_s A_s x.
typedef void (*LoRAFn)(const void* x, int64_t ldx, void* y, int64_t ldy, int64_t in, int64_t out, const void* a,
                       const void* b, const int32_t* ranks, int64_t max_rank, int n_slices, const int64_t* slice_bounds,
                       const int64_t* order, const int64_t* group_start, const int64_t* group_slot, int64_t num_groups,
                       float* h);

struct RunnerKernels {
  NormFn add_rms_norm;
  GemmFn gemm;
  RotaryFn rotary;
  HeadNormFn rms_norm_heads;  // the q/k norms (Qwen3's; Gemma 3's: gemma_rms_norm_heads)
  SiluMulFn silu_and_mul;     // Gemma: GELU-tanh(gate) * up
  KvWriteFn kv_write;          // a cache in the model's dtype, or
  KvWriteInt8Fn kv_write_int8;  // an int8 cache (then `attention` is the kernel's int8-cache variant)
  AttentionFn attention;
  GemmaNormFn gemma_rms_norm;  // Gemma only
  Int8LinearFn int8_linear;    // the int8 linears (--quantization int8)
  LoRAFn lora_add;             // LoRA adapters (--enable-lora; null: none)
  GgufLinearFn gguf_linear;    // the linears kept in GGUF blocks (null: none)
};

// The model's shapes (this rank's): q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
// rotary_dim: the channels of a head that rotate (head_dim, or fewer: partial rotary).
// soft_cap: attention's logit soft-cap (0: none; Gemma 2). residual_scale: what each attention and
// MLP output is multiplied by before its residual add (Granite's residual_multiplier; 1: none).
// qk_norm_whole: the q/k norms span the whole projection (OLMo 2's), not each head.
struct RunnerDims {
  int64_t elem_size, hidden, num_heads, num_kv_heads, head_dim, intermediate, block_size, rotary_dim;
  float scale, soft_cap, residual_scale;
  int64_t qk_norm_whole;
};

// A linear's weight in GGUF blocks: gguf_linear's segment arguments (gguf_gemm.py: _pack), nseg of each.
struct RunnerGguf {
  int64_t nseg;
  const int32_t* types;
  const int64_t *firsts, *rows;
  const uint64_t* ptrs;
};

// One linear: its weight packed for GemmFn, or (scale not null) int8 panels for Int8LinearFn with
// their row sums and float32 scales, or (gguf not null) GGUF blocks for GgufLinearFn; its bias (null:
// none).
struct RunnerLinear {
  const void *w, *b, *wsum, *scale;
  const RunnerGguf* gguf;
};

// One target linear's LoRA slot tables (pagedllm/lora/layers.py: LoRATarget): A [slots, S R, in], Bt
// [slots, R, out] in the model's dtype, the rank of each slot's adapter on this target (0: untouched).
// a null: the linear has no LoRA target.
struct RunnerLoRA {
  const void *a, *b;
  const int32_t* ranks;
};

// A step's tokens grouped by adapter slot (pagedllm/lora/ops.py: LoRAStep): order [T] (the rows of the
// flat batch that carry an adapter, in group order), group_start [G + 1], group_slot [G]; max_rank: R;
// h: float32 scratch [T, 3 R].
struct RunnerLoRAStep {
  const int64_t *order, *group_start, *group_slot;
  int64_t num_groups, max_rank;
  float* h;
};

// One layer's linears, norm weights (q_norm, k_norm [head_dim]: null, none; pre_ff_norm,
// post_ff_norm: Gemma's) and KV cache halves; window: its sliding window (0: none); rope: which of
// the step's RoPE tables it takes (0 or 1).
struct RunnerLayer {
  const void *in_norm, *post_norm, *q_norm, *k_norm, *pre_ff_norm, *post_ff_norm;
  RunnerLinear qkv, o, gate_up, down;
  void *k_cache, *v_cache;
  int64_t window, rope;
  float in_eps, post_eps, q_eps, k_eps, pre_ff_eps, post_ff_eps;
  const RunnerLoRA* lora;  // [4]: the LoRA tables of qkv, o, gate_up, down (null: no adapters served)
};

// One step: N tokens. x [N, hidden]: the first layer's input; residual [N, hidden]: the residual
// stream, updated in place (has_residual 0: the first layer's input is the stream itself, as
// forward_fused with residual None; then residual == x). x_out [N, hidden] <- the last layer's MLP
// output (also the o_proj output of each layer, free by then). The attention metadata as
// AttentionMetadata holds it; the scratch buffers are per-step, contiguous.
struct RunnerStep {
  int64_t num_tokens;
  const void* x;
  void* residual;
  void* x_out;
  int64_t has_residual;
  const void* cos_sin[2];  // [N, 2, 1, rotary_dim] each: the RoPE tables (Gemma 3: one per layer type)
  const int64_t* slot_mapping;
  const int32_t *block_tables, *seq_lens, *query_start_loc;
  int64_t bt_stride, num_seqs;
  void *h, *qkv, *q, *attn, *gate_up, *act;  // [N, hidden], [N, q + 2 kv], [N, q], [N, q], [N, 2 I], [N, I]
  // null, or the seconds of each phase of a layer (cpu_layer_runner.PHASES, or GEMMA_PHASES: in the
  // order of the calls below) added up over the layers: bench profile's breakdown of a runner step.
  double* timings;
  const RunnerLoRAStep* lora;  // null: no token of this step has an adapter
  // A whole Llama-kind step from token ids (run_decoder_layers only; null: x and cos_sin[0] are given):
  // x [N, hidden] <- rows input_ids [N] of embed [vocab, hidden], cos_sin[0] [N, 2 rotary_dim] <- rows
  // positions [N] of rope_cache [max_pos, 2 rotary_dim] (the model's embedding and RoPE gathers, as
  // copies), and after the layers final_out [N, hidden] <- the final norm of residual + x_out (the
  // model's norm, the same add_rms_norm). An id or position out of range: bad_input <- 1, nothing run.
  const int64_t *input_ids, *positions;
  const void *embed, *rope_cache, *final_norm;
  void* final_out;
  int64_t vocab, max_pos;
  float final_eps;
  int64_t bad_input;
  // null, or with final_norm: logits [N, lm_head_n] <- final_out @ the LM head's packed float weight
  // lm_head (no bias), the one GEMM call float_gemm.linear makes for the model's compute_logits.
  const void* lm_head;
  void* logits;
  int64_t lm_head_n;
};

namespace {

// Adds the time since the last mark to phase i of s->timings (nothing when that is null).
struct PhaseClock {
  double* tm;
  double t0;
  explicit PhaseClock(double* timings) : tm(timings), t0(timings != nullptr ? now() : 0.0) {}
  static double now() {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
  }
  void done(int i) {
    if (tm == nullptr) return;
    const double t = now();
    tm[i] += t - t0;
    t0 = t;
  }
};

// y [m, n] <- x [m, kdim] (row stride ldx; es-byte elements) @ the GGUF blocks of lin (+ bias), as
// GGUFLinearMethod.apply computes it (layers/quantization/gguf.py): gguf_linear on x in float32, the
// bias added in float32, then the sum rounded to the model's dtype (bf16: through float32 scratch).
void gguf_linear(const RunnerKernels* k, const RunnerLinear& lin, int64_t es, const void* x, int64_t ldx, void* y,
                 int64_t m, int64_t n, int64_t kdim) {
  const RunnerGguf& g = *lin.gguf;
  thread_local std::vector<float> xf, yf;  // bf16 only: x and y in float32
  const float* xin = static_cast<const float*>(x);
  float* out = static_cast<float*>(y);
  if (es != 4) {
    xf.resize(m * kdim);
    yf.resize(m * n);
    for (int64_t i = 0; i < m; ++i) {
      const uint16_t* xr = static_cast<const uint16_t*>(x) + i * ldx;
      for (int64_t j = 0; j < kdim; ++j) xf[i * kdim + j] = pagedllm_cpu::bf16_to_float(xr[j]);
    }
    xin = xf.data();
    ldx = kdim;
    out = yf.data();
  }
  k->gguf_linear(xin, ldx, static_cast<int>(m), kdim, static_cast<int>(g.nseg), g.types, g.firsts, g.rows, g.ptrs,
                 out, n);
  if (es == 4) {
    if (lin.b == nullptr) return;
    const float* b = static_cast<const float*>(lin.b);
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) out[i * n + j] += b[j];
    return;
  }
  const uint16_t* b = static_cast<const uint16_t*>(lin.b);
  uint16_t* yb = static_cast<uint16_t*>(y);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      const float v = out[i * n + j];
      yb[i * n + j] = pagedllm_cpu::float_to_bf16(b != nullptr ? v + pagedllm_cpu::bf16_to_float(b[j]) : v);
    }
}

// y [m, n] <- x [m, k] (row stride ldx) @ the linear's weight (+ bias): float, int8 or GGUF blocks.
inline void linear(const RunnerKernels* k, const RunnerDims* d, const RunnerLinear& lin, const void* x, int64_t ldx,
                   void* y, int64_t m, int64_t n, int64_t kdim) {
  if (lin.gguf != nullptr)
    gguf_linear(k, lin, d->elem_size, x, ldx, y, m, n, kdim);
  else if (lin.scale != nullptr)
    k->int8_linear(x, ldx, static_cast<int>(m), static_cast<int>(kdim), lin.w, lin.wsum, lin.scale, lin.b,
                   static_cast<int>(n), y);
  else
    k->gemm(x, ldx, lin.w, lin.b, y, n, static_cast<int>(m), static_cast<int>(n), static_cast<int>(kdim));
}

enum LoRATarget { LORA_QKV = 0, LORA_O = 1, LORA_GATE_UP = 2, LORA_DOWN = 3 };

// y [N, out] += the LoRA term of the step's adapter tokens for target `t` of layer w (x [N, in], row
// stride ldx; y's row stride out), as the Python path's forward hook adds it to the linear's output
// (pagedllm/lora/layers.py); the output slices: qkv's q, k, v, gate_up's halves, else one.
void lora_target(const RunnerKernels* k, const RunnerDims* d, const RunnerLayer& w, const RunnerStep* s, int t,
                 const void* x, int64_t ldx, void* y, int64_t in, int64_t out) {
  const RunnerLoRAStep* ls = s->lora;
  if (ls == nullptr || w.lora == nullptr || w.lora[t].a == nullptr) return;
  const int64_t q = d->num_heads * d->head_dim, kv = d->num_kv_heads * d->head_dim, inter = d->intermediate;
  const int64_t qkv_bounds[4] = {0, q, q + kv, q + 2 * kv}, gate_up_bounds[3] = {0, inter, 2 * inter},
                one[2] = {0, out};
  const int64_t* bounds = t == LORA_QKV ? qkv_bounds : t == LORA_GATE_UP ? gate_up_bounds : one;
  const int n_slices = t == LORA_QKV ? 3 : t == LORA_GATE_UP ? 2 : 1;
  k->lora_add(x, ldx, y, out, in, out, w.lora[t].a, w.lora[t].b, w.lora[t].ranks, ls->max_rank, n_slices, bounds,
              ls->order, ls->group_start, ls->group_slot, ls->num_groups, ls->h);
}

// self_attn on `in` [N, hidden] -> s->x_out: qkv_proj, the q/k norms (Qwen3, Gemma 3, OLMo 2) and
// RoPE on q and k in place, K/V into the cache, attention, o_proj. Phases 1-5.
void attention_block(const RunnerKernels* k, const RunnerDims* d, const RunnerLayer& w, const RunnerStep* s,
                     PhaseClock& clock, const void* in) {
  const int64_t n = s->num_tokens, es = d->elem_size, hidden = d->hidden, hd = d->head_dim;
  const int64_t q_size = d->num_heads * hd, kv_size = d->num_kv_heads * hd, qkv_cols = q_size + 2 * kv_size;
  char* const qkv = static_cast<char*>(s->qkv);
  char* const k_new = qkv + q_size * es;
  char* const v_new = qkv + (q_size + kv_size) * es;
  linear(k, d, w.qkv, in, hidden, qkv, n, qkv_cols, hidden);
  lora_target(k, d, w, s, LORA_QKV, in, hidden, qkv, hidden, qkv_cols);
  clock.done(1);
  if (w.q_norm != nullptr && d->qk_norm_whole) {  // one row of q_size (kv_size) a token
    k->rms_norm_heads(qkv, qkv_cols, q_size, n, 1, q_size, w.q_norm, w.q_eps);
    k->rms_norm_heads(k_new, qkv_cols, kv_size, n, 1, kv_size, w.k_norm, w.k_eps);
  } else if (w.q_norm != nullptr) {
    k->rms_norm_heads(qkv, qkv_cols, hd, n, d->num_heads, hd, w.q_norm, w.q_eps);
    k->rms_norm_heads(k_new, qkv_cols, hd, n, d->num_kv_heads, hd, w.k_norm, w.k_eps);
  }
  const void* cos_sin = s->cos_sin[w.rope];
  k->rotary(qkv, qkv_cols, hd, n, d->num_heads, d->rotary_dim, cos_sin);  // the first rotary_dim of each head
  k->rotary(k_new, qkv_cols, hd, n, d->num_kv_heads, d->rotary_dim, cos_sin);
  clock.done(2);
  if (k->kv_write_int8 != nullptr)
    k->kv_write_int8(k_new, qkv_cols, v_new, qkv_cols, s->slot_mapping, n, d->num_kv_heads, hd, d->block_size,
                     w.k_cache, w.v_cache);
  else
    k->kv_write(k_new, qkv_cols, v_new, qkv_cols, s->slot_mapping, n, d->num_kv_heads, hd, w.k_cache, w.v_cache);
  clock.done(3);
  for (int64_t t = 0; t < n; ++t)  // q contiguous, as the kernel reads it
    std::memcpy(static_cast<char*>(s->q) + t * q_size * es, qkv + t * qkv_cols * es, q_size * es);
  k->attention(s->q, w.k_cache, w.v_cache, s->attn, s->block_tables, s->bt_stride, s->seq_lens,
               s->query_start_loc, static_cast<int>(s->num_seqs), d->num_heads, d->num_kv_heads, hd,
               d->block_size, d->scale, static_cast<int>(w.window), d->soft_cap, 0, nullptr);
  clock.done(4);
  linear(k, d, w.o, s->attn, q_size, s->x_out, n, hidden, q_size);
  lora_target(k, d, w, s, LORA_O, s->attn, q_size, s->x_out, q_size, hidden);
  clock.done(5);
}

// The MLP on `in` -> s->x_out: gate_up_proj, act(gate) * up, down_proj. Phases 7-9.
void mlp_block(const RunnerKernels* k, const RunnerDims* d, const RunnerLayer& w, const RunnerStep* s,
               PhaseClock& clock, const void* in) {
  const int64_t n = s->num_tokens, hidden = d->hidden, inter = d->intermediate;
  linear(k, d, w.gate_up, in, hidden, s->gate_up, n, 2 * inter, hidden);
  lora_target(k, d, w, s, LORA_GATE_UP, in, hidden, s->gate_up, hidden, 2 * inter);
  clock.done(7);
  k->silu_and_mul(s->gate_up, 2 * inter, s->act, n, inter);
  clock.done(8);
  linear(k, d, w.down, s->act, inter, s->x_out, n, hidden, inter);
  lora_target(k, d, w, s, LORA_DOWN, s->act, inter, s->x_out, inter, hidden);
  clock.done(9);
}

// x [n, d->hidden] *= d->residual_scale in place, rounded to the element type as torch's mul_ by a
// Python float rounds (float32 product, then bf16 round-to-nearest-even); nothing when it is 1.
void scale_rows(const RunnerDims* d, void* x, int64_t n) {
  const float m = d->residual_scale;
  if (m == 1.0f) return;
  const int64_t count = n * d->hidden;
  if (d->elem_size == 4) {
    float* f = static_cast<float*>(x);
    for (int64_t i = 0; i < count; ++i) f[i] *= m;
    return;
  }
  uint16_t* b = static_cast<uint16_t*>(x);
  for (int64_t i = 0; i < count; ++i) b[i] = pagedllm_cpu::float_to_bf16(pagedllm_cpu::bf16_to_float(b[i]) * m);
}

// r [n, d->hidden] += x, rounded as torch's add_ rounds (float32 sum, then bf16).
void add_rows(const RunnerDims* d, void* r, const void* x, int64_t n) {
  const int64_t count = n * d->hidden;
  if (d->elem_size == 4) {
    float* rf = static_cast<float*>(r);
    const float* xf = static_cast<const float*>(x);
    for (int64_t i = 0; i < count; ++i) rf[i] += xf[i];
    return;
  }
  uint16_t* rb = static_cast<uint16_t*>(r);
  const uint16_t* xb = static_cast<const uint16_t*>(x);
  for (int64_t i = 0; i < count; ++i)
    rb[i] = pagedllm_cpu::float_to_bf16(pagedllm_cpu::bf16_to_float(rb[i]) + pagedllm_cpu::bf16_to_float(xb[i]));
}

// A whole step's inputs from its tokens (RunnerStep::input_ids): the embedding rows into x, the RoPE
// rows into cos_sin[0]; false (s->bad_input set, nothing written) when an id or position is out of
// range, where the model's own gathers raise.
bool gather_inputs(const RunnerDims* d, RunnerStep* s) {
  const int64_t n = s->num_tokens, es = d->elem_size;
  for (int64_t i = 0; i < n; ++i)
    if (s->input_ids[i] < 0 || s->input_ids[i] >= s->vocab || s->positions[i] < 0 || s->positions[i] >= s->max_pos) {
      s->bad_input = 1;
      return false;
    }
  const int64_t xrow = d->hidden * es, crow = 2 * d->rotary_dim * es;
  char* const x = static_cast<char*>(const_cast<void*>(s->x));
  char* const cs = static_cast<char*>(const_cast<void*>(s->cos_sin[0]));
  for (int64_t i = 0; i < n; ++i) {
    std::memcpy(x + i * xrow, static_cast<const char*>(s->embed) + s->input_ids[i] * xrow, xrow);
    std::memcpy(cs + i * crow, static_cast<const char*>(s->rope_cache) + s->positions[i] * crow, crow);
  }
  return true;
}

}  // namespace

// Llama, Mistral, Qwen2, Qwen3, SmolLM3, Granite (models/llama.py: LlamaDecoderLayer.forward_fused;
// models/granite.py: GraniteDecoderLayer.forward_fused, its residual_scale).
void run_decoder_layers(const RunnerKernels* k, const RunnerDims* d, const RunnerLayer* layers, int num_layers,
                        RunnerStep* s) {
  const int64_t n = s->num_tokens, hidden = d->hidden;
  const void* x = s->x;
  if (s->input_ids != nullptr && !gather_inputs(d, s)) return;
  PhaseClock clock(s->timings);
  for (int l = 0; l < num_layers; ++l) {
    const RunnerLayer& w = layers[l];
    // input_layernorm: with the residual add, except for a first layer without a residual stream
    const bool add = l > 0 || s->has_residual;
    k->add_rms_norm(x, hidden, add ? s->residual : nullptr, w.in_norm, s->h, n, hidden, w.in_eps);
    clock.done(0);
    attention_block(k, d, w, s, clock, s->h);
    scale_rows(d, s->x_out, n);
    // post_attention_layernorm (residual += o), then the MLP: down(silu(gate) * up)
    k->add_rms_norm(s->x_out, hidden, s->residual, w.post_norm, s->h, n, hidden, w.post_eps);
    clock.done(6);
    mlp_block(k, d, w, s, clock, s->h);
    scale_rows(d, s->x_out, n);
    x = s->x_out;
  }
  if (s->final_norm != nullptr)  // the model's final norm (residual += x_out first)
    k->add_rms_norm(s->x_out, hidden, s->residual, s->final_norm, s->final_out, n, hidden, s->final_eps);
  if (s->logits != nullptr)
    k->gemm(s->final_out, hidden, s->lm_head, nullptr, s->logits, s->lm_head_n, static_cast<int>(n),
            static_cast<int>(s->lm_head_n), static_cast<int>(hidden));
}

// Gemma 2 and 3 (models/gemma2.py: Gemma2DecoderLayer.forward): the residual stream is s->residual
// (== x, the scaled embeddings), updated in place; each post-norm's add fused with the next norm.
// Gemma 1 (models/gemma.py): no post_norm / post_ff_norm (null: a plain add), its pre-MLP norm in
// pre_ff_norm.
void run_gemma_layers(const RunnerKernels* k, const RunnerDims* d, const RunnerLayer* layers, int num_layers,
                      const RunnerStep* s) {
  const int64_t n = s->num_tokens, hidden = d->hidden;
  void* const res = s->residual;
  PhaseClock clock(s->timings);
  for (int l = 0; l < num_layers; ++l) {
    const RunnerLayer& w = layers[l];
    k->gemma_rms_norm(res, hidden, nullptr, 0.0f, nullptr, w.in_norm, w.in_eps, s->h, n, hidden);
    clock.done(0);
    attention_block(k, d, w, s, clock, s->h);
    // residual += post_attention_layernorm(o); h = pre_feedforward_layernorm(residual)
    k->gemma_rms_norm(s->x_out, hidden, w.post_norm, w.post_eps, res, w.pre_ff_norm, w.pre_ff_eps, s->h, n, hidden);
    clock.done(6);
    mlp_block(k, d, w, s, clock, s->h);
    // residual += post_feedforward_layernorm(down)
    k->gemma_rms_norm(s->x_out, hidden, w.post_ff_norm, w.post_ff_eps, res, nullptr, 0.0f, nullptr, n, hidden);
    clock.done(10);
  }
}

// OLMo 2 and EXAONE 4 (models/olmo2.py: Olmo2DecoderLayer.forward_fused): no norm before attention
// or the MLP, which read the stream s->residual (== x) itself; each branch's output normed
// (post_norm, post_ff_norm) and added to the stream, but the last layer's normed MLP output, which
// goes to x_out for the caller's final norm to add (as the loop returns it). With has_residual, x is
// the previous stage's branch output, added first. Phases 1-5, 6, 7-9, 10 (no 0).
void run_post_norm_layers(const RunnerKernels* k, const RunnerDims* d, const RunnerLayer* layers, int num_layers,
                          const RunnerStep* s) {
  const int64_t n = s->num_tokens, hidden = d->hidden, es = d->elem_size;
  void* const res = s->residual;
  PhaseClock clock(s->timings);
  if (s->has_residual) add_rows(d, res, s->x, n);
  for (int l = 0; l < num_layers; ++l) {
    const RunnerLayer& w = layers[l];
    attention_block(k, d, w, s, clock, res);
    k->add_rms_norm(s->x_out, hidden, nullptr, w.post_norm, s->h, n, hidden, w.post_eps);
    add_rows(d, res, s->h, n);
    clock.done(6);
    mlp_block(k, d, w, s, clock, res);
    k->add_rms_norm(s->x_out, hidden, nullptr, w.post_ff_norm, s->h, n, hidden, w.post_ff_eps);
    if (l + 1 < num_layers)
      add_rows(d, res, s->h, n);
    else
      std::memcpy(s->x_out, s->h, n * hidden * es);
    clock.done(10);
  }
}

}  // extern "C"
