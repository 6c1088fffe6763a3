// Token routing of the padded mixture-of-experts path (models/layers/mlp.py run_experts), built
// and called by kernels/native.py: moe_dispatch copies each (token, choice) row into its
// expert's zero-padded block in one pass; moe_combine reads the expert outputs back and sums
// each token's choices, weighted, with the torch path's roundings (the product in the
// activation dtype, then the sum over the choices in order), so the results are the same bits.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "../widen.h"

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

// x [T, D] contiguous; idx [T, k] int64 expert of each choice; counts [E] int64 rows per expert;
// cap >= max(counts). Returns (padded [E, cap, D] in x's dtype: expert e's rows in (token,
// choice) order, then zeros; at [T * k] int64: the row of padded.view(E * cap, D) each
// (token, choice) went to).
std::tuple<at::Tensor, at::Tensor> moe_dispatch(const at::Tensor& x, const at::Tensor& idx, const at::Tensor& counts,
                                                int64_t cap) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "moe_dispatch: contiguous x [T, D]");
  TORCH_CHECK(idx.dim() == 2 && idx.size(0) == x.size(0), "moe_dispatch: idx [T, k]");
  const int64_t T = x.size(0), D = x.size(1), k = idx.size(1), E = counts.size(0);
  auto id = idx.to(at::kLong).contiguous();
  const int64_t* ip = id.data_ptr<int64_t>();
  std::vector<int64_t> next(E, 0);
  auto at_rows = at::empty({T * k}, id.options());
  int64_t* ap = at_rows.data_ptr<int64_t>();
  for (int64_t f = 0; f < T * k; ++f) {  // rank within the expert in (token, choice) order: a stable sort
    const int64_t e = ip[f];
    TORCH_CHECK(e >= 0 && e < E && next[e] < cap, "moe_dispatch: expert id out of range or counts too small");
    ap[f] = e * cap + next[e]++;
  }
  auto padded = at::zeros({E, cap, D}, x.options());
  const int64_t bytes = D * x.element_size();
  const char* xp = static_cast<const char*>(x.data_ptr());
  char* pp = static_cast<char*>(padded.data_ptr());
  at::parallel_for(0, T * k, 256, [&](int64_t begin, int64_t end) {
    for (int64_t f = begin; f < end; ++f) std::memcpy(pp + ap[f] * bytes, xp + (f / k) * bytes, bytes);
  });
  return {padded, at_rows};
}

namespace {

// rows [begin, end) of combine. No fused multiply-add: the product is rounded on its own, as in
// torch. The attribute holds for this function only: parallel_for's lambda is a function of its
// own, built with the file's flags (-ffast-math contracts), so the rows are summed here, not
// inside the lambda (where the sums differed with the number of threads), and never inlined.
template <typename T>
__attribute__((optimize("fp-contract=off"), noinline)) void combine_rows(const T* y, const int64_t* at, const T* w,
                                                                         int64_t k, int64_t D, T* out,
                                                                         int64_t begin, int64_t end) {
  std::vector<float> acc(D);
  for (int64_t t = begin; t < end; ++t) {
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int64_t c = 0; c < k; ++c) {
      const T* row = y + at[t * k + c] * D;
      const float wc = as_float(w[t * k + c]);
      for (int64_t d = 0; d < D; ++d) acc[d] += as_float(narrow<T>(as_float(row[d]) * wc));
    }
    for (int64_t d = 0; d < D; ++d) out[t * D + d] = narrow<T>(acc[d]);
  }
}

template <typename T>
void combine(const T* y, const int64_t* at, const T* w, int64_t N, int64_t k, int64_t D, T* out) {
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) { combine_rows(y, at, w, k, D, out, begin, end); });
}

}  // namespace

// y [R, D] contiguous expert outputs (R >= every at); at [N * k] int64 as moe_dispatch returns;
// weight [N, k] in y's dtype. Returns out [N, D]: sum over c of weight[t, c] * y[at[t * k + c]].
at::Tensor moe_combine(const at::Tensor& y, const at::Tensor& at_rows, const at::Tensor& weight) {
  TORCH_CHECK(y.dim() == 2 && y.is_contiguous(), "moe_combine: contiguous y [R, D]");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == y.scalar_type(), "moe_combine: weight [N, k] in y's dtype");
  const int64_t N = weight.size(0), k = weight.size(1), D = y.size(1);
  TORCH_CHECK(at_rows.numel() == N * k, "moe_combine: at [N * k]");
  auto a = at_rows.to(at::kLong).contiguous();
  auto w = weight.contiguous();
  auto out = at::empty({N, D}, y.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, y.scalar_type(), "moe_combine", [&] {
    combine<scalar_t>(y.data_ptr<scalar_t>(), a.data_ptr<int64_t>(), w.data_ptr<scalar_t>(), N, k, D,
                      out.data_ptr<scalar_t>());
  });
  return out;
}

// The k experts of largest key(e) in descending order (the lower id first among equal ones) into
// ids; `taken` is E flags of scratch.
template <typename Key>
void pick_top(const Key& key, int64_t E, int64_t k, std::vector<char>& taken, int64_t* ids) {
  std::fill(taken.begin(), taken.end(), 0);
  for (int64_t j = 0; j < k; ++j) {
    int64_t best = -1;
    for (int64_t e = 0; e < E; ++e)
      if (!taken[e] && (best < 0 || key(e) > key(best))) best = e;
    taken[best] = 1;
    ids[j] = best;
  }
}

// Softmax routing (Qwen3-Next's SparseMoE): per token, softmax of logits [T, E] (fp32 or bf16) in
// fp32, the k largest probabilities in descending order (the lower expert id first among equal
// ones), renormalised to sum 1 when `renorm`. Returns (weights [T, k] fp32, experts [T, k] int64).
std::tuple<at::Tensor, at::Tensor> topk_softmax(const at::Tensor& logits, int64_t k, bool renorm) {
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1, "topk_softmax: logits [T, E] with unit stride in E");
  const int64_t T = logits.size(0), E = logits.size(1);
  TORCH_CHECK(k >= 1 && k <= E, "topk_softmax: 1 <= k <= E");
  auto w = at::empty({T, k}, logits.options().dtype(at::kFloat));
  auto idx = at::empty({T, k}, logits.options().dtype(at::kLong));
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, logits.scalar_type(), "topk_softmax", [&] {
    const scalar_t* lp = logits.data_ptr<scalar_t>();
    float* wp = w.data_ptr<float>();
    int64_t* ip = idx.data_ptr<int64_t>();
    const int64_t ld = logits.stride(0);
    at::parallel_for(0, T, 64, [&](int64_t begin, int64_t end) {
      std::vector<float> p(E);
      std::vector<char> taken(E);
      for (int64_t t = begin; t < end; ++t) {
        float top = -std::numeric_limits<float>::max(), sum = 0.f;
        for (int64_t e = 0; e < E; ++e) top = std::max(top, p[e] = as_float(lp[t * ld + e]));
        for (int64_t e = 0; e < E; ++e) sum += p[e] = std::exp(p[e] - top);
        pick_top([&](int64_t e) { return p[e]; }, E, k, taken, ip + t * k);
        float chosen = 0.f;
        for (int64_t j = 0; j < k; ++j) chosen += wp[t * k + j] = p[ip[t * k + j]] / sum;
        if (renorm)
          for (int64_t j = 0; j < k; ++j) wp[t * k + j] /= chosen;
      }
    });
  });
  return {w, idx};
}

// a / b rounded once, as torch divides: the build's -ffast-math would multiply by a rounded reciprocal
// (p / p then is not 1); GCC does not inline across the differing options
#pragma GCC push_options
#pragma GCC optimize("no-reciprocal-math")
[[gnu::noinline]] static float divide(float a, float b) { return a / b; }
#pragma GCC pop_options

// Routing by biased scores with one expert group (Kimi Linear, DeepSeek-V3 style, n_group = 1): per
// token, the k experts of largest scores [T, E] (fp32, the router's sigmoids) + bias [E] in
// descending order (the lower id first among equal ones); weights = their scores, divided by
// their sum (+ 1e-20) when `renorm`, times `scaling`. Returns (weights [T, k] fp32, experts [T, k]
// int64).
std::tuple<at::Tensor, at::Tensor> topk_scores(const at::Tensor& scores, const at::Tensor& bias, int64_t k,
                                                bool renorm, double scaling) {
  TORCH_CHECK(scores.dim() == 2 && scores.stride(1) == 1 && scores.scalar_type() == at::kFloat,
              "topk_scores: fp32 scores [T, E] with unit stride in E");
  const int64_t T = scores.size(0), E = scores.size(1);
  TORCH_CHECK(bias.scalar_type() == at::kFloat && bias.is_contiguous() && bias.numel() == E,
              "topk_scores: contiguous fp32 bias [E]");
  TORCH_CHECK(k >= 1 && k <= E, "topk_scores: 1 <= k <= E");
  auto w = at::empty({T, k}, scores.options());
  auto idx = at::empty({T, k}, scores.options().dtype(at::kLong));
  const float *lp = scores.data_ptr<float>(), *bp = bias.data_ptr<float>();
  float* wp = w.data_ptr<float>();
  int64_t* ip = idx.data_ptr<int64_t>();
  const int64_t ld = scores.stride(0);
  const float scale = static_cast<float>(scaling);
  at::parallel_for(0, T, 64, [&](int64_t begin, int64_t end) {
    std::vector<char> taken(E);
    for (int64_t t = begin; t < end; ++t) {
      const float* p = lp + t * ld;
      pick_top([&](int64_t e) { return p[e] + bp[e]; }, E, k, taken, ip + t * k);
      float chosen = 0.f;
      for (int64_t j = 0; j < k; ++j) chosen += wp[t * k + j] = p[ip[t * k + j]];
      for (int64_t j = 0; j < k; ++j) {
        float& w_j = wp[t * k + j];
        w_j = (renorm ? divide(w_j, chosen + 1e-20f) : w_j) * scale;
      }
    }
  });
  return {w, idx};
}

namespace {

constexpr int64_t ROUTER_ROWS = 4;  // rows a pass over the weights: each weight vector read once for them

// out[r, e] = sum over d of x_r[d] w_e[d] for R rows (fp32, rows D apart): each sum held as 16
// partial sums (lane j takes d = j mod 16 in order), then halves added (j + 8, j + 4, j + 2, j + 1),
// so a score is the same whatever rows share the pass. With AVX-512 or AVX2 in registers (GCC kept
// the portable form's partial sums on the stack: 4x slower; AVX2's 16 lanes are two vectors, and
// its halves are added as AVX-512's reduction adds them: the same bits).
template <int R>
void router_rows(const float* x, const float* w, int64_t E, int64_t D, float* out) {
  for (int64_t e = 0; e < E; ++e) {
    const float* we = w + e * D;
#if defined(__AVX512F__)
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 16) {
      const __mmask16 m = D - d >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (D - d)) - 1);
      const __m512 wv = _mm512_maskz_loadu_ps(m, we + d);
      for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, x + r * D + d), wv, acc[r]);
    }
    for (int r = 0; r < R; ++r) out[r * E + e] = _mm512_reduce_add_ps(acc[r]);
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 lo[R], hi[R];  // lanes j and j + 8 of the 16 partial sums
    for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm256_setzero_ps();
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (int64_t d = 0; d < D; d += 16) {
      const __m256i m0 = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::min<int64_t>(D - d, 8))), lane);
      const __m256i m1 = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::max<int64_t>(D - d - 8, 0))), lane);
      const __m256 w0 = _mm256_maskload_ps(we + d, m0), w1 = _mm256_maskload_ps(we + d + 8, m1);
      for (int r = 0; r < R; ++r) {
        lo[r] = _mm256_fmadd_ps(_mm256_maskload_ps(x + r * D + d, m0), w0, lo[r]);
        hi[r] = _mm256_fmadd_ps(_mm256_maskload_ps(x + r * D + d + 8, m1), w1, hi[r]);
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m256 h8 = _mm256_add_ps(lo[r], hi[r]);                                    // j + 8
      const __m128 h4 = _mm_add_ps(_mm256_castps256_ps128(h8), _mm256_extractf128_ps(h8, 1));  // j + 4
      const __m128 h2 = _mm_add_ps(h4, _mm_movehl_ps(h4, h4));                          // j + 2
      out[r * E + e] = _mm_cvtss_f32(_mm_add_ss(h2, _mm_shuffle_ps(h2, h2, 1)));        // j + 1
    }
#else
    float part[R][16] = {};
    for (int64_t d = 0; d < D; ++d)
      for (int r = 0; r < R; ++r) part[r][d % 16] += x[r * D + d] * we[d];
    for (int r = 0; r < R; ++r) {
      for (int h = 8; h >= 1; h /= 2)
        for (int j = 0; j < h; ++j) part[r][j] += part[r][j + h];
      out[r * E + e] = part[r][0];
    }
#endif
  }
}

template <typename T>
void router_logits_impl(const T* x, int64_t ld, const float* w, int64_t T_, int64_t E, int64_t D, float* out) {
  at::parallel_for(0, (T_ + ROUTER_ROWS - 1) / ROUTER_ROWS, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> rows(ROUTER_ROWS * D);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t t0 = b * ROUTER_ROWS, n = std::min(ROUTER_ROWS, T_ - t0);
      for (int64_t r = 0; r < n; ++r)
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) rows[r * D + d] = as_float(x[(t0 + r) * ld + d]);
      float* o = out + t0 * E;
      switch (n) {
        case 4: router_rows<4>(rows.data(), w, E, D, o); break;
        case 3: router_rows<3>(rows.data(), w, E, D, o); break;
        case 2: router_rows<2>(rows.data(), w, E, D, o); break;
        default: router_rows<1>(rows.data(), w, E, D, o); break;
      }
    }
  });
}

}  // namespace

// The router of models/layers/mlp.py's GroupedTopKRouter before its sigmoid: x [T, D] (fp32 or
// bf16, unit stride in D, rows any stride apart) times w [E, D] (fp32, contiguous) -> logits [T, E]
// fp32, each an fp32 sum of exact products over D (a bf16 x widened first). torch's fp32 linear
// needs x widened into a copy and runs MKL's sgemm at ~64 GFLOP/s on 8 columns.
at::Tensor router_logits(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "router_logits: x [T, D] with unit stride in D");
  TORCH_CHECK(w.dim() == 2 && w.size(1) == x.size(1) && w.is_contiguous() && w.scalar_type() == at::kFloat,
              "router_logits: contiguous fp32 w [E, D]");
  const int64_t T = x.size(0), D = x.size(1), E = w.size(0);
  auto out = at::empty({T, E}, x.options().dtype(at::kFloat));
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "router_logits", [&] {
    router_logits_impl(x.data_ptr<scalar_t>(), x.stride(0), wp, T, E, D, op);
  });
  return out;
}
