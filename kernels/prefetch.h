// Software prefetch of the rows a compiled CPU kernel reads next where the hardware prefetchers
// do not see them coming: a column range of a wider tensor (a projection's gate or q/k/v columns),
// a few hundred bytes every row stride, read row by row.
#pragma once
#include <cstdint>

// tokens ahead whose rows are prefetched where a kernel reads a column range of a projection's
// output (a gate, q / k heads, Mamba2's z): a few hundred bytes every row, which the hardware
// prefetchers did not fetch ahead (the gated norm took 3-4x the plain one, most of it waiting on
// the gate's loads)
constexpr int64_t ROWS_AHEAD = 8;

// every cache line of the `bytes` bytes at p
inline void prefetch_bytes(const void* p, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(static_cast<const char*>(p) + b);
}

// the same into L2 only (prefetcht1: Zen 4 fills L2, not L1), for rows read a while later: from
// memory, prefetches into L1 are as many at a time as L1 has misses outstanding, and rows fetched
// far ahead into L1 are evicted before they are read
inline void prefetch_l2_bytes(const void* p, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(static_cast<const char*>(p) + b, 0, 2);
}
