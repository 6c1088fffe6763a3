// RMS norms in one pass per row, built and called by kernels/native.py for models/layers/norm.py:
// y = x / rms(x) in fp32, then either times (offset + w) and an optional activated gate, cast
// once to x's dtype (RMSNorm with an offset, GatedRMSNorm), or cast to x's dtype first and
// times w in that dtype (RMSNorm without an offset, as the reference models round). And the
// gate-first grouped form of Mamba2 layers: y = w * norm(x * silu(z)) over each channel group.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "../act.h"
#include "../prefetch.h"
#include "../widen.h"
#include "gated.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

namespace {

enum Act { kNone, kSilu, kSigmoid };

// gate rows: per_tok rows of D a token, contiguous, tokens ldg apart (a column range of a
// projection's output read in place)
template <typename T, typename G, typename Y>
void norm_rows(const T* x, int64_t ldx, const float* w, float offset, bool cast_first, const G* gate, int64_t per_tok,
               int64_t ldg, Act act, float eps, int64_t rows, int64_t D, Y* y) {
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> v(D);
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * ldx;
      Y* yr = y + r * D;
      const float inv = inv_rms(xr, D, eps);
      if (cast_first) {
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) yr[d] = narrow<Y>(as_float(narrow<T>(as_float(xr[d]) * inv)) * w[d]);
        continue;
      }
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) v[d] = as_float(xr[d]) * inv * (offset + w[d]);
      if (gate) {  // each activation its own vector pass
        const int64_t t = r / per_tok;
        if (r % per_tok == 0 && (t + ROWS_AHEAD) * per_tok < rows)  // a later token's gate columns, on their way
          prefetch_bytes(gate + (t + ROWS_AHEAD) * ldg, per_tok * D * sizeof(G));
        const G* gr = gate + t * ldg + r % per_tok * D;
        if (act == kSilu) {
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) v[d] *= act::silu(as_float(gr[d]));
        } else if (act == kSigmoid) {
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) v[d] *= act::sigmoid(as_float(gr[d]));
        } else {
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) v[d] *= as_float(gr[d]);
        }
      }
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) yr[d] = narrow<Y>(v[d]);
    }
  });
}

// x + r rounded to T into s, then that row normed into y (offset weight, or cast_first)
template <typename T>
void add_norm_rows(const T* x, const T* r, const float* w, float offset, bool cast_first, float eps, int64_t rows,
                   int64_t D, T* s, T* y) {
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const T *xr = x + row * D, *rr = r + row * D;
      T *sr = s + row * D, *yr = y + row * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) sr[d] = narrow<T>(as_float(xr[d]) + as_float(rr[d]));
      const float inv = inv_rms(sr, D, eps);
      if (cast_first) {
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) yr[d] = narrow<T>(as_float(narrow<T>(as_float(sr[d]) * inv)) * w[d]);
      } else {
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) yr[d] = narrow<T>(as_float(sr[d]) * inv * (offset + w[d]));
      }
    }
  });
}

// Rows of D (strides s0 between tokens, s1 between heads) normed with an offset weight and
// rounded to T, then rotated in their first `rot` channels (rotate-half pairs (i, i + rot/2) by
// the token's cos, sin [rot]) and rounded again; into out [T, heads, D] contiguous.
template <typename T>
void norm_rope_rows(const T* x, int64_t s0, int64_t s1, int64_t tokens, int64_t heads, int64_t D, const float* w,
                    float offset, float eps, const float* cos, const float* sin, int64_t rot, T* out) {
  const int64_t half = rot / 2;
  at::parallel_for(0, tokens * heads, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> v(D);
    for (int64_t row = begin; row < end; ++row) {
      const int64_t t = row / heads, h = row % heads;
      const T* xr = x + t * s0 + h * s1;
      if (t + ROWS_AHEAD < tokens) prefetch_bytes(xr + ROWS_AHEAD * s0, D * sizeof(T));  // rows s0 apart (a column range)
      T* o = out + row * D;
      const float inv = inv_rms(xr, D, eps);
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) v[d] = as_float(narrow<T>(as_float(xr[d]) * inv * (offset + w[d])));
      const float *c = cos + t * rot, *s = sin + t * rot;
#pragma omp simd
      for (int64_t i = 0; i < half; ++i) {
        o[i] = narrow<T>(v[i] * c[i] - v[i + half] * s[i]);
        o[i + half] = narrow<T>(v[i + half] * c[i + half] + v[i] * s[i + half]);
      }
#pragma omp simd
      for (int64_t d = rot; d < D; ++d) o[d] = narrow<T>(v[d]);
    }
  });
}

// y = o * sigmoid(g), row by row, each step rounded to T as torch's T ops round it (the sigmoid in
// fp32, rounded; the product of two T values, rounded once): o [rows, C] contiguous, g's rows ldg
// apart (a column range of a projection's output, prefetched ROWS_AHEAD rows on)
template <typename T>
void sigmoid_gate_rows(const T* o, const T* g, int64_t ldg, int64_t rows, int64_t C, T* y) {
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T *orow = o + r * C, *grow = g + r * ldg;
      T* yr = y + r * C;
      if (r + ROWS_AHEAD < rows) prefetch_bytes(grow + ROWS_AHEAD * ldg, C * sizeof(T));
#pragma omp simd
      for (int64_t c = 0; c < C; ++c) {
        const float s = as_float(narrow<T>(act::sigmoid(as_float(grow[c]))));
        yr[c] = narrow<T>(as_float(orow[c]) * s);
      }
    }
  });
}

}  // namespace

// Mamba2's gated norm: x [T, D] fp32 or bf16 contiguous, z [T, D] fp32 or bf16 with unit stride in
// D (a column range of the projection); weight [D] fp32; D a multiple of groups. Returns
// w * norm(x * silu(z)) [T, D], the RMS taken over each of the groups, in z's dtype.
at::Tensor gated_group_norm(const at::Tensor& x, const at::Tensor& z, const at::Tensor& weight, int64_t groups,
                            double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && z.sizes() == x.sizes() && z.stride(1) == 1,
              "gated_group_norm: contiguous x [T, D], z [T, D] with unit stride in D");
  const int64_t D = x.size(1), rows = x.size(0);
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous() && weight.numel() == D,
              "gated_group_norm: fp32 weight [D]");
  TORCH_CHECK(groups > 0 && D % groups == 0, "gated_group_norm: groups must divide D");
  auto y = at::empty(x.sizes(), z.options());
  const float* wp = weight.data_ptr<float>();
  const float e = static_cast<float>(eps);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "gated_group_norm", [&] {
    using X = scalar_t;
    if (z.scalar_type() == at::kBFloat16)
      gated_group_rows<X, c10::BFloat16, c10::BFloat16>(x.data_ptr<X>(), z.data_ptr<c10::BFloat16>(), z.stride(0), wp, groups, e,
                                                        rows, D, y.data_ptr<c10::BFloat16>());
    else {
      TORCH_CHECK(z.scalar_type() == at::kFloat, "gated_group_norm: fp32 or bf16 z");
      gated_group_rows<X, float, float>(x.data_ptr<X>(), z.data_ptr<float>(), z.stride(0), wp, groups, e, rows, D,
                                        y.data_ptr<float>());
    }
  });
  return y;
}

// x [..., D] with a contiguous layout, or rows [R, D] any stride apart (fp32 or bf16); weight [D]
// fp32; gate [..., D] like x's shape (fp32 or bf16), each gate[t] contiguous, the first dim any
// stride apart (a column range of a wider projection), or empty; act "silu", "sigmoid" or "" for
// the gate. Returns y [..., D] contiguous in out_dtype: x's dtype, or bf16 (one rounding of
// the fp32 result, as a cast of the fp32 output would round it).
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, double offset, bool cast_first,
                    const at::Tensor& gate, const std::string& act, at::ScalarType out_dtype) {
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous(), "rms_norm: contiguous fp32 weight");
  const bool rows2d = x.dim() == 2 && x.stride(1) == 1 && x.stride(0) >= x.size(1);  // rows any stride apart
  TORCH_CHECK(rows2d || x.is_contiguous(), "rms_norm: contiguous x, or rows [R, D] with unit stride in D");
  const int64_t D = x.size(-1), rows = D ? x.numel() / D : 0, ldx = rows2d ? x.stride(0) : D;
  TORCH_CHECK(weight.numel() == D, "rms_norm: weight [D]");
  const int64_t per_tok = gate.numel() && x.dim() > 1 ? gate[0].numel() / D : 1;
  TORCH_CHECK(!gate.numel() || (gate.sizes() == x.sizes() && (x.dim() == 1 || (gate[0].is_contiguous() &&
                                                                               gate.stride(0) >= gate[0].numel()))),
              "rms_norm: gate like x, each gate[t] contiguous");
  TORCH_CHECK(!cast_first || !gate.numel(), "rms_norm: cast_first takes no gate");
  TORCH_CHECK(out_dtype == x.scalar_type() || out_dtype == at::kBFloat16, "rms_norm: output in x's dtype or bf16");
  TORCH_CHECK(!gate.numel() || gate.scalar_type() == at::kBFloat16 || gate.scalar_type() == at::kFloat,
              "rms_norm: fp32 or bf16 gate");
  const Act a = act == "silu" ? kSilu : act == "sigmoid" ? kSigmoid : kNone;
  const int64_t ldg = gate.numel() && x.dim() > 1 ? gate.stride(0) : D;
  auto y = at::empty(x.sizes(), x.options().dtype(out_dtype));
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "rms_norm", [&] {
    using T = scalar_t;
    const T* xp = x.data_ptr<T>();
    const float* wp = weight.data_ptr<float>();
    auto run = [&](auto* out) {
      if (gate.numel() && gate.scalar_type() == at::kBFloat16)
        norm_rows(xp, ldx, wp, offset, cast_first, gate.data_ptr<c10::BFloat16>(), per_tok, ldg, a, eps, rows, D, out);
      else
        norm_rows(xp, ldx, wp, offset, cast_first, gate.numel() ? gate.data_ptr<float>() : nullptr, per_tok, ldg, a,
                  eps, rows, D, out);
    };
    if (out_dtype == x.scalar_type())
      run(y.data_ptr<T>());
    else
      run(y.data_ptr<c10::BFloat16>());
  });
  return y;
}

// RMSNorm with an offset weight, then RoPE, of query or key heads (Qwen3-Next's attention): x
// [T, heads, D] with unit stride in D (a view of a projection's output); weight [D] fp32; cos,
// sin [T, rot] fp32 (rotate-half layout), rot even and <= D. Returns y [T, heads, D] contiguous in
// x's dtype, rounded after the norm and after the rotation as models/qwen3_next.py's torch path.
at::Tensor rms_norm_rope(const at::Tensor& x, const at::Tensor& weight, double eps, double offset,
                         const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "rms_norm_rope: x [T, heads, D] with unit stride in D");
  const int64_t T = x.size(0), heads = x.size(1), D = x.size(2), rot = cos.size(1);
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous() && weight.numel() == D,
              "rms_norm_rope: fp32 weight [D]");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.size(0) == T && sin.sizes() == cos.sizes() && rot % 2 == 0 && rot <= D,
              "rms_norm_rope: fp32 cos, sin [T, rot]");
  auto y = at::empty({T, heads, D}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "rms_norm_rope", [&] {
    norm_rope_rows<scalar_t>(x.data_ptr<scalar_t>(), x.stride(0), x.stride(1), T, heads, D, weight.data_ptr<float>(),
                             static_cast<float>(offset), static_cast<float>(eps), cos.data_ptr<float>(),
                             sin.data_ptr<float>(), rot, y.data_ptr<scalar_t>());
  });
  return y;
}

// The residual stream's add and the next norm in one pass: s = x + residual rounded to x's dtype
// (as torch's add rounds), then y = rms_norm(s) as rms_norm above computes it (offset weight, or
// cast_first). x and residual [..., D] contiguous, one dtype; weight [D] fp32. Returns (y, s).
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps, double offset, bool cast_first) {
  TORCH_CHECK(x.is_contiguous() && residual.is_contiguous() && residual.sizes() == x.sizes() &&
                  residual.scalar_type() == x.scalar_type(), "add_rms_norm: contiguous x and residual of one shape and dtype");
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous() && weight.numel() == x.size(-1),
              "add_rms_norm: fp32 weight [D]");
  const int64_t D = x.size(-1), rows = D ? x.numel() / D : 0;
  auto sum = at::empty_like(x), y = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "add_rms_norm", [&] {
    add_norm_rows<scalar_t>(x.data_ptr<scalar_t>(), residual.data_ptr<scalar_t>(), weight.data_ptr<float>(),
                            static_cast<float>(offset), cast_first, static_cast<float>(eps), rows, D,
                            sum.data_ptr<scalar_t>(), y.data_ptr<scalar_t>());
  });
  return {y, sum};
}

// o * sigmoid(gate) in one pass (the output gate of Qwen3-Next's attention), rounded as torch's ops
// in o's dtype round it: o [T, C] contiguous and gate [T, C] with unit stride in C, rows any stride
// apart (the gate half of the query projection, read in place), one dtype (fp32 or bf16).
at::Tensor sigmoid_gate(const at::Tensor& o, const at::Tensor& gate) {
  TORCH_CHECK(o.dim() == 2 && o.is_contiguous() && gate.sizes() == o.sizes() && gate.stride(1) == 1 &&
                  gate.stride(0) >= gate.size(1),
              "sigmoid_gate: contiguous o [T, C] and gate [T, C] with unit stride in C");
  TORCH_CHECK(gate.scalar_type() == o.scalar_type() &&
                  (o.scalar_type() == at::kFloat || o.scalar_type() == at::kBFloat16),
              "sigmoid_gate: o and gate both fp32 or both bf16");
  auto y = at::empty_like(o);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, o.scalar_type(), "sigmoid_gate", [&] {
    sigmoid_gate_rows<scalar_t>(o.data_ptr<scalar_t>(), gate.data_ptr<scalar_t>(), gate.stride(0), o.size(0),
                                o.size(1), y.data_ptr<scalar_t>());
  });
  return y;
}

namespace {

template <typename T>
void relu2_range(const T* x, T* y, int64_t begin, int64_t end) {
#pragma omp simd
  for (int64_t i = begin; i < end; ++i) {
    const float r = std::max(as_float(x[i]), 0.f);
    y[i] = narrow<T>(r * r);
  }
}

}  // namespace

// relu(x)^2 in one pass (NemotronH's MLP activation), rounded as torch's relu then square_ round it
// in x's dtype: x contiguous, fp32 or bf16. Returns a new tensor.
at::Tensor relu2(const at::Tensor& x) {
  TORCH_CHECK(x.is_contiguous() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "relu2: contiguous fp32 or bf16 x");
  auto y = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "relu2", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    at::parallel_for(0, x.numel(), 1 << 14, [&](int64_t begin, int64_t end) { relu2_range(xp, yp, begin, end); });
  });
  return y;
}
