// Chunkwise gated delta rule (KDA and GDN prefill) on CPU, built and called by kernels/native.py:
// the rule of kernels/kda/chunk.py computed per (sequence, value head) job, the state advanced in
// place. Per chunk (CHUNK tokens; the 64-token steps the states are checkpointed and rounded at
// are two of them), with S the K x V state at the chunk start and G the in-chunk
// cumulative log decay (each token's log decay clamped at min_log_decay, as the torch path does):
//   A_kk[i, j] = sum_d k_i[d] k_j[d] exp(G_i[d] - G_j[d])         (j < i)
//   A_qk[i, j] = scale sum_d q_i[d] k_j[d] exp(G_i[d] - G_j[d])   (j <= i)
//   D = (I + diag(beta) A_kk)^-1 diag(beta) (V - K exp(G) S)          (forward substitution)
//   O = scale (Q exp(G)) S + A_qk D;   S = exp(G_last) S + (K exp(G_last - G))^T D
// D is the torch path's U - W S of the WY form ([U | W] = (I + diag(beta) A_kk)^-1 diag(beta)
// [V | K exp(G)]) with the state folded in before the solve: chunk by chunk, S is known there,
// so the substitution runs over V columns instead of V + K and W is never formed.
// KDA's pairs are factored so that no factor leaves fp32's normal range: through one reference
// per channel where the channel's decay over the chunk is within NEAR (factored()), else through
// reference tokens close enough (pairs()). The last chunk of a sequence is just shorter (no
// padding).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "../denormal.h"
#include "../state_rows.h"
#include "../widen.h"

#include "../matmul.h"

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <vector>

namespace {

// exp(x) with x floored at -87: below it the result is under fp32's smallest normal, which the
// products it scales flush to zero anyway (FlushDenormals); the floor keeps the vector exp off
// its slow scalar path for such lanes (strong decays: 1.8x on the whole kernel)
inline float exp_floor(float x) { return std::exp(std::max(x, -87.f)); }

// The chunk the arithmetic runs in, and the 64-token step (GRID: the model's kernel chunk) where
// states are captured and a bf16 state is rounded. 32-token chunks do the same sums in another
// order (each pair matrix and substitution over half the tokens, the state passed twice as often):
// chunk_delta_rule_slots took 0.85-0.92x the time of 64-token ones on the peer workloads (built-in
// Kimi, Qwen3-Next) on the AVX2 host.
constexpr int64_t CHUNK = 32;
constexpr int64_t GRID = 64;
constexpr int64_t BLK = 16;  // rows per block of the forward substitution
constexpr int64_t PBLK = 8;   // rows per diagonal block of KDA's pair matrices (two halves of 4 inside, see pairs())
constexpr int64_t SBLK = 16;  // rows per product below the diagonal blocks (two of them)


struct Sizes {
  int64_t H, HV, K, V, gK;  // gK: K (KDA, one decay per channel) or 1 (GDN, one per head)
  float scale, min_log_decay;
};

// Row-major C [M, N] = alpha op(A) op(B) + beta C through the BLAS torch is built with
// (op(A) [M, K]: A stored [K, M] when ta; op(B) [K, N]: B stored [N, K] when tb).
// The work buffers of one thread, reused job after job and chunk after chunk.
struct Scratch {
  std::vector<float> k, q, qs, kT, G, kout, kexp, A, A_raw, X, e, R, C, D, P, kc, E, kF, qF, GF;
  std::vector<int64_t> far;
  explicit Scratch(const Sizes& s)
      : k(CHUNK * s.K), q(CHUNK * s.K), qs(CHUNK * s.K), kT(s.gK == 1 ? s.K * CHUNK : 0), G(CHUNK * s.gK),
        kout(CHUNK * s.K), kexp(CHUNK * s.K), A(2 * CHUNK * CHUNK), A_raw(s.gK == 1 ? 2 * CHUNK * CHUNK : 0), X(CHUNK * s.V),
        e(std::max(s.K, CHUNK)), R(2 * SBLK * s.K), C(s.K * CHUNK), D(3 * PBLK * s.K),
        P(s.gK == 1 ? 0 : 2 * CHUNK * s.K), kc(s.gK == 1 ? 0 : CHUNK * s.K), E(s.gK == 1 ? 0 : 4 * s.K),
        kF(s.gK == 1 ? 0 : CHUNK * s.K), qF(s.gK == 1 ? 0 : CHUNK * s.K), GF(s.gK == 1 ? 0 : CHUNK * s.K),
        far(s.gK == 1 ? 0 : s.K) {}
};

template <typename T>
struct Inputs {
  const T *q, *k, *v;
  const float *g, *beta;
};

// A_kk and A_qk for a decay per channel, in blocks of PBLK rows, every decay factored so that
// pairs are dot products (no exp per pair and channel). With each token's log decay clamped at
// min_log_decay (-20), a factor exp(G_i - G_m) over at most two tokens' steps stays within
// e^-40..e^40: a normal float whose products with keys never flush to zero.
//   inside each half (<= 4 rows) of a diagonal block, with m its middle token:
//     exp(G_i - G_j) = x_i / x_j,  x = exp(G - G_m)
//   second half's rows against the first half's columns, split at the first half's last token r:
//     exp(G_i - G_j) = exp(G_i - G_r) exp(G_r - G_j), both <= 1
//   the second diagonal block of each SBLK rows against the first, split at token b0 - 1 the same way
//   below the SBLK rows [b0, b1), columns j < b0, split at token b0 - 1 the same way: one product
//   of scaled rows. Those columns, C_j = k_j exp(G_{b0-1} - G_j), are carried from block to
//   block: the older ones times exp(G_{b0-1} - G_{b0-1-SBLK}) (per channel, <= 1), the previous
//   SBLK keys computed anew.
// A factor that underflows leaves a product below fp32 resolution (both factors are <= 1).

// rows [r0, r1) x columns [c0, c1) of A_kk and A_qk (pairs j <= i only) added from scaled key and query
// rows (kr, qr: row i at (i - r0) * K) and scaled key columns (kc: column j at (j - c0) * K)
void dots(const Sizes& s, const float* kr, const float* qr, const float* kc, int64_t r0, int64_t r1, int64_t c0,
          int64_t c1, float* A_kk, float* A_qk) {
  const int64_t K = s.K;
  for (int64_t i = r0; i < r1; ++i)
    for (int64_t j = c0; j < std::min(c1, i + 1); ++j) {
      const float *ki = kr + (i - r0) * K, *qi = qr + (i - r0) * K, *kj = kc + (j - c0) * K;
      float kk = 0.f, qk = 0.f;
#pragma omp simd reduction(+ : kk, qk)
      for (int64_t d = 0; d < K; ++d) {
        kk += ki[d] * kj[d];
        qk += qi[d] * kj[d];
      }
      A_kk[i * CHUNK + j] += kk;
      A_qk[i * CHUNK + j] += qk * s.scale;
    }
}

// keys [j0, j1) times exp(G_ref - G) into out (key j at (j - j0) * K)
void columns(const Sizes& s, const float* k, const float* G, const float* Gref, int64_t j0, int64_t j1, float* out) {
  const int64_t K = s.K;
  for (int64_t j = j0; j < j1; ++j)
#pragma omp simd
    for (int64_t d = 0; d < K; ++d) out[(j - j0) * K + d] = k[j * K + d] * exp_floor(Gref[d] - G[j * K + d]);
}

// rows [r0, r1) of k and q times exp(G - G_ref) into kr, qr
void scaled(const Sizes& s, const float* k, const float* q, const float* G, const float* Gref, int64_t r0,
            int64_t r1, float* kr, float* qr) {
  const int64_t K = s.K;
  for (int64_t i = r0; i < r1; ++i)
#pragma omp simd
    for (int64_t d = 0; d < K; ++d) {
      const float x = exp_floor(G[i * K + d] - Gref[d]);
      kr[(i - r0) * K + d] = k[i * K + d] * x;
      qr[(i - r0) * K + d] = q[i * K + d] * x;
    }
}

// P [M, N] += alpha A [M, K] (rows K apart) C [K, N] (rows CHUNK apart, N a multiple of 16), P's
// rows CHUNK apart: RB rows by 16 columns at a time, their sums held in registers over K (MKL's
// sgemm took 2.5x as long on these few-row products)
template <int RB>
void rows_times(const float* A, int64_t K, const float* C, int64_t N, float alpha, float* P) {
  for (int64_t j0 = 0; j0 < N; j0 += 16) {
    float acc[RB][16] = {};
    for (int64_t d = 0; d < K; ++d) {
      const float* c = C + d * CHUNK + j0;
      for (int r = 0; r < RB; ++r) {
        const float a = A[r * K + d];
#pragma omp simd
        for (int jj = 0; jj < 16; ++jj) acc[r][jj] += a * c[jj];
      }
    }
    for (int r = 0; r < RB; ++r)
#pragma omp simd
      for (int jj = 0; jj < 16; ++jj) P[r * CHUNK + j0 + jj] += alpha * acc[r][jj];
  }
}

void times_columns(const float* A, int64_t M, int64_t K, const float* C, int64_t N, float alpha, float* P) {
  int64_t i = 0;
  for (; i + 4 <= M; i += 4) rows_times<4>(A + i * K, K, C, N, alpha, P + i * CHUNK);
  switch (M - i) {
    case 3: rows_times<3>(A + i * K, K, C, N, alpha, P + i * CHUNK); break;
    case 2: rows_times<2>(A + i * K, K, C, N, alpha, P + i * CHUNK); break;
    case 1: rows_times<1>(A + i * K, K, C, N, alpha, P + i * CHUNK); break;
    default: break;
  }
}

// rows [r0, r1) against columns [c0, c1) (at most PBLK of each), the decay split at reference
// Gref: exp(G_i - G_j) = exp(G_i - Gref) exp(Gref - G_j), in w.D's scaled rows and columns
void block(const Sizes& s, const float* k, const float* q, const float* G, const float* Gref, int64_t r0, int64_t r1,
           int64_t c0, int64_t c1, Scratch& w, float* A_kk, float* A_qk) {
  float *kr = w.D.data(), *qr = kr + PBLK * s.K, *kc = qr + PBLK * s.K;
  scaled(s, k, q, G, Gref, r0, r1, kr, qr);
  columns(s, k, G, Gref, c0, c1, kc);
  dots(s, kr, qr, kc, r0, r1, c0, c1, A_kk, A_qk);
}

// rows [r0, r1) against columns [c0, r0), the decay split at token r0 - 1: both factors <= 1
void split(const Sizes& s, const float* k, const float* q, const float* G, int64_t r0, int64_t r1, int64_t c0,
           Scratch& w, float* A_kk, float* A_qk) {
  block(s, k, q, G, G + (r0 - 1) * s.K, r0, r1, c0, r0, w, A_kk, A_qk);
}

void pairs(const Sizes& s, const float* k, const float* q, const float* G, int64_t c, Scratch& w) {
  const int64_t K = s.K, HALF = PBLK / 2;
  float *A_kk = w.A.data(), *A_qk = w.A.data() + c * CHUNK, *R = w.R.data(), *C = w.C.data();
  float* e = w.e.data();
  for (int64_t b0 = 0; b0 < c; b0 += PBLK) {  // the diagonal blocks
    const int64_t b1 = std::min(c, b0 + PBLK), n = b1 - b0;
    for (int64_t a0 = b0; a0 < b1; a0 += HALF) {  // the halves: x = exp(G - G_m), pairs x_i / x_j
      const int64_t a1 = std::min(b1, a0 + HALF);
      block(s, k, q, G, G + (a0 + (a1 - a0 - 1) / 2) * K, a0, a1, a0, a1, w, A_kk, A_qk);
    }
    if (n > HALF) split(s, k, q, G, b0 + HALF, b1, b0, w, A_kk, A_qk);  // second half against the first
    if (b0 % SBLK) split(s, k, q, G, b0, b1, b0 - PBLK, w, A_kk, A_qk);  // against the previous diagonal block
  }
  for (int64_t b0 = SBLK; b0 < c; b0 += SBLK) {  // rows [b0, b1) against every column before b0, split at b0 - 1
    const int64_t b1 = std::min(c, b0 + SBLK), n = b1 - b0;
    const float* Gs = G + (b0 - 1) * K;
    if (b0 > SBLK) {  // carried columns: decay them from token b0 - 1 - SBLK on to b0 - 1
      const float* Gp = G + (b0 - 1 - SBLK) * K;
      for (int64_t d = 0; d < K; ++d) {
        const float f = exp_floor(Gs[d] - Gp[d]);
#pragma omp simd
        for (int64_t j = 0; j < b0 - SBLK; ++j) C[d * CHUNK + j] *= f;
      }
    }
    for (int64_t j = b0 - SBLK; j < b0; ++j) {  // the previous SBLK keys, as columns of C [K, CHUNK]
      columns(s, k, G, Gs, j, j + 1, e);
      for (int64_t d = 0; d < K; ++d) C[d * CHUNK + j] = e[d];
    }
    scaled(s, k, q, G, Gs, b0, b1, R, R + n * K);  // R: k rows then q rows, decayed to token b0 - 1
    times_columns(R, n, K, C, b0, 1.f, A_kk + b0 * CHUNK);
    times_columns(R + n * K, n, K, C, b0, s.scale, A_qk + b0 * CHUNK);
  }
}

// The pair matrices and per-token factors for a decay per channel. A channel whose decay over
// the chunk's tokens (G_0 - G_last, the clamped log decays summed) is at most NEAR -- nearly all
// of them: 97% of the built-in Kimi's (chunk, head, channel)s on the peer workload -- factors
// every pair through one reference, the middle of its range: exp(G_i - G_j) = x_i / x_j with
// x = exp(G - G_ref) in e^-NEAR/2..e^NEAR/2, so each factor, and each product of two (above the
// diagonal too, up to e^NEAR), stays a normal float. Those channels' share of A_kk and A_qk is
// one product of scaled rows [K x; Q x scale] against scaled columns K / x, and their per-token
// factors follow from x with a constant per channel: exp(G_i) = x_i exp(G_ref) and
// exp(G_last - G_i) = exp(G_last - G_ref) / x_i -- one exp per token and channel, where pairs()
// and the direct factors take about five. The other channels (zeros in that product) are
// gathered and added by pairs(), their factors taken directly.
constexpr float NEAR = 60.f;

// Writes A_kk and A_qk (whole: above the diagonal, the near channels' products) and the chunk's
// K exp(G) (kexp), Q exp(G) scale (q, raw on entry, in place) and K exp(G_last - G) (kout), c tokens.
void factored(const Sizes& s, const float* k, float* q, const float* G, int64_t c, float* kexp, float* kout,
              Scratch& w) {
  const int64_t K = s.K;
  const float* last = G + (c - 1) * K;
  float *ref = w.E.data(), *now = ref + K, *rest = now + K, *use = rest + K, *P = w.P.data(), *kc = w.kc.data();
  int64_t* far = w.far.data();
  int64_t nf = 0;
  for (int64_t d = 0; d < K; ++d) {
    const bool near = G[d] - last[d] <= NEAR;
    ref[d] = 0.5f * (G[d] + last[d]);
    use[d] = near ? 1.f : 0.f;
    if (!near) far[nf++] = d;
  }
#pragma omp simd
  for (int64_t d = 0; d < K; ++d) {
    now[d] = exp_floor(ref[d]);
    rest[d] = exp_floor(last[d] - ref[d]);
  }
  constexpr float BOUND = NEAR / 2 + 1;  // binds for far channels only, whose x is then unused (times 0)
  for (int64_t i = 0; i < c; ++i) {  // P: K x then Q x scale; kc: K / x
    const float *ki = k + i * K, *qi = q + i * K, *Gi = G + i * K;
    float *kr = P + i * K, *qr = P + (c + i) * K, *kj = kc + i * K;
#pragma omp simd
    for (int64_t d = 0; d < K; ++d) {
      const float x = std::exp(std::clamp(Gi[d] - ref[d], -BOUND, BOUND)), kd = ki[d] * use[d];
      kr[d] = kd * x;
      qr[d] = qi[d] * use[d] * x * s.scale;
      kj[d] = kd / x;
    }
  }
  mm(false, true, 2 * c, c, K, 1.f, P, K, kc, K, 0.f, w.A.data(), CHUNK);  // [A_kk; A_qk] = P kc^T
  if (nf) {  // the far channels' pairs, added
    float *kF = w.kF.data(), *qF = w.qF.data(), *GF = w.GF.data();
    for (int64_t i = 0; i < c; ++i)
      for (int64_t f = 0; f < nf; ++f) {
        kF[i * nf + f] = k[i * K + far[f]];
        qF[i * nf + f] = q[i * K + far[f]];
        GF[i * nf + f] = G[i * K + far[f]];
      }
    Sizes sf = s;
    sf.K = sf.gK = nf;
    pairs(sf, kF, qF, GF, c, w);
  }
  for (int64_t i = 0; i < c; ++i) {
    const float *kr = P + i * K, *qr = P + (c + i) * K, *kj = kc + i * K, *ki = k + i * K, *Gi = G + i * K;
    float *xi = kexp + i * K, *qi = q + i * K, *oi = kout + i * K;
#pragma omp simd
    for (int64_t d = 0; d < K; ++d) {
      xi[d] = kr[d] * now[d];
      qi[d] = qr[d] * now[d];
      oi[d] = kj[d] * rest[d];
    }
    for (int64_t f = 0; f < nf; ++f) {  // the far channels' factors, directly
      const int64_t d = far[f];
      const float at = exp_floor(Gi[d]);
      xi[d] = ki[d] * at;
      qi[d] = w.qF[i * nf + f] * at * s.scale;
      oi[d] = ki[d] * exp_floor(last[d] - Gi[d]);
    }
  }
}

// The chunk's keys and raw queries of key head h as fp32 (w.k, w.q); for a decay per head, also
// the undecayed A_raw = [K; Q] K^T, which every value head of h then decays its own way.
template <typename T>
void keys(const Sizes& s, const Inputs<T>& in, int64_t t0, int64_t c, int64_t h, Scratch& w) {
  const int64_t K = s.K;
  float *k = w.k.data(), *q = w.q.data();
  for (int64_t i = 0; i < c; ++i) {
    const T* kr = in.k + ((t0 + i) * s.H + h) * K;
    const T* qr = in.q + ((t0 + i) * s.H + h) * K;
    for (int64_t d = 0; d < K; ++d) {
      k[i * K + d] = as_float(kr[d]);
      q[i * K + d] = as_float(qr[d]);
    }
  }
  if (s.gK == 1) {  // rows i (keys) and c + i (queries) against the keys j <= i only, BLK rows at a time
    float *kT = w.kT.data(), *A = w.A_raw.data();  // kT: the keys as columns [K, c]
    for (int64_t i = 0; i < c; ++i)
      for (int64_t d = 0; d < K; ++d) kT[d * c + i] = k[i * K + d];
    for (int64_t r0 = 0; r0 < c; r0 += BLK) {
      const int64_t r1 = std::min(c, r0 + BLK);
      mm(false, false, r1 - r0, r1, K, 1.f, k + r0 * K, K, kT, c, 0.f, A + r0 * CHUNK, CHUNK);
      mm(false, false, r1 - r0, r1, K, 1.f, q + r0 * K, K, kT, c, 0.f, A + (c + r0) * CHUNK, CHUNK);
    }
  }
}

// The forward substitution inside a block: X_i = beta_i (X_i - sum over j in [b0, i) of
// A[i, j] X_j) for the rows i of [b0, b1) in order (X [., V], A rows CHUNK apart, beta_i at
// beta[i * bs]), each row's V values held in registers over its j: the loop it stands for (below,
// for other widths) kept X_i in memory and waited on its own stores, the same fused
// multiply-adds in the same order. V = L NV, L the vector's lanes: 16 with AVX-512, 8 with AVX2.
#if defined(__AVX512F__)
struct Lanes {
  using reg = __m512;
  static constexpr int L = 16;
  static reg load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, reg x) { _mm512_storeu_ps(p, x); }
  static reg set1(float a) { return _mm512_set1_ps(a); }
  static reg fnmadd(reg a, reg b, reg c) { return _mm512_fnmadd_ps(a, b, c); }
  static reg mul(reg a, reg b) { return _mm512_mul_ps(a, b); }
};
#elif defined(__AVX2__) && defined(__FMA__)
struct Lanes {
  using reg = __m256;
  static constexpr int L = 8;
  static reg load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, reg x) { _mm256_storeu_ps(p, x); }
  static reg set1(float a) { return _mm256_set1_ps(a); }
  static reg fnmadd(reg a, reg b, reg c) { return _mm256_fnmadd_ps(a, b, c); }
  static reg mul(reg a, reg b) { return _mm256_mul_ps(a, b); }
};
#endif

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
template <int NV>
void substitute_rows(float* X, const float* A, int64_t b0, int64_t b1, const float* beta, int64_t bs) {
  using W = Lanes;
  constexpr int64_t V = W::L * NV;
  for (int64_t i = b0; i < b1; ++i) {
    typename W::reg x[NV];
    for (int n = 0; n < NV; ++n) x[n] = W::load(X + i * V + W::L * n);
    for (int64_t j = b0; j < i; ++j) {
      const auto a = W::set1(A[i * CHUNK + j]);
      for (int n = 0; n < NV; ++n) x[n] = W::fnmadd(a, W::load(X + j * V + W::L * n), x[n]);
    }
    const auto b = W::set1(beta[i * bs]);
    for (int n = 0; n < NV; ++n) W::store(X + i * V + W::L * n, W::mul(x[n], b));
  }
}
#endif

// substitute_rows for V channels; false (nothing done) where V is not 16, 32, 48 or 64, or
// without AVX-512 or AVX2.
inline bool substitute(float* X, int64_t V, const float* A, int64_t b0, int64_t b1, const float* beta, int64_t bs) {
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  constexpr int64_t L = Lanes::L;
  switch (V) {
    case 16: substitute_rows<16 / L>(X, A, b0, b1, beta, bs); return true;
    case 32: substitute_rows<32 / L>(X, A, b0, b1, beta, bs); return true;
    case 48: substitute_rows<48 / L>(X, A, b0, b1, beta, bs); return true;
    case 64: substitute_rows<64 / L>(X, A, b0, b1, beta, bs); return true;
    default: return false;
  }
#else
  return false;
#endif
}

// c tokens from packed row t0 of value head hv, whose key head's keys() are in w: outputs to o
// (fp32 [T, HV, V]), S [K, V] advanced.
template <typename T>
void chunk(const Sizes& s, const Inputs<T>& in, float* o, int64_t t0, int64_t c, int64_t hv, float* S,
           Scratch& w) {
  const int64_t K = s.K, V = s.V, gK = s.gK;
  // k [c, K]; qin [c, K]: the queries, raw until A_qk is formed, then Q exp(G) scale; A [2c, CHUNK]:
  // A_kk then A_qk; X [c, V]: V - K exp(G) S, solved in place into D
  float *k = w.k.data(), *qin = w.qs.data(), *G = w.G.data(), *kout = w.kout.data(), *kexp = w.kexp.data();
  float* A = w.A.data();
  float *X = w.X.data(), *e = w.e.data();
  float *A_kk = A, *A_qk = A + c * CHUNK;
  std::copy(w.q.data(), w.q.data() + c * K, qin);  // raw q until A_qk is formed
  for (int64_t i = 0; i < c; ++i) {  // G = running sum of the clamped log decays; V as fp32
    const T* vr = in.v + ((t0 + i) * s.HV + hv) * V;
    const float* gr = in.g + ((t0 + i) * s.HV + hv) * gK;
    for (int64_t d = 0; d < gK; ++d) G[i * gK + d] = (i ? G[(i - 1) * gK + d] : 0.f) + std::max(gr[d], s.min_log_decay);
    for (int64_t d = 0; d < V; ++d) X[i * V + d] = as_float(vr[d]);
  }
  const float* last = G + (c - 1) * gK;
  if (gK == 1) {  // A = [K; Q] K^T (from keys()), then each pair's decay exp(G_i - G_j), a row at a time
    for (int64_t i = 0; i < c; ++i) {
      std::copy(w.A_raw.data() + i * CHUNK, w.A_raw.data() + i * CHUNK + i + 1, A_kk + i * CHUNK);
      std::copy(w.A_raw.data() + (c + i) * CHUNK, w.A_raw.data() + (c + i) * CHUNK + i + 1, A_qk + i * CHUNK);
    }
    for (int64_t i = 0; i < c; ++i) {
      float *rk = A_kk + i * CHUNK, *rq = A_qk + i * CHUNK;
#pragma omp simd
      for (int64_t j = 0; j <= i; ++j) e[j] = exp_floor(G[i] - G[j]);
#pragma omp simd
      for (int64_t j = 0; j <= i; ++j) {
        rk[j] *= e[j];
        rq[j] *= e[j] * s.scale;
      }
    }
    for (int64_t i = 0; i < c; ++i) {  // K exp(G), Q exp(G) scale, K exp(G_last - G): two exps per token
      const float *ki = k + i * K, now = exp_floor(G[i]), rest = exp_floor(last[0] - G[i]);
      float *xi = kexp + i * K, *qi = qin + i * K, *oi = kout + i * K;
#pragma omp simd
      for (int64_t d = 0; d < K; ++d) {
        xi[d] = ki[d] * now;
        qi[d] *= now * s.scale;
        oi[d] = ki[d] * rest;
      }
    }
  } else {  // per channel: see factored()
    factored(s, k, qin, G, c, kexp, kout, w);
  }
  for (int64_t i = 0; i < c; ++i)  // causal: A_qk is read whole below
    std::fill(A_qk + i * CHUNK + i + 1, A_qk + i * CHUNK + c, 0.f);
  mm(false, false, c, V, K, -1.f, kexp, K, S, V, 1.f, X, V);  // X = V - K exp(G) S
  // forward substitution in blocks of BLK rows: X_b = beta_b (X_b - A_kk[b, :b] X_:b), then inside the block
  for (int64_t b0 = 0; b0 < c; b0 += BLK) {
    const int64_t b1 = std::min(c, b0 + BLK);
    if (b0) mm(false, false, b1 - b0, V, b0, -1.f, A_kk + b0 * CHUNK, CHUNK, X, V, 1.f, X + b0 * V, V);
    if (substitute(X, V, A_kk, b0, b1, in.beta + t0 * s.HV + hv, s.HV)) continue;
    for (int64_t i = b0; i < b1; ++i) {
      float* Xi = X + i * V;
      for (int64_t j = b0; j < i; ++j) {
        const float a = A_kk[i * CHUNK + j];
        const float* Xj = X + j * V;
#pragma omp simd
        for (int64_t d = 0; d < V; ++d) Xi[d] -= a * Xj[d];
      }
      const float b = in.beta[(t0 + i) * s.HV + hv];
#pragma omp simd
      for (int64_t d = 0; d < V; ++d) Xi[d] *= b;
    }
  }
  float* oc = o + (t0 * s.HV + hv) * V;  // X is D now
  const int64_t ldo = s.HV * V;
  mm(false, false, c, V, K, 1.f, qin, K, S, V, 0.f, oc, ldo);        // O = Q exp(G) scale S
  for (int64_t b0 = 0; b0 < c; b0 += BLK) {  //   + A_qk D: BLK rows against the tokens up to their last (causal)
    const int64_t b1 = std::min(c, b0 + BLK);
    mm(false, false, b1 - b0, V, b1, 1.f, A_qk + b0 * CHUNK, CHUNK, X, V, 1.f, oc + b0 * ldo, ldo);
  }
  for (int64_t r = 0; r < K; ++r) {  // S = exp(G_last) S + (K exp(G_last - G))^T D
    const float decay = exp_floor(last[gK == 1 ? 0 : r]);
#pragma omp simd
    for (int64_t d = 0; d < V; ++d) S[r * V + d] *= decay;
  }
  mm(true, false, K, V, c, 1.f, kout, K, X, V, 1.f, S, V);
}

template <typename T, typename S>
void run(const Sizes& s, const Inputs<T>& in, float* o, const std::vector<int64_t>& cu, S* state,
         const Captures& captures, const StateRows& where) {
  // A job is (sequence, key head) and runs the key head's value heads chunk by chunk: each
  // chunk's keys are loaded (and, with a decay per head, [K; Q] K^T formed) once for all of them.
  // An fp32 state is advanced in its row; a bf16 one in an fp32 copy, rounded after every GRID
  // tokens and at the sequence's end (so the bits do not depend on CHUNK).
  constexpr bool f32 = std::is_same_v<S, float>;
  const int64_t N = static_cast<int64_t>(cu.size()) - 1, H = s.H, R = s.HV / s.H, KV = s.K * s.V;
  std::vector<int64_t> jobs(N * H);  // longest sequences first, so the last jobs are short
  std::iota(jobs.begin(), jobs.end(), 0);
  std::stable_sort(jobs.begin(), jobs.end(), [&](int64_t a, int64_t b) {
    return cu[a / H + 1] - cu[a / H] > cu[b / H + 1] - cu[b / H];
  });
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), N * H);
#pragma omp parallel num_threads(threads)
  {
    FlushDenormals flush;
    Scratch w(s);
    std::vector<size_t> next(R);
    std::vector<float> wide(f32 ? 0 : R * KV);
#pragma omp for schedule(dynamic, 1)
    for (int64_t j = 0; j < N * H; ++j) {
      const int64_t n = jobs[j] / H, h = jobs[j] % H;
      const auto& plan = captures[n];
      std::fill(next.begin(), next.end(), 0);
      S* own = state + (where.seq[n] * s.HV + h * R) * KV;  // the states of key head h's value heads
      float* cur;
      if constexpr (f32) {
        cur = own;
        if (where.fresh[n]) std::fill(own, own + R * KV, 0.f);
      } else {
        cur = wide.data();
        widen_state(own, cur, R * KV, where.fresh[n]);
      }
      for (int64_t t = cu[n]; t < cu[n + 1]; t += CHUNK) {
        const int64_t c = std::min(CHUNK, cu[n + 1] - t);
        keys(s, in, t, c, h, w);
        for (int64_t r = 0; r < R; ++r) {
          const int64_t hv = h * R + r;
          float* St = cur + r * KV;
          chunk(s, in, o, t, c, hv, St, w);
          if ((t + c - cu[n]) % GRID == 0 || t + c == cu[n + 1]) round_state<S>(St, KV);
          for (; next[r] < plan.size() && plan[next[r]].first <= t + c - cu[n]; ++next[r])  // states after this chunk
            store_state(St, where.ck_rows<S>() + (where.ck[plan[next[r]].second] * s.HV + hv) * KV, KV);
        }
      }
      if constexpr (!f32) store_state(cur, own, R * KV);
    }
  }
}

}  // namespace

// q, k [T, H, K] and v [T, HV, V] (fp32 or bf16, one dtype, contiguous); g [T, HV, K or 1] and
// beta [T, HV] fp32 contiguous; state [P, HV, K, V] fp32 or bf16 contiguous: rows of states (a bf16
// state is rounded to bf16 after every 64 tokens, see state_rows.h); cu_seqlens
// [N+1] int64; checkpoints [C, 2] int64 rows (sequence, tokens of it consumed: a multiple of 64 or
// its length), sorted by length within a sequence. slots [N] int64: the row of state holding
// sequence n's initial state, advanced in place to its final state (empty: row n); fresh [N]
// bool: sequences that start from zeros instead (empty: none); checkpoint_slots [C] int64: the
// rows to write the state after each checkpoint into (empty: a new tensor). Every row is written
// by one sequence or checkpoint at most. out: o's [T, HV, V] contiguous fp32 tensor (a row range
// of a round's output), or empty for a new one. Returns (o, the checkpoints' states [C, HV, K, V]
// in state's dtype, or an empty tensor where they went into state's rows).
std::tuple<at::Tensor, at::Tensor> chunk_delta_rule_slots(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                          const at::Tensor& g, const at::Tensor& beta, at::Tensor& state,
                                                          const at::Tensor& cu_seqlens, const at::Tensor& checkpoints,
                                                          double scale, double min_log_decay, const at::Tensor& slots,
                                                          const at::Tensor& fresh, const at::Tensor& checkpoint_slots,
                                                          const at::Tensor& out_rows) {
  TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && v.is_contiguous(), "chunk_delta_rule: contiguous q, k, v");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && k.scalar_type() == v.scalar_type(), "q, k, v share one dtype");
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&g, &beta})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous(), "chunk_delta_rule: contiguous fp32 g, beta");
  TORCH_CHECK((state.scalar_type() == at::kFloat || state.scalar_type() == at::kBFloat16) && state.is_contiguous(),
              "chunk_delta_rule: a contiguous fp32 or bf16 state");
  const int64_t T = q.size(0), HV = v.size(1), K = q.size(2), V = v.size(2);
  TORCH_CHECK(HV % q.size(1) == 0, "chunk_delta_rule: value heads a multiple of key heads");
  TORCH_CHECK(min_log_decay >= -20.0, "chunk_delta_rule: min_log_decay >= -20 (pairs() factors over it)");
  const Sizes s{q.size(1), HV, K, V, g.size(2), static_cast<float>(scale), static_cast<float>(min_log_decay)};
  auto cu_t = cu_seqlens.to(at::kLong).contiguous();
  std::vector<int64_t> cu(cu_t.data_ptr<int64_t>(), cu_t.data_ptr<int64_t>() + cu_t.numel());
  const int64_t N = static_cast<int64_t>(cu.size()) - 1;
  TORCH_CHECK(state.dim() == 4 && state.size(1) == HV && state.size(2) == K && state.size(3) == V, "state [P, HV, K, V]");
  const StateRows where = state_rows(state, N, checkpoints.size(0), slots, fresh, checkpoint_slots, "chunk_delta_rule");
  const Captures captures = checkpoint_plans(checkpoints, N, "chunk_delta_rule");
  auto out = out_rows.numel() ? out_rows : at::empty({T, HV, V}, v.options().dtype(at::kFloat));
  TORCH_CHECK(out.dim() == 3 && out.size(0) == T && out.size(1) == HV && out.size(2) == V &&
                  out.scalar_type() == at::kFloat && out.is_contiguous(),
              "chunk_delta_rule: out [T, HV, V] contiguous fp32");
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "chunk_delta_rule", [&] {
    const Inputs<scalar_t> in{q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(),
                              g.data_ptr<float>(), beta.data_ptr<float>()};
    if (state.scalar_type() == at::kFloat)
      run(s, in, out.data_ptr<float>(), cu, state.data_ptr<float>(), captures, where);
    else
      run(s, in, out.data_ptr<float>(), cu, state.data_ptr<c10::BFloat16>(), captures, where);
  });
  return {out, where.states};
}
