// Causal depthwise conv1d over packed varlen input with conv states (prefill), built and called
// by kernels/native.py; the contract of kernels/conv1d/torch.py's causal_conv1d. Each token's
// window reads the tokens before it in its own sequence and, for the first W-1 tokens, the
// sequence's conv state (the W-1 inputs before it, oldest first). fp32 accumulation; the
// output is written in the input's dtype.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "../act.h"
#include "../state_rows.h"
#include "../prefetch.h"
#include "../widen.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

// input u of sequence n at offset r from its start (r may be negative, down to -(W-1): the state);
// x's rows are ld apart
template <typename T>
inline float input(const T* x, int64_t ld, const float* state, int64_t D, int64_t W, int64_t start, int64_t n,
                   int64_t r, int64_t d) {
  return r >= 0 ? as_float(x[(start + r) * ld + d]) : state[(n * D + d) * (W - 1) + (W - 1 + r)];
}

// Channel d of a whole window: the bias, then the W taps of the input rows at x, x + ld, ...
// (oldest first) as explicit fmas in order, as conv()'s general loop adds them (under -ffast-math
// a plain sum of the taps is regrouped into a tree), so both give the same bits.
template <int W, typename T>
inline float taps(const T* x, int64_t ld, const float* wT, const float* bias, int64_t D, int64_t d) {
  float acc = bias[d];
  for (int w = 0; w < W; ++w) acc = std::fma(wT[w * D + d], as_float(x[w * ld + d]), acc);
  return acc;
}

// y's row from a whole window of W input rows: every channel's taps summed in registers, one pass
// over the row (not one per tap, through a buffer)
template <int W, typename T>
inline void window(const T* x, int64_t ld, const float* wT, const float* bias, int64_t D, bool silu, T* y) {
  if (silu) {
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) {
      const float acc = taps<W>(x, ld, wT, bias, D, d);
      y[d] = narrow<T>(act::silu(acc));
    }
  } else {
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) y[d] = narrow<T>(taps<W>(x, ld, wT, bias, D, d));
  }
}

template <typename T>
void conv(const T* x, int64_t ld, const float* wT, const float* bias, const float* state,
          const std::vector<int64_t>& cu, int64_t D, int64_t W, bool silu, T* y) {
  const int64_t N = static_cast<int64_t>(cu.size()) - 1, T_ = cu.back();
  std::vector<int64_t> seq_of(T_);
  for (int64_t n = 0; n < N; ++n) std::fill(seq_of.begin() + cu[n], seq_of.begin() + cu[n + 1], n);
  const std::vector<float> zeros(bias ? 0 : D, 0.f);
  const float* b0 = bias ? bias : zeros.data();  // 0 + w x is w x exactly: the same sums as without a bias
  at::parallel_for(0, T_, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(D);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n = seq_of[t], r = t - cu[n];  // offset in its sequence
      T* yr = y + t * D;
      if (t + 8 < T_) prefetch_bytes(x + (t + 8) * ld, D * sizeof(T));  // a column range: rows ld apart
      if (r >= W - 1 && W == 4) {  // a whole window inside x (W = 4: Qwen3-Next, Kimi Linear, NemotronH)
        window<4>(x + (t - 3) * ld, ld, wT, b0, D, silu, yr);
        continue;
      }
      std::copy(b0, b0 + D, acc.begin());
      for (int64_t w = 0; w < W; ++w) {  // tap w reads offset r - (W-1) + w
        const int64_t src = r - (W - 1) + w;
        const float* wr = wT + w * D;
        if (src >= 0) {
          const T* xr = x + (cu[n] + src) * ld;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) acc[d] = std::fma(wr[d], as_float(xr[d]), acc[d]);
        } else {
          for (int64_t d = 0; d < D; ++d) acc[d] = std::fma(wr[d], input(x, ld, state, D, W, cu[n], n, src, d), acc[d]);
        }
      }
      if (silu) {
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) yr[d] = narrow<T>(act::silu(acc[d]));
      } else {
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) yr[d] = narrow<T>(acc[d]);
      }
    }
  });
}

}  // namespace

namespace {

// causal_conv1d (below) into out: y's [T, D] contiguous tensor in x's dtype, or empty for a new one
std::tuple<at::Tensor, at::Tensor> conv_into(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                                             const at::Tensor& state, const at::Tensor& cu_seqlens,
                                             const at::Tensor& at_rows, bool silu, const at::Tensor& out) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "causal_conv1d: x [T, D] with unit stride in D");
  TORCH_CHECK(weight.scalar_type() == at::kFloat && state.scalar_type() == at::kFloat && state.is_contiguous(),
              "causal_conv1d: fp32 weight and contiguous fp32 state");
  const int64_t D = x.size(1), W = weight.size(1);
  auto cu_t = cu_seqlens.to(at::kLong).contiguous();
  std::vector<int64_t> cu(cu_t.data_ptr<int64_t>(), cu_t.data_ptr<int64_t>() + cu_t.numel());
  const int64_t N = static_cast<int64_t>(cu.size()) - 1;
  TORCH_CHECK(state.size(0) == N && state.size(1) == D && state.size(2) == W - 1, "state [N, D, W-1]");
  auto wT = weight.t().contiguous();  // [W, D]
  auto b = bias.numel() ? bias.to(at::kFloat).contiguous() : bias;
  auto y = out.defined() && out.numel() ? out : at::empty({x.size(0), D}, x.options());
  TORCH_CHECK(y.dim() == 2 && y.size(0) == x.size(0) && y.size(1) == D && y.scalar_type() == x.scalar_type() &&
                  y.is_contiguous(),
              "causal_conv1d: out [T, D] contiguous in x's dtype");
  const int64_t ld = x.stride(0);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "causal_conv1d", [&] {
    conv<scalar_t>(x.data_ptr<scalar_t>(), ld, wT.data_ptr<float>(), bias.numel() ? b.data_ptr<float>() : nullptr,
                   state.data_ptr<float>(), cu, D, W, silu, y.data_ptr<scalar_t>());
  });
  auto rows = at_rows.to(at::kLong).contiguous();
  const int64_t C = rows.size(0);
  auto states = at::empty({N + C, D, W - 1}, state.options());
  float* sp = states.data_ptr<float>();
  const int64_t* rp = rows.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "conv_states", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const float* s0 = state.data_ptr<float>();
    for (int64_t i = 0; i < N + C; ++i) {  // the W-1 inputs before offset `len` of sequence n
      const int64_t n = i < N ? i : rp[2 * (i - N)];
      const int64_t len = i < N ? cu[n + 1] - cu[n] : rp[2 * (i - N) + 1];
      for (int64_t d = 0; d < D; ++d)
        for (int64_t j = 0; j < W - 1; ++j)
          sp[(i * D + d) * (W - 1) + j] = input(xp, ld, s0, D, W, cu[n], n, len - (W - 1) + j, d);
    }
  });
  return {y, states};
}

}  // namespace

// x [T, D] (fp32 or bf16, unit stride in D: a column range of a wider projection is read in place); weight [D, W] fp32; bias [D] fp32 or empty; state
// [N, D, W-1] fp32 contiguous (each sequence's initial conv state); cu_seqlens [N+1] int64;
// at [C, 2] int64 rows (sequence, tokens of it consumed). Returns (y [T, D] in x's dtype,
// states [N + C, D, W-1] fp32: each sequence's final conv state, then the state at each row of at).
std::tuple<at::Tensor, at::Tensor> causal_conv1d(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                                                 const at::Tensor& state, const at::Tensor& cu_seqlens,
                                                 const at::Tensor& at_rows, bool silu) {
  return conv_into(x, weight, bias, state, cu_seqlens, at_rows, silu, at::Tensor());
}

// causal_conv1d with the conv states in a pool, read and written in place: state [P, D, W-1]
// (fp32 or bf16, contiguous), sequence n's initial state in row slots[n] (zeros where fresh[n]),
// its final state written there (rounded to the pool's dtype, as a copy into it rounds), and the
// state at each row i of at into row checkpoint_slots[i]. Returns y [T, D] in x's dtype, written
// into out where out is not empty (a row range of a round's output, as conv_into takes it).
at::Tensor causal_conv1d_slots(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                               at::Tensor& state, const at::Tensor& slots, const at::Tensor& fresh,
                               const at::Tensor& cu_seqlens, const at::Tensor& at_rows,
                               const at::Tensor& checkpoint_slots, bool silu, const at::Tensor& out) {
  TORCH_CHECK(state.is_contiguous() && state.dim() == 3 &&
                  (state.scalar_type() == at::kFloat || state.scalar_type() == at::kBFloat16),
              "causal_conv1d_slots: contiguous fp32 or bf16 state [P, D, W-1]");
  const int64_t D = x.size(1), W = weight.size(1), L = D * (W - 1);
  const int64_t N = cu_seqlens.numel() - 1, C = at_rows.size(0);
  TORCH_CHECK(state.size(1) == D && state.size(2) == W - 1, "causal_conv1d_slots: state [P, D, W-1]");
  TORCH_CHECK(checkpoint_slots.numel() == C, "causal_conv1d_slots: one checkpoint slot per row of at");
  const StateRows where = state_rows(state, N, C, slots, fresh, checkpoint_slots, "causal_conv1d_slots");
  auto s0 = at::zeros({N, D, W - 1}, state.options().dtype(at::kFloat));  // the initial states, widened
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, state.scalar_type(), "conv_slots", [&] {
    const scalar_t* pool = state.data_ptr<scalar_t>();
    float* dst = s0.data_ptr<float>();
    for (int64_t n = 0; n < N; ++n)
      if (!where.fresh[n])
        for (int64_t i = 0; i < L; ++i) dst[n * L + i] = as_float(pool[where.seq[n] * L + i]);
  });
  auto [y, states] = conv_into(x, weight, bias, s0, cu_seqlens, at_rows, silu, out);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, state.scalar_type(), "conv_slots", [&] {
    const float* src = states.data_ptr<float>();
    scalar_t* pool = state.data_ptr<scalar_t>();
    for (int64_t i = 0; i < N + C; ++i) {
      scalar_t* row = pool + (i < N ? where.seq[i] : where.ck[i - N]) * L;
      for (int64_t j = 0; j < L; ++j) row[j] = narrow<scalar_t>(src[i * L + j]);
    }
  });
  return y;
}

namespace {

template <typename T, typename S>
void conv_step_impl(const T* x, int64_t ld, const float* w, const float* bias, S* state, const int64_t* slots,
                    int64_t N, int64_t D, int64_t W, bool silu, T* y) {
  const int64_t L = D * (W - 1);  // a slot's windows, channel by channel
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(D), win(std::is_same_v<S, float> ? 0 : L);
    for (int64_t n = begin; n < end; ++n) {
      S* st = state + slots[n] * L;
      const T* xn = x + n * ld;
      T* yn = y + n * D;
      // bf16 windows widened to fp32 in one contiguous pass, the strided per-channel reads below
      // then from that buffer (reading and shifting them in place channel by channel, as strided
      // 2-byte loads and stores, took 1.6-1.7x as long at 768-1,280 channels); fp32 ones read in place
      const float* wins = win.data();
      if constexpr (std::is_same_v<S, float>) {
        wins = st;
      } else {
#pragma omp simd
        for (int64_t i = 0; i < L; ++i) win[i] = as_float(st[i]);
      }
      if (W == 4) {  // the common width, channels as vectors
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) {
          const float* s = wins + d * 3;
          const float* wd = w + d * 4;
          const float a = s[0] * wd[0] + s[1] * wd[1] + s[2] * wd[2] + as_float(xn[d]) * wd[3];
          acc[d] = bias ? a + bias[d] : a;
        }
      } else {
        for (int64_t d = 0; d < D; ++d) {
          const float* s = wins + d * (W - 1);  // the W-1 inputs before this token, oldest first
          const float* wd = w + d * W;
          float a = 0.f;
          for (int64_t j = 0; j < W - 1; ++j) a += s[j] * wd[j];
          a += as_float(xn[d]) * wd[W - 1];
          acc[d] = bias ? a + bias[d] : a;
        }
      }
      // each window shifted by this token: the slot's elements move one place down, and each
      // window's newest element becomes the token
      if (L > 1) std::memmove(st, st + 1, (L - 1) * sizeof(S));
      if (W > 1)
        for (int64_t d = 0; d < D; ++d) st[d * (W - 1) + W - 2] = narrow<S>(as_float(xn[d]));
      if (silu) {  // a second pass, so the exps run as vectors
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) acc[d] = act::silu(acc[d]);
      }
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) yn[d] = narrow<T>(acc[d]);
    }
  });
}

}  // namespace

// One decode token per sequence with the conv states advanced in place: x [N, D] (fp32 or bf16,
// unit stride in D); weight [D, W] fp32; bias [D] fp32 or empty; state [slots, D, W-1] (fp32 or bf16,
// contiguous) read and written at rows `slots` [N] int64. Returns y [N, D] in x's dtype; the
// contract of kernels/conv1d/torch.py's causal_conv1d_update.
at::Tensor conv_step(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, at::Tensor& state,
                     const at::Tensor& slots, bool silu) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "conv_step: x [N, D] with unit stride in D");
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous(), "conv_step: contiguous fp32 weight");
  TORCH_CHECK(state.is_contiguous() && state.dim() == 3, "conv_step: contiguous state [slots, D, W-1]");
  const int64_t N = x.size(0), D = x.size(1), W = weight.size(1);
  TORCH_CHECK(weight.size(0) == D && state.size(1) == D && state.size(2) == W - 1, "conv_step: state [slots, D, W-1]");
  auto sl = slots.to(at::kLong).contiguous();
  auto y = at::empty({N, D}, x.options());
  const int64_t ld = x.stride(0);
  const float* bp = bias.numel() ? bias.data_ptr<float>() : nullptr;
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "conv_step", [&] {
    using T = scalar_t;
    if (state.scalar_type() == at::kFloat) {
      conv_step_impl<T, float>(x.data_ptr<T>(), ld, weight.data_ptr<float>(), bp, state.data_ptr<float>(),
                               sl.data_ptr<int64_t>(), N, D, W, silu, y.data_ptr<T>());
    } else {
      TORCH_CHECK(state.scalar_type() == at::kBFloat16, "conv_step: fp32 or bf16 state");
      conv_step_impl<T, c10::BFloat16>(x.data_ptr<T>(), ld, weight.data_ptr<float>(), bp,
                                       state.data_ptr<c10::BFloat16>(), sl.data_ptr<int64_t>(), N, D, W, silu,
                                       y.data_ptr<T>());
    }
  });
  return y;
}
