// Reductions over fp32 rows that the compiler vectorizes, shared by the compiled CPU kernels.
// gcc keeps a plain max reduction (even under `omp simd reduction(max:)`) as a chain of scalar
// maxss, one per element at its latency: 70% of a prefill attention kernel's own time went
// there. Sixteen running maxima break the chain.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>

inline float max_of(const float* s, int64_t n, float init) {
  float part[16];
  std::fill(part, part + 16, init);
  int64_t t = 0;
  for (; t + 16 <= n; t += 16)
#pragma omp simd
    for (int64_t j = 0; j < 16; ++j) part[j] = std::max(part[j], s[t + j]);
  float top = init;
  for (int64_t j = 0; j < 16; ++j) top = std::max(top, part[j]);
  for (; t < n; ++t) top = std::max(top, s[t]);
  return top;
}

// One row of an online softmax: n new scores s become their numerators exp(s - max) in place,
// the running max m and sum l are updated, and the row's accumulator acc (Dv) is rescaled to
// the new max (shared by the prefill and decode attention kernels).
inline void online_softmax_row(float* s, int64_t n, float& m, float& l, float* acc, int64_t Dv) {
  const float top = max_of(s, n, m);
  const float corr = std::exp(m - top);  // 0 at the first block
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t t = 0; t < n; ++t) {
    s[t] = std::exp(s[t] - top);
    sum += s[t];
  }
  m = top;
  l = l * corr + sum;
  if (corr != 1.f)
#pragma omp simd
    for (int64_t d = 0; d < Dv; ++d) acc[d] *= corr;
}
