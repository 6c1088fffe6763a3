// The module of the compiled CPU kernels (kernels/native.py builds it from these sources).
#include <torch/extension.h>

#include "matmul.h"
#include "gemm/small.h"

// torch's BLAS sgemm, declared weak: a torch built without one leaves it null.
extern "C" void SGEMM(const char*, const char*, const int*, const int*, const int*, const float*, const float*,
                      const int*, const float*, const int*, const float*, float*, const int*) __attribute__((weak));

static bool use_fast = true;

void mm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda, const float* B,
        int64_t ldb, float beta, float* C, int64_t ldc) {
  if (use_fast && small_mm_fits(M, N, K)) {
    small_mm(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
    return;
  }
  if (SGEMM && use_fast) {  // column-major C^T = op(B)^T op(A)^T
    const int m = N, n = M, k = K, la = ldb, lb = lda, lc = ldc;
    SGEMM(tb ? "T" : "N", ta ? "T" : "N", &m, &n, &k, &alpha, B, &la, A, &lb, &beta, C, &lc);
    return;
  }
  for (int64_t i = 0; i < M; ++i) {
    float* Ci = C + i * ldc;
    for (int64_t j = 0; j < N; ++j) Ci[j] = beta == 0.f ? 0.f : beta * Ci[j];
    for (int64_t r = 0; r < K; ++r) {
      const float a = alpha * (ta ? A[r * lda + i] : A[i * lda + r]);
      if (tb)
        for (int64_t j = 0; j < N; ++j) Ci[j] += a * B[j * ldb + r];
      else
#pragma omp simd
        for (int64_t j = 0; j < N; ++j) Ci[j] += a * B[r * ldb + j];
    }
  }
}

// Whether mm goes to small_mm and torch's BLAS (when it has one) or plain loops; returns the old setting.
static bool matmul_fast(bool on) {
  const bool old = use_fast;
  use_fast = on;
  return old;
}

// The kernels' mm on tensors: c [M, N] = alpha op(a) op(b) + beta c in place, fp32, rows unit-strided
// (a [K, M] when ta, b [N, K] when tb), so the tests can hold it to torch.
static void matmul(bool ta, bool tb, double alpha, const at::Tensor& a, const at::Tensor& b, double beta, at::Tensor& c) {
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&a, &b, &c})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 2 && t->stride(1) == 1, "matmul: fp32 matrices, unit-strided rows");
  const int64_t M = c.size(0), N = c.size(1), K = ta ? a.size(0) : a.size(1);
  TORCH_CHECK((ta ? a.size(1) : a.size(0)) == M && (tb ? b.size(0) : b.size(1)) == N && (tb ? b.size(1) : b.size(0)) == K,
              "matmul: shapes");
  mm(ta, tb, M, N, K, static_cast<float>(alpha), a.data_ptr<float>(), a.stride(0), b.data_ptr<float>(), b.stride(0),
     static_cast<float>(beta), c.data_ptr<float>(), c.stride(0));
}

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& pages, const at::Tensor& lens, double scale, int64_t dv);
at::Tensor paged_prefill(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                         const at::Tensor& pages, const at::Tensor& cu_seqlens, const at::Tensor& seq_lens,
                         double scale, int64_t dv);
bool paged_prefill_packed(int64_t dk, int64_t dv);
at::Tensor delta_step(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                      const at::Tensor& beta, at::Tensor& state, const at::Tensor& slots, double scale);
std::tuple<at::Tensor, at::Tensor> chunk_delta_rule_slots(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                          const at::Tensor& g, const at::Tensor& beta, at::Tensor& state,
                                                          const at::Tensor& cu_seqlens, const at::Tensor& checkpoints,
                                                          double scale, double min_log_decay, const at::Tensor& slots,
                                                          const at::Tensor& fresh, const at::Tensor& checkpoint_slots,
                                                          const at::Tensor& out);

// chunk_delta_rule_slots with state [N, HV, K, V]: sequence n's state in row n, the checkpoints'
// states returned. The engine calls the slots form; this one keeps the signature modules built
// before it have, so benchmarks/kernel_ab.py's chunk cases run on modules of either age.
static std::tuple<at::Tensor, at::Tensor> chunk_delta_rule(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                           const at::Tensor& g, const at::Tensor& beta, at::Tensor& state,
                                                           const at::Tensor& cu_seqlens, const at::Tensor& checkpoints,
                                                           double scale, double min_log_decay) {
  const auto none = at::empty({0}, at::kLong);
  return chunk_delta_rule_slots(q, k, v, g, beta, state, cu_seqlens, checkpoints, scale, min_log_decay, none, none,
                                none, none);
}
std::tuple<at::Tensor, at::Tensor> chunk_ssd_slots(const at::Tensor& x, const at::Tensor& dt, const at::Tensor& A,
                                                   const at::Tensor& B, const at::Tensor& C, const at::Tensor& D,
                                                   at::Tensor& state, const at::Tensor& cu_seqlens,
                                                   const at::Tensor& checkpoints, int64_t chunk_size,
                                                   const at::Tensor& slots, const at::Tensor& fresh,
                                                   const at::Tensor& checkpoint_slots, const at::Tensor& out,
                                                   const at::Tensor& gate_z, const at::Tensor& norm_w,
                                                   int64_t norm_groups, double norm_eps);

// chunk_ssd_slots with state [N, H, P, S]: sequence n's state in row n, the checkpoints' states
// returned (kept for kernel_ab.py's cases, as chunk_delta_rule).
static std::tuple<at::Tensor, at::Tensor> chunk_ssd(const at::Tensor& x, const at::Tensor& dt, const at::Tensor& A,
                                                    const at::Tensor& B, const at::Tensor& C, const at::Tensor& D,
                                                    at::Tensor& state, const at::Tensor& cu_seqlens,
                                                    const at::Tensor& checkpoints, int64_t chunk_size) {
  const auto none = at::empty({0}, at::kLong);
  const auto nothing = at::empty({0}, at::kFloat);
  return chunk_ssd_slots(x, dt, A, B, C, D, state, cu_seqlens, checkpoints, chunk_size, none, none, none, none,
                         nothing, nothing, 1, 0.0);
}
std::tuple<at::Tensor, at::Tensor> causal_conv1d(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                                                 const at::Tensor& state, const at::Tensor& cu_seqlens,
                                                 const at::Tensor& at_rows, bool silu);
at::Tensor causal_conv1d_slots(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                               at::Tensor& state, const at::Tensor& slots, const at::Tensor& fresh,
                               const at::Tensor& cu_seqlens, const at::Tensor& at_rows,
                               const at::Tensor& checkpoint_slots, bool silu, const at::Tensor& out);
std::tuple<at::Tensor, at::Tensor> moe_dispatch(const at::Tensor& x, const at::Tensor& idx, const at::Tensor& counts,
                                                int64_t cap);
at::Tensor moe_combine(const at::Tensor& y, const at::Tensor& at_rows, const at::Tensor& weight);
at::Tensor ssd_step(const at::Tensor& x, const at::Tensor& dt, const at::Tensor& A, const at::Tensor& B,
                    const at::Tensor& C, const at::Tensor& D, at::Tensor& state, const at::Tensor& slots);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, double offset, bool cast_first,
                    const at::Tensor& gate, const std::string& act, at::ScalarType out_dtype);
at::Tensor sigmoid_gate(const at::Tensor& o, const at::Tensor& gate);
at::Tensor relu2(const at::Tensor& x);
at::Tensor conv_step(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, at::Tensor& state,
                     const at::Tensor& slots, bool silu);
std::vector<at::Tensor> delta_prepare(const at::Tensor& x, int64_t H, int64_t K, int64_t HV, int64_t V,
                                      const at::Tensor& a, const at::Tensor& A_log, const at::Tensor& dt_bias,
                                      const at::Tensor& b, double eps);
at::Tensor gated_group_norm(const at::Tensor& x, const at::Tensor& z, const at::Tensor& weight, int64_t groups,
                            double eps);
at::Tensor rms_norm_rope(const at::Tensor& x, const at::Tensor& weight, double eps, double offset,
                         const at::Tensor& cos, const at::Tensor& sin);
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps, double offset, bool cast_first);
std::tuple<at::Tensor, at::Tensor> topk_softmax(const at::Tensor& logits, int64_t k, bool renorm);
std::tuple<at::Tensor, at::Tensor> topk_scores(const at::Tensor& scores, const at::Tensor& bias, int64_t k,
                                                bool renorm, double scaling);
at::Tensor router_logits(const at::Tensor& x, const at::Tensor& w);
bool gemm_bf16_supported();
bool gemm_bf16_onednn();
at::Tensor pack_bf16(const at::Tensor& w);
at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& packed, int64_t N, const at::Tensor& bias);
bool gemm_f32_supported();
at::Tensor pack_f32(const at::Tensor& w);
at::Tensor linear_f32(const at::Tensor& x, const at::Tensor& packed, int64_t N, const at::Tensor& bias);
at::Tensor pack_heads_bf16(const at::Tensor& w);
void heads_bf16(const at::Tensor& x, const at::Tensor& packed, int64_t N, at::Tensor& out);
std::tuple<at::Tensor, at::Tensor> pack_experts_bf16(const at::Tensor& gate_up, const at::Tensor& down);
std::tuple<at::Tensor, at::Tensor> pack_experts_f32(const at::Tensor& gate_up, const at::Tensor& down);
at::Tensor moe_bf16(const at::Tensor& x, const at::Tensor& idx, const at::Tensor& weight, const at::Tensor& gate_up,
                    const at::Tensor& down, const std::string& act, const at::Tensor& shared_gu,
                    const at::Tensor& shared_dn, const at::Tensor& scale);
at::Tensor moe_f32(const at::Tensor& x, const at::Tensor& idx, const at::Tensor& weight, const at::Tensor& gate_up,
                   const at::Tensor& down, const std::string& act, const at::Tensor& shared_gu,
                   const at::Tensor& shared_dn, const at::Tensor& scale);

// A decode step's layer bodies in one call each: the kernels a layer runs on its decode rows, in the
// order and with the arguments its Python path gives them (the same bits), without the Python
// between them (a few tens of microseconds a kernel: ~0.2 ms a layer in a 64-row decode step).

// A KDA / GDN layer's decode rows: the short conv over the qkv rows (conv states in their slots,
// silu), the delta-rule inputs, the delta-rule step (recurrent states in their slots), then the
// gated output norm (act "silu" or "sigmoid") into out_dtype: [T, HV, V].
static at::Tensor delta_decode(const at::Tensor& qkv, const at::Tensor& conv_w, at::Tensor& conv_state,
                               at::Tensor& state, const at::Tensor& slots, int64_t H, int64_t K, int64_t HV,
                               int64_t V, const at::Tensor& a, const at::Tensor& A_log, const at::Tensor& dt_bias,
                               const at::Tensor& b, double eps, double scale, const at::Tensor& gate,
                               const at::Tensor& norm_w, double norm_eps, const std::string& act,
                               at::ScalarType out_dtype) {
  const auto y = conv_step(qkv, conv_w, at::empty({0}, conv_w.options()), conv_state, slots, true);
  const auto in = delta_prepare(y, H, K, HV, V, a, A_log, dt_bias, b, eps);  // q, k, v, g, beta
  const auto o = delta_step(in[0], in[1], in[2], in[3], in[4], state, slots, scale);
  return rms_norm(o, norm_w, norm_eps, 0.0, false, gate, act, out_dtype);
}

// A GQA layer's decode rows: with q and k norm weights (models/qwen3_next.py GatedAttention) the
// q and k norms with RoPE, then the new k and v written into their cache slots, attention over the
// pages, and with a gate (not empty) the output times sigmoid(gate): [T, H * D] in q's dtype.
static at::Tensor attention_decode(const at::Tensor& q, const at::Tensor& gate, const at::Tensor& k,
                                   const at::Tensor& v, const at::Tensor& q_norm_w, const at::Tensor& k_norm_w,
                                   double eps, double offset, const at::Tensor& cos, const at::Tensor& sin,
                                   at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& kv_slots,
                                   const at::Tensor& page_table, const at::Tensor& seq_lens, double scale) {
  const bool norms = q_norm_w.numel() > 0;
  const auto qn = norms ? rms_norm_rope(q, q_norm_w, eps, offset, cos, sin) : q;
  const auto kn = norms ? rms_norm_rope(k, k_norm_w, eps, offset, cos, sin) : k;
  for (auto [cache, rows] : {std::pair{k_cache, kn}, std::pair{v_cache, v}})
    cache.view({-1, cache.size(2), cache.size(3)}).index_copy_(0, kv_slots, rows.to(cache.scalar_type()));
  const auto o = paged_decode(qn, k_cache, v_cache, page_table, seq_lens, scale, v_cache.size(3)).to(q.scalar_type());
  const int64_t T = q.size(0);
  return gate.numel() ? sigmoid_gate(o.reshape({T, -1}), gate.reshape({T, -1})) : o.reshape({T, -1});
}

// A Mamba2 layer's decode rows (models/nemotron_h.py Mamba2Mixer): the short conv over the xBC rows
// (conv states in their slots), dt = max(softplus(dt + dt_bias), dt_min), A = -exp(A_log), the SSD
// step (states in their slots), then the silu(z)-gated grouped norm: [T, H * P] in z's dtype.
static at::Tensor mamba_decode(const at::Tensor& xbc, const at::Tensor& conv_w, const at::Tensor& conv_b,
                               at::Tensor& conv_state, bool silu, const at::Tensor& dt, const at::Tensor& dt_bias,
                               double dt_min, const at::Tensor& A_log, const at::Tensor& D, at::Tensor& state,
                               const at::Tensor& slots, int64_t H, int64_t P, int64_t G, int64_t S, const at::Tensor& z,
                               const at::Tensor& norm_w, int64_t groups, double norm_eps) {
  const int64_t T = xbc.size(0);
  const auto y = conv_step(xbc, conv_w, conv_b, conv_state, slots, silu);
  const auto parts = y.split_with_sizes({H * P, G * S, G * S}, -1);
  const auto f32 = [](const at::Tensor& t) { return t.to(at::kFloat).contiguous(); };
  const auto xs = f32(parts[0].reshape({T, H, P})), B = f32(parts[1].reshape({T, G, S}));
  const auto C = f32(parts[2].reshape({T, G, S}));
  const auto step = at::clamp(at::softplus(dt.to(at::kFloat) + dt_bias, 1, 20), dt_min, std::nullopt);
  const auto A = -A_log.exp();
  const auto o = ssd_step(xs, step, A, B, C, D, state, slots);  // [T, H, P] fp32
  return gated_group_norm(o.reshape({T, -1}), z, norm_w, groups, norm_eps);
}

// Kimi Linear's MLA layer on its decode rows, absorbed (models/kimi_linear.py MLAttention): the
// latent [norm(c) | k_rope] written into its cache slot, the queries' nope part into the latent
// space through w_uk (packed by pack_heads_bf16), attention over the latent pages (values: their
// first r channels), then each head's value up-projection through w_uv: [T, H * v] in q's dtype.
static at::Tensor mla_decode(const at::Tensor& q, const at::Tensor& c, const at::Tensor& k_rope,
                             const at::Tensor& norm_w, double norm_eps, at::Tensor& cache, const at::Tensor& kv_slots,
                             const at::Tensor& page_table, const at::Tensor& seq_lens, double scale,
                             const at::Tensor& w_uk, int64_t r, const at::Tensor& w_uv, int64_t vd) {
  const int64_t T = q.size(0), H = q.size(1), rope = k_rope.size(1), nope = q.size(2) - rope;
  const auto c_n = rms_norm(c, norm_w, norm_eps, 0.0, true, at::empty({0}, norm_w.options()), "", c.scalar_type());
  const auto latent = at::cat({c_n, k_rope}, -1);  // [T, r + rope]
  cache.view({-1, cache.size(2), cache.size(3)}).index_copy_(0, kv_slots, latent.unsqueeze(1).to(cache.scalar_type()));
  auto q_att = at::empty({T, H, r + rope}, q.options());  // latent query | rope query
  auto q_lat = q_att.narrow(2, 0, r);
  heads_bf16(q.narrow(2, 0, nope), w_uk, r, q_lat);
  q_att.narrow(2, r, rope).copy_(q.narrow(2, nope, rope));
  const auto o = paged_decode(q_att, cache, cache, page_table, seq_lens, scale, r).to(q.scalar_type());  // [T, H, r]
  auto out = at::empty({T, H, vd}, o.options());
  heads_bf16(o, w_uv, vd, out);
  return out.reshape({T, -1});
}

// Qwen3-Next's sparse MoE layer (models/qwen3_next.py SparseMoE) in one call: the router and the
// shared expert's gate as one projection (`router`: packed by pack_bf16 / pack_f32, E + 1 outputs),
// softmax top-k of the E router logits, the shared gate's sigmoid, then the experts (moe_bf16 /
// moe_f32 with the shared one): the calls the Python path makes, with its arguments, so its bits.
static at::Tensor softmax_moe(const at::Tensor& x, const at::Tensor& router, int64_t E, int64_t k, bool renorm,
                              const at::Tensor& gate_up, const at::Tensor& down, const at::Tensor& shared_gu,
                              const at::Tensor& shared_dn) {
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const auto none = at::empty({0}, x.options().dtype(at::kFloat));
  const auto logits = (bf16 ? linear_bf16 : linear_f32)(x, router, E + 1, none);  // [T, E + 1]
  const auto [weight, idx] = topk_softmax(logits.narrow(1, 0, E), k, renorm);
  const auto scale = at::sigmoid(logits.narrow(1, E, 1));  // [T, 1], contiguous
  return (bf16 ? moe_bf16 : moe_f32)(x, idx, weight.to(x.scalar_type()), gate_up, down, "silu", shared_gu, shared_dn,
                                     scale);
}

// Kimi Linear's MoE layer with one expert group (models/kimi_linear.py KimiMoE) in one call: the
// router's fp32 logits (`router` fp32 [E, D]), their sigmoid, top-k by score + `bias`, then the
// experts with the unscaled shared expert (or none): the Python path's calls and arguments.
static at::Tensor scores_moe(const at::Tensor& x, const at::Tensor& router, const at::Tensor& bias, int64_t k,
                             bool renorm, double scaling, const at::Tensor& gate_up, const at::Tensor& down,
                             const at::Tensor& shared_gu, const at::Tensor& shared_dn) {
  const auto none = at::empty({0}, x.options().dtype(at::kFloat));  // no scale on the shared expert
  const auto [weight, idx] = topk_scores(router_logits(x, router).sigmoid(), bias, k, renorm, scaling);
  return (x.scalar_type() == at::kBFloat16 ? moe_bf16 : moe_f32)(x, idx, weight.to(x.scalar_type()), gate_up, down,
                                                                  "silu", shared_gu, shared_dn, none);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // the kernels touch no Python object: other threads (the server's event loop) run meanwhile
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("paged_decode", &paged_decode, nogil, "attention decode over paged KV (kernels/attention/cpu_decode.cpp)");
  m.def("paged_prefill", &paged_prefill, nogil, "causal attention of query blocks over paged KV (kernels/attention/cpu_prefill.cpp)");
  m.def("paged_prefill_packed", &paged_prefill_packed, "whether bf16 paged_prefill runs over packed key blocks here");
  m.def("delta_step", &delta_step, nogil, "KDA / GDN decode step, states in place (kernels/attention/cpu_decode.cpp)");
  m.def("chunk_delta_rule", &chunk_delta_rule, nogil, "KDA / GDN chunkwise prefill (kernels/kda/cpu_chunk.cpp)");
  m.def("chunk_delta_rule_slots", &chunk_delta_rule_slots, nogil, "the same, states read and written in rows of a pool");
  m.def("chunk_ssd", &chunk_ssd, nogil, "Mamba2 SSD chunkwise prefill (kernels/mamba2/cpu_ssd.cpp)");
  m.def("chunk_ssd_slots", &chunk_ssd_slots, nogil, "the same, states read and written in rows of a pool");
  m.def("causal_conv1d", &causal_conv1d, nogil, "causal depthwise conv1d prefill (kernels/conv1d/cpu_conv.cpp)");
  m.def("causal_conv1d_slots", &causal_conv1d_slots, nogil, "the same, states read and written in rows of a pool");
  m.def("ssd_step", &ssd_step, nogil, "Mamba2 SSD decode step, states in place (kernels/mamba2/cpu_ssd.cpp)");
  m.def("rms_norm", &rms_norm, nogil, "RMS norm, optionally gated, one pass per row (kernels/norm/cpu_norm.cpp)");
  m.def("sigmoid_gate", &sigmoid_gate, nogil, "o * sigmoid(gate), rounded as torch's ops (kernels/norm/cpu_norm.cpp)");
  m.def("relu2", &relu2, nogil, "relu(x)^2 in one pass, rounded as torch's ops (kernels/norm/cpu_norm.cpp)");
  m.def("conv_step", &conv_step, nogil, "causal conv1d decode step, states in place (kernels/conv1d/cpu_conv.cpp)");
  m.def("moe_dispatch", &moe_dispatch, nogil, "rows into their experts' padded blocks (kernels/moe/cpu_moe.cpp)");
  m.def("moe_combine", &moe_combine, nogil, "weighted sum of each token's expert outputs (kernels/moe/cpu_moe.cpp)");
  m.def("delta_prepare", &delta_prepare, nogil, "KDA / GDN q, k, v, g, beta from a layer's conv output (kernels/kda/cpu_prepare.cpp)");
  m.def("gated_group_norm", &gated_group_norm, nogil, "Mamba2's gate-first grouped RMS norm, one pass per row (kernels/norm/cpu_norm.cpp)");
  m.def("rms_norm_rope", &rms_norm_rope, nogil, "RMS norm with an offset weight, then RoPE, of q or k heads (kernels/norm/cpu_norm.cpp)");
  m.def("add_rms_norm", &add_rms_norm, nogil, "the residual add and the next RMS norm in one pass (kernels/norm/cpu_norm.cpp)");
  m.def("topk_softmax", &topk_softmax, nogil, "softmax routing: top-k probabilities and experts (kernels/moe/cpu_moe.cpp)");
  m.def("topk_scores", &topk_scores, nogil, "one-group routing: top-k experts by biased score (kernels/moe/cpu_moe.cpp)");
  m.def("router_logits", &router_logits, nogil, "fp32 router logits of a few experts (kernels/moe/cpu_moe.cpp)");
  m.def("gemm_bf16_supported", &gemm_bf16_supported, "whether this CPU runs the bf16 micro-kernels (kernels/gemm/cpu_gemm.cpp)");
  m.def("gemm_bf16_onednn", &gemm_bf16_onednn, "whether they are oneDNN's (torch's bits) rather than the AVX2 ones");
  m.def("pack_bf16", &pack_bf16, nogil, "a bf16 weight [N, K] packed for linear_bf16 (kernels/gemm/cpu_gemm.cpp)");
  m.def("linear_bf16", &linear_bf16, nogil, "x @ w^T (+ bias) in bf16 over a packed weight (kernels/gemm/cpu_gemm.cpp)");
  m.def("gemm_f32_supported", &gemm_f32_supported, "whether linear_f32 runs on this CPU");
  m.def("pack_f32", &pack_f32, nogil, "an fp32 weight [N, K] packed for linear_f32 (kernels/gemm/cpu_gemm.cpp)");
  m.def("linear_f32", &linear_f32, nogil, "x @ w^T (+ bias) in fp32 over a packed weight (kernels/gemm/cpu_gemm.cpp)");
  m.def("pack_heads_bf16", &pack_heads_bf16, nogil, "per-head bf16 weights [H, N, K] packed for heads_bf16 (kernels/gemm/cpu_gemm.cpp)");
  m.def("heads_bf16", &heads_bf16, nogil, "x[:, h] @ w[h]^T per head into a bf16 view (kernels/gemm/cpu_gemm.cpp)");
  m.def("pack_experts_bf16", &pack_experts_bf16, nogil, "stacked expert weights packed for moe_bf16 (kernels/gemm/cpu_gemm.cpp)");
  m.def("moe_bf16", &moe_bf16, nogil, "gated experts of each token, weighted and summed (kernels/gemm/cpu_gemm.cpp)");
  m.def("pack_experts_f32", &pack_experts_f32, nogil, "stacked fp32 expert weights packed for moe_f32 (kernels/gemm/cpu_gemm.cpp)");
  m.def("moe_f32", &moe_f32, nogil, "moe_bf16 in fp32 (kernels/gemm/cpu_gemm.cpp)");
  m.def("matmul_fast", &matmul_fast, "the kernels' matmuls through small_mm and torch's BLAS (true) or plain loops");
  m.def("delta_decode", &delta_decode, nogil, "a KDA / GDN layer's decode rows: conv, inputs, step, gated norm");
  m.def("attention_decode", &attention_decode, nogil, "a GQA layer's decode rows: norms and RoPE, KV write, attention, gate");
  m.def("mamba_decode", &mamba_decode, nogil, "a Mamba2 layer's decode rows: conv, dt, SSD step, gated grouped norm");
  m.def("mla_decode", &mla_decode, nogil, "an absorbed MLA layer's decode rows: latent write, absorbed attention");
  m.def("softmax_moe", &softmax_moe, nogil, "a sparse MoE layer: router and shared gate, softmax top-k, experts");
  m.def("scores_moe", &scores_moe, nogil, "a sparse MoE layer: router scores, biased top-k, experts");
  m.def("matmul", &matmul, "C = alpha op(A) op(B) + beta C in place through the kernels' mm (for the tests)");
}
