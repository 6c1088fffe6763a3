// Mamba2's gated grouped norm of one row, shared by the norm kernel (cpu_norm.cpp) and the SSD
// prefill kernel, which applies it to each chunk's output while that is still in cache
// (mamba2/cpu_ssd.cpp): one definition, so the same bits either way.
#pragma once
#include <cmath>
#include <cstdint>

#include "../act.h"
#include "../widen.h"

// 1 / rms(x) over D values, in fp32
template <typename T>
inline float inv_rms(const T* x, int64_t D, float eps) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t d = 0; d < D; ++d) ss += as_float(x[d]) * as_float(x[d]);
  return 1.f / std::sqrt(ss / static_cast<float>(D) + eps);
}

// A row of D = groups * Dg: v = x * silu(z) in fp32 (v: D floats of scratch), each group's
// v / rms(v), times w, rounded to O into y (which may be x). The same operations in the same order
// as models/nemotron_h.py's torch path.
template <typename X, typename Z, typename O>
inline void gated_group_row(const X* x, const Z* z, const float* w, int64_t groups, int64_t Dg, float eps, O* y,
                            float* v) {
  const int64_t D = groups * Dg;
#pragma omp simd
  for (int64_t d = 0; d < D; ++d) v[d] = as_float(x[d]) * act::silu(as_float(z[d]));
  for (int64_t g = 0; g < groups; ++g) {
    const float inv = inv_rms(v + g * Dg, Dg, eps);
#pragma omp simd
    for (int64_t d = g * Dg; d < (g + 1) * Dg; ++d) y[d] = narrow<O>(w[d] * (v[d] * inv));
  }
}
