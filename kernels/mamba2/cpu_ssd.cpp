// Mamba2 SSD prefill on CPU, built and called by kernels/native.py: the rule of
// kernels/mamba2/chunk.py per (sequence, group, heads) job, each head's state h [P, S] advanced
// in place.
// Per chunk of c <= L tokens counted from the sequence start (L: the model's chunk size, split
// into SUB-token chunks where it is a multiple of SUB; see below), with a_t = dt_t A (<= 0),
// seg[i, j] = a_{j+1} + ... + a_i (summed over the range, in the torch path's order) and
// acum_i = a_0 + ... + a_i:
//   y_i = sum_{j <= i} (C_i . B_j) exp(seg[i, j]) dt_j x_j + exp(acum_i) h C_i  (+ D x_i)
//   h   = exp(acum_last) h + sum_j exp(seg[last, j]) dt_j x_j B_j^T
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "../denormal.h"
#include "../norm/gated.h"
#include "../prefetch.h"
#include "../state_rows.h"
#include "../widen.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <type_traits>
#include <vector>

#include "../matmul.h"

namespace {

struct Sizes {
  int64_t H, G, P, S, L;
};

// Rows per block of the chunk's causal products (C . B^T, the scores times x): each block stops at
// its last row's token, so a 128-token chunk's products skip the zeros of the top right quarter
// (0.88-0.94x the kernel's time on the AVX2 host; blocks of 32 or 16 rows, more calls, gained less)
constexpr int64_t RB = 64;

// The chunk this kernel runs: the model's chunk size (Mamba2 checkpoints: 128 tokens) sets where
// states are captured, not how the arithmetic is blocked. Chunks of SUB tokens do the same sums
// in another order (the causal products lose their zero upper triangles; the state is passed 4x
// as often at 128): chunk_ssd_slots took 0.85x the time of 128-token chunks (0.90x at 64, 0.93x
// at 16) on NemotronH's heads, 16 sequences of 1,280 tokens, on the AVX2 host.
constexpr int64_t SUB = 32;

// A job keeps each of its heads' states transposed, h^T [S, P], in rows L.. of the head's buffer
// xh [L + S, P], with the chunk's c x rows right above them (rows L - c ..): chunks of up to RB
// tokens (SUB's) make a head's chunk output one product, [scores | C exp(acum)] times [x; h^T], each
// score row (LS wide) with its C exp(acum) row after the scores; longer chunks keep the two products
// (the causal one in row blocks). The states are transposed in and out of the pool once a job (and at
// checkpoints): the same sums in the same order as on [P, S] states, so the same bits.
struct Scratch {
  std::vector<float> xh, xs, B, C, Cs, cb, scores, y, a, acum, seg, dts, v;
  Scratch(const Sizes& s, int64_t heads)
      : xh(heads * (s.L + s.S) * s.P), xs(s.L * s.P), B(s.L * s.S), C(s.L * s.S), Cs(s.L * s.S), cb(s.L * s.L),
        scores(s.L * (s.L + s.S)), y(s.L * s.P), a(s.L), acum(s.L), seg(s.L), dts(s.L), v(s.H * s.P) {}
};

// dst [cols, rows] = src [rows, cols]^T
inline void transpose(const float* src, int64_t rows, int64_t cols, float* dst) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) dst[c * rows + r] = src[r * cols + c];
}

// Mamba2's gated grouped norm on the output rows, in place (gated.h): y = w * norm(y * silu(z)), the
// RMS over each of `groups` channel groups of H * P; z's rows ldz apart (a column range of the projection).
struct GateNorm {
  const float *z, *w;
  int64_t ldz, groups;
  float eps;
};

template <typename T>
struct Inputs {
  const T *x, *B, *C;     // token t's heads at x + t * sx ([H, P] contiguous), its groups at B + t * sb, C + t * sc
  int64_t sx, sb, sc;     // (a column range of the conv output is read in place)
  const float *dt, *A, *D;  // D may be null
};

// The chunk's B and C of group g, and C_i . B_j [c, c] (shared by the group's heads).
template <typename T>
void group_inputs(const Sizes& s, const Inputs<T>& in, int64_t t0, int64_t c, int64_t g, Scratch& w) {
  const int64_t S = s.S;
  float *B = w.B.data(), *C = w.C.data();
  for (int64_t i = 0; i < c; ++i)
    for (int64_t d = 0; d < S; ++d) {
      B[i * S + d] = as_float(in.B[(t0 + i) * in.sb + g * S + d]);
      C[i * S + d] = as_float(in.C[(t0 + i) * in.sc + g * S + d]);
    }
  for (int64_t r0 = 0; r0 < c; r0 += RB) {  // C_i . B_j for j <= i: rows [r0, r1) against the keys up to r1
    const int64_t r1 = std::min(c, r0 + RB);
    mm(false, true, r1 - r0, r1, S, 1.f, C + r0 * S, S, B, S, 0.f, w.cb.data() + r0 * s.L, s.L);
  }
}

// One head's chunk, after group_inputs of its group; xh: the head's buffer (see Scratch).
template <typename T>
void chunk(const Sizes& s, const Inputs<T>& in, T* out, int64_t t0, int64_t c, int64_t hd, float* xh, Scratch& w) {
  const int64_t P = s.P, S = s.S, L = s.L;
  const bool one = c <= RB;           // the output as one product (see Scratch)
  const int64_t LS = one ? c + S : L;  // the score rows' stride
  float *x = xh + (L - c) * P, *hT = xh + L * P;
  float *xs = w.xs.data(), *B = w.B.data(), *C = w.Cs.data(), *sc = w.scores.data();
  float *y = w.y.data(), *a = w.a.data(), *acum = w.acum.data();
  const float A = in.A[hd];
  for (int64_t i = 0; i < c; ++i) {
    const int64_t t = t0 + i;
    for (int64_t p = 0; p < P; ++p) x[i * P + p] = as_float(in.x[t * in.sx + hd * P + p]);
    a[i] = in.dt[t * s.H + hd] * A;
    acum[i] = (i ? acum[i - 1] : 0.f) + a[i];
  }
  // C_i . B_j times exp(seg[i, j]) dt_j below the diagonal, 0 above up to the row's block end, a
  // row at a time: seg[j] holds a_{j+1} + ... + a_i, summed in that order as i grows (the torch path's order)
  float *seg = w.seg.data(), *dts = w.dts.data();
  const float* cb = w.cb.data();
  for (int64_t j = 0; j < c; ++j) dts[j] = in.dt[(t0 + j) * s.H + hd];
  for (int64_t i = 0; i < c; ++i) {
    float* row = sc + i * LS;
    const float* cbi = cb + i * L;
#pragma omp simd
    for (int64_t j = 0; j < i; ++j) seg[j] += a[i];
    seg[i] = 0.f;
#pragma omp simd
    for (int64_t j = 0; j <= i; ++j) row[j] = cbi[j] * (std::exp(seg[j]) * dts[j]);
    std::fill(row + i + 1, row + std::min(c, (i / RB + 1) * RB), 0.f);
  }
  for (int64_t j = 0; j < c; ++j) {  // dt_j exp(seg[last, j]) x_j: into the end state
    const float f = std::exp(seg[j]) * dts[j];
#pragma omp simd
    for (int64_t p = 0; p < P; ++p) xs[j * P + p] = x[j * P + p] * f;
  }
  float* ce = one ? sc + c : C;  // C_i exp(acum_i): after each score row (one product) or rows of its own
  const int64_t lde = one ? LS : S;
  for (int64_t i = 0; i < c; ++i) {
    const float e = std::exp(acum[i]);
    for (int64_t d = 0; d < S; ++d) ce[i * lde + d] = w.C[i * S + d] * e;
  }
  if (one) {  // [scores | C exp(acum)] [x; h^T]: the intra-chunk sums, then the entry state's share
    mm(false, false, c, P, c + S, 1.f, sc, LS, x, P, 0.f, y, P);
  } else {
    for (int64_t r0 = 0; r0 < c; r0 += RB) {  // intra-chunk: rows [r0, r1) against the tokens up to r1 (causal)
      const int64_t r1 = std::min(c, r0 + RB);
      mm(false, false, r1 - r0, P, r1, 1.f, sc + r0 * L, L, x, P, 0.f, y + r0 * P, P);
    }
    mm(false, false, c, P, S, 1.f, C, S, hT, P, 1.f, y, P);  // the entry state's share
  }
  const float total = std::exp(acum[c - 1]);
  for (int64_t k = 0; k < P * S; ++k) hT[k] *= total;
  mm(true, false, S, P, c, 1.f, B, S, xs, P, 1.f, hT, P);  // h^T += B^T (dt exp(seg) x)
  const float Dh = in.D ? in.D[hd] : 0.f;
  for (int64_t i = 0; i < c; ++i) {
    T* o = out + ((t0 + i) * s.H + hd) * P;
    for (int64_t p = 0; p < P; ++p) o[p] = narrow<T>(y[i * P + p] + Dh * x[i * P + p]);
  }
}

// Jobs are (sequence, group, block of the group's heads): each chunk's C . B^T is made once per
// job; the heads are split into blocks only as far as needed to give every thread work.
// With a GateNorm, a job whose heads are whole norm groups norms each chunk's rows of them as soon
// as its heads are done, while they are in cache (the norm's own pass read the round's output back
// from memory); otherwise every row is normed after the jobs.
template <typename T>
void run(const Sizes& s, const Inputs<T>& in, T* op, const std::vector<int64_t>& cu, const std::vector<int64_t>& seqs,
         const Captures& captures, float* sp, const StateRows& where, const GateNorm* norm) {
  const int64_t H = s.H, R = s.H / s.G, PS = s.P * s.S, N = static_cast<int64_t>(seqs.size());
  const int64_t threads = at::get_num_threads();
  const int64_t split = std::clamp<int64_t>((4 * threads + N * s.G - 1) / std::max<int64_t>(N * s.G, 1), 1, R);
  const int64_t per = (R + split - 1) / split, blocks = (R + per - 1) / per, J = N * s.G * blocks;
  const int64_t Dg = norm ? H * s.P / norm->groups : 1;
  const bool in_jobs = norm && R * s.P % Dg == 0 && per * s.P % Dg == 0;  // every job's heads are whole groups
#pragma omp parallel num_threads(std::max<int64_t>(1, std::min(threads, J)))
  {
    FlushDenormals flush;
    Scratch w(s, per);
    const int64_t XH = (s.L + s.S) * s.P;  // a head's buffer
#pragma omp for schedule(dynamic, 1)
    for (int64_t j = 0; j < J; ++j) {  // longest sequences first
      const int64_t n = seqs[j / (s.G * blocks)], g = j / blocks % s.G, h0 = g * R + j % blocks * per;
      const int64_t h1 = std::min(h0 + per, (g + 1) * R);
      const auto& plan = captures[n];
      size_t next = 0;
      float* own = sp + where.seq[n] * H * PS;  // sequence n's states, head by head
      if (where.fresh[n]) std::fill(own + h0 * PS, own + h1 * PS, 0.f);
      auto xh = [&](int64_t hd) { return w.xh.data() + (hd - h0) * XH; };  // head hd's buffer
      auto hT = [&](int64_t hd) { return xh(hd) + s.L * s.P; };            // its transposed state
      for (int64_t hd = h0; hd < h1; ++hd) transpose(own + hd * PS, s.P, s.S, hT(hd));
      for (int64_t t = cu[n]; t < cu[n + 1]; t += s.L) {
        const int64_t c = std::min(s.L, cu[n + 1] - t);
        group_inputs(s, in, t, c, g, w);
        for (int64_t hd = h0; hd < h1; ++hd) chunk(s, in, op, t, c, hd, xh(hd), w);
        if constexpr (std::is_same_v<T, float>) {
          if (in_jobs)
            for (int64_t i = 0; i < c; ++i) {
              const float* z = norm->z + (t + i) * norm->ldz + h0 * s.P;
              if (i + 4 < c) prefetch_bytes(z + 4 * norm->ldz, (h1 - h0) * s.P * sizeof(float));
              float* y = op + (t + i) * H * s.P + h0 * s.P;
              gated_group_row(y, z, norm->w + h0 * s.P, (h1 - h0) * s.P / Dg, Dg, norm->eps, y, w.v.data());
            }
        }
        for (; next < plan.size() && plan[next].first <= t + c - cu[n]; ++next)  // states after this chunk
          for (int64_t hd = h0; hd < h1; ++hd)
            transpose(hT(hd), s.S, s.P, where.ck_rows<float>() + (where.ck[plan[next].second] * H + hd) * PS);
      }
      for (int64_t hd = h0; hd < h1; ++hd) transpose(hT(hd), s.S, s.P, own + hd * PS);
    }
  }
  if constexpr (std::is_same_v<T, float>) {
    if (norm && !in_jobs) gated_group_rows(op, norm->z, norm->ldz, norm->w, norm->groups, norm->eps, cu[N], H * s.P, op);
  }
}

}  // namespace

// x [T, H, P], B, C [T, G, S] (one dtype: fp32 or bf16; each token's [H, P] or [G, S] contiguous,
// the tokens any stride apart: column ranges of the conv output read in place); dt [T, H], A [H],
// D [H] or empty, fp32; state [rows, H, P, S] fp32 contiguous: rows of states (state_rows.h: sequence n's at
// row slots[n], or row n without slots; zeros first where fresh; the checkpoints' into rows
// checkpoint_slots, or returned), advanced in place from the initial to the final states;
// cu_seqlens [N+1] int64; checkpoints [C, 2] int64 rows (sequence, tokens of it consumed: a
// multiple of chunk_size or its length); out: y's [T, H, P] contiguous tensor in x's dtype (a row
// range of a round's output), or empty for a new one. With gate_z [T, H * P] fp32 (unit stride in
// the channels, rows any stride apart: a column range of the projection), norm_w [H * P] fp32 and
// norm_groups dividing H * P, y is returned normed as models/nemotron_h.py's gated norm does it,
// w * norm(y * silu(z)) over each channel group (fp32 x only); gate_z empty: y as it is. Returns
// (y, states [C, H, P, S] fp32, or empty where they went into rows of state).
std::tuple<at::Tensor, at::Tensor> chunk_ssd_slots(const at::Tensor& x, const at::Tensor& dt, const at::Tensor& A,
                                                   const at::Tensor& B, const at::Tensor& C, const at::Tensor& D,
                                                   at::Tensor& state, const at::Tensor& cu_seqlens,
                                                   const at::Tensor& checkpoints, int64_t chunk_size,
                                                   const at::Tensor& slots, const at::Tensor& fresh,
                                                   const at::Tensor& checkpoint_slots, const at::Tensor& out,
                                                   const at::Tensor& gate_z, const at::Tensor& norm_w,
                                                   int64_t norm_groups, double norm_eps) {
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&x, &B, &C})
    TORCH_CHECK(t->dim() == 3 && t->stride(2) == 1 && (t->size(1) == 1 || t->stride(1) == t->size(2)) &&
                    (t->size(0) <= 1 || t->stride(0) >= t->size(1) * t->size(2)),
                "chunk_ssd: x, B, C with each token's heads or groups contiguous");
  TORCH_CHECK(B.sizes() == C.sizes() && B.size(0) == x.size(0) && dt.size(0) == x.size(0), "chunk_ssd: x, dt, B, C of T tokens");
  TORCH_CHECK(x.scalar_type() == B.scalar_type() && B.scalar_type() == C.scalar_type(), "x, B, C share one dtype");
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&dt, &A, &state})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous(), "chunk_ssd: contiguous fp32 dt, A, state");
  TORCH_CHECK(chunk_size > 0, "chunk_ssd: chunk_size > 0");
  // SUB-token chunks where they fall on the model's chunk boundaries (where checkpoints are)
  const Sizes s{x.size(1), B.size(1), x.size(2), B.size(2), chunk_size % SUB == 0 ? SUB : chunk_size};
  auto cu_t = cu_seqlens.to(at::kLong).contiguous();
  std::vector<int64_t> cu(cu_t.data_ptr<int64_t>(), cu_t.data_ptr<int64_t>() + cu_t.numel());
  const int64_t N = static_cast<int64_t>(cu.size()) - 1, H = s.H;
  TORCH_CHECK(state.dim() == 4 && state.size(1) == H && state.size(2) == s.P && state.size(3) == s.S,
              "state [rows, H, P, S]");
  const StateRows where = state_rows(state, N, checkpoints.size(0), slots, fresh, checkpoint_slots, "chunk_ssd");
  const Captures captures = checkpoint_plans(checkpoints, N, "chunk_ssd");
  auto y = out.numel() ? out : at::empty(x.sizes(), x.options());
  TORCH_CHECK(y.sizes() == x.sizes() && y.scalar_type() == x.scalar_type() && y.is_contiguous(),
              "chunk_ssd: out [T, H, P] contiguous in x's dtype");
  auto Df = D.numel() ? D.to(at::kFloat).contiguous() : D;
  GateNorm gate{};
  if (gate_z.numel()) {
    const int64_t HP = H * s.P;
    TORCH_CHECK(x.scalar_type() == at::kFloat && gate_z.scalar_type() == at::kFloat && gate_z.dim() == 2 &&
                    gate_z.size(0) == x.size(0) && gate_z.size(1) == HP && gate_z.stride(1) == 1 &&
                    (gate_z.size(0) <= 1 || gate_z.stride(0) >= HP),
                "chunk_ssd: fp32 x and gate_z [T, H * P] with unit stride in the channels");
    TORCH_CHECK(norm_w.scalar_type() == at::kFloat && norm_w.is_contiguous() && norm_w.numel() == HP,
                "chunk_ssd: norm_w [H * P] fp32");
    TORCH_CHECK(norm_groups > 0 && HP % norm_groups == 0, "chunk_ssd: norm_groups must divide H * P");
    gate = {gate_z.data_ptr<float>(), norm_w.data_ptr<float>(), gate_z.stride(0), norm_groups,
            static_cast<float>(norm_eps)};
  }
  std::vector<int64_t> seqs(N);  // longest first
  std::iota(seqs.begin(), seqs.end(), 0);
  std::stable_sort(seqs.begin(), seqs.end(), [&](int64_t p, int64_t q) { return cu[p + 1] - cu[p] > cu[q + 1] - cu[q]; });
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "chunk_ssd", [&] {
    const Inputs<scalar_t> in{x.data_ptr<scalar_t>(), B.data_ptr<scalar_t>(), C.data_ptr<scalar_t>(),
                              x.stride(0), B.stride(0), C.stride(0),
                              dt.data_ptr<float>(), A.data_ptr<float>(), D.numel() ? Df.data_ptr<float>() : nullptr};
    run(s, in, y.data_ptr<scalar_t>(), cu, seqs, captures, state.data_ptr<float>(), where,
        gate_z.numel() ? &gate : nullptr);
  });
  return {y, where.states};
}

// One SSD decode token per sequence with the states advanced in place: x [N, H, P], dt [N, H],
// A [H], B and C [N, G, S], D [H] or empty, all fp32 contiguous; state [slots, H, P, S] fp32
// read and written at rows `slots` [N] int64. Returns y [N, H, P] fp32; the rule of
// kernels/mamba2/recurrent.py (h = exp(dt A) h + dt x B^T, y = h C + D x).
at::Tensor ssd_step(const at::Tensor& x, const at::Tensor& dt, const at::Tensor& A, const at::Tensor& B,
                    const at::Tensor& C, const at::Tensor& D, at::Tensor& state, const at::Tensor& slots) {
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&x, &dt, &A, &B, &C, &state})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous(), "ssd_step: contiguous fp32 inputs");
  const int64_t N = x.size(0), H = x.size(1), P = x.size(2), G = B.size(1), S = B.size(2), R = H / G;
  TORCH_CHECK(state.size(1) == H && state.size(2) == P && state.size(3) == S, "ssd_step: state [slots, H, P, S]");
  auto sl = slots.to(at::kLong).contiguous();
  auto y = at::empty_like(x);
  const float *xp = x.data_ptr<float>(), *dp = dt.data_ptr<float>(), *ap = A.data_ptr<float>();
  const float *bp = B.data_ptr<float>(), *cp = C.data_ptr<float>();
  const float* Dp = D.numel() ? D.data_ptr<float>() : nullptr;
  const int64_t* sp = sl.data_ptr<int64_t>();
  float *Sp = state.data_ptr<float>(), *yp = y.data_ptr<float>();
  at::parallel_for(0, N * H, 8, [&](int64_t begin, int64_t end) {
    FlushDenormals flush;
    for (int64_t job = begin; job < end; ++job) {
      const int64_t n = job / H, h = job % H, g = h / R;
      const float d = dp[n * H + h], decay = std::exp(d * ap[h]);
      const float *xx = xp + (n * H + h) * P, *bb = bp + (n * G + g) * S, *cc = cp + (n * G + g) * S;
      float* St = Sp + (sp[n] * H + h) * P * S;
      float* yy = yp + (n * H + h) * P;
      for (int64_t i = 0; i < P; ++i) {
        float* row = St + i * S;
        const float dx = d * xx[i];
        float acc = 0.f;
#pragma omp simd reduction(+ : acc)
        for (int64_t j = 0; j < S; ++j) {
          row[j] = decay * row[j] + dx * bb[j];
          acc += row[j] * cc[j];
        }
        yy[i] = Dp ? acc + Dp[h] * xx[i] : acc;
      }
    }
  });
  return y;
}
