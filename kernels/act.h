// The activations of the compiled CPU kernels: sigmoid(x) = 1 / (1 + exp(-x)) and silu(x) =
// x / (1 + exp(-x)), as the torch paths compute them in fp32. The kernels are built with
// -ffast-math, which assumes no infinities: there 1 / (1 + inf) came out NaN instead of 0 once
// exp(-x) overflowed (x below -88.72, where the IEEE result is 0 or -0). Past that point these
// return 0 by a select, exp's argument clamped; everywhere else the same operations, the same bits.
#pragma once
#include <algorithm>
#include <cmath>

namespace act {

constexpr float EXP_MAX = 88.72f;  // log(FLT_MAX): exp overflows past it

inline float sigmoid(float x) {
  const float n = -x;
  return n > EXP_MAX ? 0.f : 1.f / (1.f + std::exp(std::min(n, EXP_MAX)));
}

inline float silu(float x) {
  const float n = -x;
  return n > EXP_MAX ? 0.f : x / (1.f + std::exp(std::min(n, EXP_MAX)));
}

}  // namespace act
