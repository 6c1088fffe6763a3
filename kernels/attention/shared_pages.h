// The leading pages of a batch's page tables that every sequence shares and whose keys every
// query of every sequence sees (a prefix cached once and read by all: a shared system prompt, the
// common turns of a chat). Both attention kernels run these pages for the whole batch at once:
// the queries of many sequences stacked into one matmul per key block, the keys widened once.
#pragma once
#include <algorithm>
#include <cstdint>

// pages [N, width]; seen[n]: the keys every query of sequence n sees (decode: all its keys;
// prefill: the cached keys before its first query)
inline int64_t shared_pages(const int64_t* pages, int64_t width, const int64_t* seen, int64_t N, int64_t page_size) {
  if (N < 1) return 0;
  const int64_t fewest = *std::min_element(seen, seen + N);
  int64_t c = 0;
  for (; c < width && (c + 1) * page_size <= fewest; ++c)
    for (int64_t n = 1; n < N; ++n)
      if (pages[n * width + c] != pages[c]) return c;
  return c;
}
