// bf16 / fp32 element to fp32 and back, shared by the compiled CPU kernels. bf16 is the top half
// of an fp32: widening is a shift and narrowing a rounding add and a shift, which the compiler
// vectorizes (c10's conversions it does not).
#pragma once
#include <c10/util/BFloat16.h>

#include <bit>
#include <algorithm>
#include <cstdint>
#include <type_traits>

inline float as_float(float x) { return x; }
inline float as_float(c10::BFloat16 x) { return std::bit_cast<float>(static_cast<uint32_t>(x.x) << 16); }

// fp32 -> bf16 bits, rounded to nearest even as c10::BFloat16 rounds finite values and infinities
inline uint16_t bf16_bits(float f) {
  const uint32_t u = std::bit_cast<uint32_t>(f);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// fp32 -> T (float: unchanged; bf16: rounded as above)
template <typename T>
inline T narrow(float x) {
  return x;
}
template <>
inline c10::BFloat16 narrow<c10::BFloat16>(float x) {
  return c10::BFloat16(bf16_bits(x), c10::BFloat16::from_bits());
}

// fp32 rounded to the nearest bf16 and widened again
inline float round_bf16(float f) { return std::bit_cast<float>(static_cast<uint32_t>(bf16_bits(f)) << 16); }

// A recurrent state kept in S (fp32 or bf16) is worked on in fp32 rows: n elements widened into
// them (zeros where fresh), stored back, and rounded to what S keeps (bf16: to nearest even).
template <typename S>
inline void widen_state(const S* src, float* dst, int64_t n, bool fresh) {
  if (fresh) {
    std::fill(dst, dst + n, 0.f);
    return;
  }
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = as_float(src[i]);
}
template <typename S>
inline void store_state(const float* src, S* dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = narrow<S>(src[i]);
}

template <typename S>
inline void round_state(float* x, int64_t n) {
  if constexpr (!std::is_same_v<S, float>) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) x[i] = round_bf16(x[i]);
  }
}
