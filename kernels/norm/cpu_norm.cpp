// RMS norms in one pass per row, built and called by kernels/native.py for models/layers/norm.py:
// y = x / rms(x) in fp32, then either times (offset + w) and an optional activated gate, cast
// once to x's dtype (RMSNorm with an offset, GatedRMSNorm), or cast to x's dtype first and
// times w in that dtype (RMSNorm without an offset, as the reference models round).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "../widen.h"

#include <bit>
#include <cmath>
#include <cstdint>
#include <string>

namespace {

enum Act { kNone, kSilu, kSigmoid };

template <typename T, typename G>
void norm_rows(const T* x, const float* w, float offset, bool cast_first, const G* gate, Act act, float eps,
               int64_t rows, int64_t D, T* y) {
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * D;
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t d = 0; d < D; ++d) ss += as_float(xr[d]) * as_float(xr[d]);
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(D) + eps);
      T* yr = y + r * D;
      if (cast_first) {
        for (int64_t d = 0; d < D; ++d) yr[d] = static_cast<T>(as_float(static_cast<T>(as_float(xr[d]) * inv)) * w[d]);
        continue;
      }
      const G* gr = gate ? gate + r * D : nullptr;
      for (int64_t d = 0; d < D; ++d) {
        float v = as_float(xr[d]) * inv * (offset + w[d]);
        if (gr) {
          const float g = as_float(gr[d]);
          v *= act == kSilu ? g / (1.f + std::exp(-g)) : act == kSigmoid ? 1.f / (1.f + std::exp(-g)) : g;
        }
        yr[d] = static_cast<T>(v);
      }
    }
  });
}

}  // namespace

// x [..., D] with a contiguous layout (fp32 or bf16); weight [D] fp32; gate [..., D] like x's
// shape (fp32 or bf16) or empty; act "silu", "sigmoid" or "" for the gate. Returns y in x's
// dtype and shape.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, double offset, bool cast_first,
                    const at::Tensor& gate, const std::string& act) {
  TORCH_CHECK(x.is_contiguous() && weight.scalar_type() == at::kFloat && weight.is_contiguous(),
              "rms_norm: contiguous x, contiguous fp32 weight");
  const int64_t D = x.size(-1), rows = D ? x.numel() / D : 0;
  TORCH_CHECK(weight.numel() == D, "rms_norm: weight [D]");
  TORCH_CHECK(!gate.numel() || (gate.sizes() == x.sizes() && gate.is_contiguous()), "rms_norm: gate like x");
  TORCH_CHECK(!cast_first || !gate.numel(), "rms_norm: cast_first takes no gate");
  const Act a = act == "silu" ? kSilu : act == "sigmoid" ? kSigmoid : kNone;
  auto y = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "rms_norm", [&] {
    using T = scalar_t;
    const T* xp = x.data_ptr<T>();
    const float* wp = weight.data_ptr<float>();
    if (gate.numel() && gate.scalar_type() == at::kBFloat16)
      norm_rows<T, c10::BFloat16>(xp, wp, offset, cast_first, gate.data_ptr<c10::BFloat16>(), a, eps, rows, D,
                                  y.data_ptr<T>());
    else {
      TORCH_CHECK(!gate.numel() || gate.scalar_type() == at::kFloat, "rms_norm: fp32 or bf16 gate");
      norm_rows<T, float>(xp, wp, offset, cast_first, gate.numel() ? gate.data_ptr<float>() : nullptr, a, eps, rows,
                          D, y.data_ptr<T>());
    }
  });
  return y;
}
