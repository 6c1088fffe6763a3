// Denormal floats as zero inside the compiled CPU kernels. Decays exp(G_i - G_j) whose argument
// falls in [-103, -87] and states multiplied by such decays are denormal in fp32, and x86 cores
// run arithmetic on denormals some 10-100x slower (a GDN prefill with strong decays 8x slower).
// Such values are below 1e-38, far under fp32 resolution beside the terms they join, so treating
// them as zero changes no result beyond that. The guard sets flush-to-zero and
// denormals-are-zero on the thread that holds it and restores the thread's mode when it goes, so
// torch's own ops keep IEEE behaviour; every parallel region of a kernel opens one per thread.
#pragma once

#if defined(__x86_64__) || defined(_M_X64)
#include <xmmintrin.h>

class FlushDenormals {
 public:
  FlushDenormals() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | 0x8040); }  // FTZ (bit 15) | DAZ (bit 6)
  ~FlushDenormals() { _mm_setcsr(saved_); }
  FlushDenormals(const FlushDenormals&) = delete;
  FlushDenormals& operator=(const FlushDenormals&) = delete;

 private:
  unsigned int saved_;
};
#else
class FlushDenormals {};  // other architectures: IEEE denormals (no effect on results)
#endif
