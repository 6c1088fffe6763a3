// The small row-major matmul the compiled CPU kernels share (defined in native.cpp):
// C [M, N] = alpha op(A) op(B) + beta C, op(A) [M, K] (A stored [K, M] when ta), op(B) [K, N]
// (B stored [N, K] when tb). Small products go to gemm/small.h's register tiles on AVX-512 and AVX2 CPUs,
// the others to the sgemm of the BLAS torch is linked with (MKL on x86 builds) where there is one;
// else plain loops (also after matmul_fast(false), for the tests).
#pragma once
#include <cstdint>

void mm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda, const float* B,
        int64_t ldb, float beta, float* C, int64_t ldc);
