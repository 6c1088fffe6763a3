// Software prefetch of the rows a compiled CPU kernel reads next where the hardware prefetchers
// do not see them coming: a column range of a wider tensor (a projection's gate or q/k/v columns),
// a few hundred bytes every row stride, read row by row.
#pragma once
#include <cstdint>

// every cache line of the `bytes` bytes at p
inline void prefetch_bytes(const void* p, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(static_cast<const char*>(p) + b);
}
