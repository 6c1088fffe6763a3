// bf16 / fp32 element to fp32, shared by the compiled CPU kernels. bf16 is the top half of an
// fp32: a shift the compiler vectorizes (c10's conversion it does not).
#pragma once
#include <c10/util/BFloat16.h>

#include <bit>
#include <cstdint>

inline float as_float(float x) { return x; }
inline float as_float(c10::BFloat16 x) { return std::bit_cast<float>(static_cast<uint32_t>(x.x) << 16); }
