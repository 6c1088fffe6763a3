// Mamba2's gated grouped norm of one row, shared by the norm kernel (cpu_norm.cpp) and the SSD
// prefill kernel, which applies it to each chunk's output while that is still in cache
// (mamba2/cpu_ssd.cpp): one definition, so the same bits either way.
#pragma once
#include <cmath>
#include <cstdint>

#include <ATen/Parallel.h>

#include <vector>

#include "../act.h"
#include "../prefetch.h"
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

// Rows [rows, D] of x (contiguous) through gated_group_row into y (which may be x), in parallel;
// z's rows ldz apart (a column range of the projection), prefetched ROWS_AHEAD rows on.
template <typename X, typename Z, typename O>
void gated_group_rows(const X* x, const Z* z, int64_t ldz, const float* w, int64_t groups, float eps, int64_t rows,
                      int64_t D, O* y) {
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> v(D);
    for (int64_t r = begin; r < end; ++r) {
      const Z* zr = z + r * ldz;
      if (r + ROWS_AHEAD < rows) prefetch_bytes(zr + ROWS_AHEAD * ldz, D * sizeof(Z));
      gated_group_row(x + r * D, zr, w, groups, D / groups, eps, y + r * D, v.data());
    }
  });
}
