// Reductions over fp32 rows that the compiler vectorizes, shared by the compiled CPU kernels.
// gcc keeps a plain max reduction (even under `omp simd reduction(max:)`) as a chain of scalar
// maxss, one per element at its latency: 70% of a prefill attention kernel's own time went
// there. Sixteen running maxima break the chain.
#pragma once
#include <algorithm>
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
