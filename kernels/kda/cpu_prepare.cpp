// The delta-rule kernels' inputs from a KDA / GDN layer's projections in one pass per token (CPU),
// built and called by kernels/native.py; models/layers/state.py's delta_inputs is the torch
// formulation it replaces (some fifteen small ops per layer and step):
//   q, k = the conv output's q and k heads, each divided by sqrt(sum of squares + eps), fp32
//   v    = its v heads, fp32
//   g    = -exp(A_log[hv]) softplus(a + dt_bias)   (softplus(x) = x above 20, as torch's)
//   beta = sigmoid(b)
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "../act.h"
#include "../widen.h"

#include <cmath>
#include <cstdint>
#include <vector>

namespace {

// row t of a [T, G, C] view with unit stride in its last dim, as G * C fp32 values
template <typename T>
inline void gather_row(const at::Tensor& a, const T* base, int64_t t, float* out) {
  const int64_t G = a.size(1), C = a.size(2);
  for (int64_t i = 0; i < G; ++i) {
    const T* src = base + t * a.stride(0) + i * a.stride(1);
#pragma omp simd
    for (int64_t c = 0; c < C; ++c) out[i * C + c] = as_float(src[c]);
  }
}

// the body of delta_prepare for x's dtype Tx (outside the dispatch macro, which cannot hold pragmas)
template <typename Tx>
void prepare(const at::Tensor& x, int64_t H, int64_t K, int64_t HV, int64_t V, int64_t gK, const at::Tensor& a,
             const at::Tensor& b, const float* A, const float* db, float e, at::Tensor& q, at::Tensor& k,
             at::Tensor& v, at::Tensor& g, at::Tensor& beta) {
  const int64_t T = x.size(0);
  const Tx *xp = x.data_ptr<Tx>(), *ap = a.data_ptr<Tx>(), *bp = b.data_ptr<Tx>();
  float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  float *gp = g.data_ptr<float>(), *betap = beta.data_ptr<float>();
  const int64_t ld = x.stride(0);
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> u(HV * gK), z(HV);
    for (int64_t t = begin; t < end; ++t) {
      const Tx* row = xp + t * ld;
      for (int64_t part = 0; part < 2; ++part)  // q heads, then k heads
        for (int64_t h = 0; h < H; ++h) {
          const Tx* src = row + (part * H + h) * K;
          float* dst = (part ? kp : qp) + (t * H + h) * K;
          float ss = 0.f;
#pragma omp simd reduction(+ : ss)
          for (int64_t d = 0; d < K; ++d) {
            dst[d] = as_float(src[d]);
            ss += dst[d] * dst[d];
          }
          const float inv = 1.f / std::sqrt(ss + e);
#pragma omp simd
          for (int64_t d = 0; d < K; ++d) dst[d] *= inv;
        }
      const Tx* vs = row + 2 * H * K;
#pragma omp simd
      for (int64_t d = 0; d < HV * V; ++d) vp[t * HV * V + d] = as_float(vs[d]);
      gather_row(a, ap, t, u.data());
      gather_row(b, bp, t, z.data());
      for (int64_t h = 0; h < HV; ++h) {  // per head: its gK decays, a vector loop when gK = K
        const float Ah = A[h], *uh = u.data() + h * gK, *dh = db + h * gK;
        float* gh = gp + (t * HV + h) * gK;
#pragma omp simd
        for (int64_t d = 0; d < gK; ++d) {
          const float w = uh[d] + dh[d];
          gh[d] = Ah * (w > 20.f ? w : std::log1p(std::exp(w)));
        }
      }
#pragma omp simd
      for (int64_t h = 0; h < HV; ++h) betap[t * HV + h] = act::sigmoid(z[h]);
    }
  });
}

}  // namespace

// x [T, 2*H*K + HV*V] (q heads, k heads, v heads; rows contiguous); a [T, G, C] with G*C = HV*gK
// (gK = 1: one decay per value head; gK = K: one per channel) and b [T, Gb, Cb] with Gb*Cb = HV,
// both with unit stride in the last dim, in x's dtype; A_log [HV] and dt_bias [HV*gK] fp32.
// Returns (q [T, H, K], k [T, H, K], v [T, HV, V], g [T, HV, gK], beta [T, HV]), all fp32.
std::vector<at::Tensor> delta_prepare(const at::Tensor& x, int64_t H, int64_t K, int64_t HV, int64_t V,
                                      const at::Tensor& a, const at::Tensor& A_log, const at::Tensor& dt_bias,
                                      const at::Tensor& b, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) == 2 * H * K + HV * V, "delta_prepare: x [T, 2HK + HV*V]");
  TORCH_CHECK(a.dim() == 3 && b.dim() == 3 && a.stride(2) == 1 && b.stride(2) == 1, "delta_prepare: a, b [T, G, C]");
  TORCH_CHECK(a.scalar_type() == x.scalar_type() && b.scalar_type() == x.scalar_type(), "delta_prepare: a, b in x's dtype");
  const int64_t T = x.size(0), gK = a.size(1) * a.size(2) / HV;
  TORCH_CHECK(a.size(1) * a.size(2) == HV * gK && (gK == 1 || gK == K) && b.size(1) * b.size(2) == HV,
              "delta_prepare: a holds HV or HV*K gates, b HV");
  TORCH_CHECK(A_log.scalar_type() == at::kFloat && dt_bias.scalar_type() == at::kFloat && A_log.numel() == HV &&
                  dt_bias.numel() == HV * gK && A_log.is_contiguous() && dt_bias.is_contiguous(),
              "delta_prepare: fp32 A_log [HV], dt_bias [HV*gK]");
  auto f32 = x.options().dtype(at::kFloat);
  auto q = at::empty({T, H, K}, f32), k = at::empty({T, H, K}, f32), v = at::empty({T, HV, V}, f32);
  auto g = at::empty({T, HV, gK}, f32), beta = at::empty({T, HV}, f32);
  const float* Al = A_log.data_ptr<float>();
  const float* db = dt_bias.data_ptr<float>();
  std::vector<float> A(HV);
  for (int64_t h = 0; h < HV; ++h) A[h] = -std::exp(Al[h]);
  const float e = static_cast<float>(eps);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "delta_prepare", [&] {
    prepare<scalar_t>(x, H, K, HV, V, gK, a, b, A.data(), db, e, q, k, v, g, beta);
  });
  return {q, k, v, g, beta};
}
