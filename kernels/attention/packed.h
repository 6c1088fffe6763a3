// Key blocks packed for the bf16 micro-kernels (oneDNN's on AMX, gemm/dot.h's dot_mm on AVX-512
// BF16), shared by the prefill (prefill_packed) and decode (the shared pages) attention kernels:
// a block's keys and values laid out once in the VNNI pairs [K / 2, N, 2] those kernels read, and
// the online softmax whose numerators feed the value product as bf16.
#pragma once
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "../reduce.h"
#include "../widen.h"

// cnt keys (key(t), value(t): bf16 rows of Dk and Dv) as a block of `width` (>= cnt, even) columns:
// kb [Dk / 2, width] 32-bit units, K^T in channel pairs; vb [width / 2, Dv], the values of keys
// 2j and 2j + 1 interleaved; zero past cnt.
template <class Key, class Value>
void pack_block(Key key, Value value, int64_t cnt, int64_t width, int64_t Dk, int64_t Dv, uint32_t* kb,
                uint32_t* vb) {
  for (int64_t t = 0; t < width; ++t) {
    if (t >= cnt) {
      for (int64_t c = 0; c < Dk / 2; ++c) kb[c * width + t] = 0;
      continue;
    }
    const auto* row = reinterpret_cast<const uint32_t*>(key(t));
    for (int64_t c = 0; c < Dk / 2; ++c) kb[c * width + t] = row[c];
  }
  for (int64_t j = 0; j < width / 2; ++j) {
    const auto* a = reinterpret_cast<const uint16_t*>(2 * j < cnt ? value(2 * j) : nullptr);
    const auto* b = reinterpret_cast<const uint16_t*>(2 * j + 1 < cnt ? value(2 * j + 1) : nullptr);
    uint32_t* out = vb + j * Dv;
    if (a && b) {
#pragma omp simd
      for (int64_t d = 0; d < Dv; ++d) out[d] = a[d] | (static_cast<uint32_t>(b[d]) << 16);
    } else {
      for (int64_t d = 0; d < Dv; ++d) out[d] = a ? a[d] : 0;
    }
  }
}

// The online softmax over one packed block of kb keys from key k0 on, for M rows of raw scores S
// (rows ld apart): row `row` sees the keys up to pos[row % rows] (causal), `scale` (> 0) folded
// into the exponent, the numerators written as bf16 into P (rows ld apart; 0 past what the row
// sees, to ld) and summed before rounding; running max m and sum l per row, the accumulator rows
// acc (Dv each) rescaled.
inline void numerators_bf16(const float* S, c10::BFloat16* P, int64_t ld, int64_t M, int64_t rows,
                            const int64_t* pos, int64_t k0, int64_t kb, float scale, float* m, float* l, float* acc,
                            int64_t Dv) {
  for (int64_t row = 0; row < M; ++row) {
    const int64_t seen = std::max<int64_t>(0, std::min(kb, pos[row % rows] + 1 - k0));
    const float* s = S + row * ld;
    c10::BFloat16* p = P + row * ld;
    const float top = seen ? std::max(m[row], scale * max_of(s, seen, -1e30f)) : m[row];
    const float corr = std::exp(m[row] - top);  // 0 at the first block
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < seen; ++t) {
      const float e = std::exp(s[t] * scale - top);
      sum += e;
      p[t] = narrow<c10::BFloat16>(e);
    }
    std::fill(p + seen, p + ld, c10::BFloat16(0.f));  // keys after the query: masked
    m[row] = top;
    l[row] = l[row] * corr + sum;
    float* a = acc + row * Dv;
    if (corr != 1.f)
#pragma omp simd
      for (int64_t d = 0; d < Dv; ++d) a[d] *= corr;
  }
}
