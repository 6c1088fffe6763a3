// Where the chunked prefill kernels (kda/cpu_chunk.cpp, mamba2/cpu_ssd.cpp) read and write their
// states: rows of a state tensor [P, ...] (a pool's slots, read and written in place), sequence n
// at row seq[n] (row n when no slots are given), zeroed first where fresh[n]; the state after
// checkpoint i at row ck[i] of ck_rows: the state tensor itself when checkpoint slots are given,
// else a new tensor of the checkpoints' states alone (`states`, returned to the caller); and the
// checkpoints each sequence captures, in order (`checkpoint_plans`). A state kept in bf16 is worked
// on in fp32 (`widen_state`, `store_state`) and rounded to bf16 after every checkpoint step of 64
// tokens (`round_state`): a prefill split into calls at those boundaries, or restored from a
// checkpoint, gives the bits of one call.
#pragma once
#include <torch/extension.h>

#include "widen.h"  // widen_state, store_state, round_state

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <utility>
#include <vector>

// per sequence, (tokens consumed, checkpoint index) of its checkpoints, in order of tokens
using Captures = std::vector<std::vector<std::pair<int64_t, int64_t>>>;

// checkpoints [C, 2] int64 rows (sequence, tokens of it consumed) of N sequences, grouped by sequence
inline Captures checkpoint_plans(const at::Tensor& checkpoints, int64_t N, const char* who) {
  auto ck = checkpoints.to(at::kLong).contiguous();
  const int64_t* ckp = ck.data_ptr<int64_t>();
  Captures captures(N);
  for (int64_t i = 0; i < ck.size(0); ++i) {
    TORCH_CHECK(ckp[2 * i] >= 0 && ckp[2 * i] < N, who, ": a checkpoint's sequence out of range");
    captures[ckp[2 * i]].emplace_back(ckp[2 * i + 1], i);
  }
  for (auto& plan : captures) std::sort(plan.begin(), plan.end());
  return captures;
}

struct StateRows {
  std::vector<int64_t> seq, ck;
  std::vector<uint8_t> fresh;
  at::Tensor states;  // [C, ...] when the checkpoints' states are returned, else empty
  void* ck_base = nullptr;  // row 0 of the checkpoints' rows (the state tensor or `states`)
  template <typename S>
  S* ck_rows() const {
    return static_cast<S*>(ck_base);
  }
};

// slots [N], fresh [N] bool and checkpoint_slots [C] (int64; each may be empty) checked against
// state [P, ...]: rows in range, none written twice.
inline StateRows state_rows(at::Tensor& state, int64_t N, int64_t C, const at::Tensor& slots, const at::Tensor& fresh,
                            const at::Tensor& checkpoint_slots, const char* who) {
  const int64_t P = state.size(0);
  const auto rows = [&](const at::Tensor& t, int64_t n, const char* what) {
    auto c = t.to(at::kLong).contiguous();
    TORCH_CHECK(c.numel() == n, who, ": ", what, " must have ", n, " entries");
    return std::vector<int64_t>(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + n);
  };
  StateRows out;
  if (slots.numel()) {
    out.seq = rows(slots, N, "slots");
  } else {
    TORCH_CHECK(P == N, who, ": one state row per sequence without slots");
    out.seq.resize(N);
    std::iota(out.seq.begin(), out.seq.end(), 0);
  }
  out.fresh.assign(N, 0);
  if (fresh.numel()) {
    auto f = fresh.to(at::kByte).contiguous();
    TORCH_CHECK(f.numel() == N, who, ": fresh must have ", N, " entries");
    std::copy(f.data_ptr<uint8_t>(), f.data_ptr<uint8_t>() + N, out.fresh.begin());
  }
  const bool in_state = checkpoint_slots.numel() > 0;
  auto shape = state.sizes().vec();
  shape[0] = in_state ? 0 : C;
  out.states = at::empty(shape, state.options());
  if (in_state) {
    out.ck = rows(checkpoint_slots, C, "checkpoint_slots");
  } else {
    out.ck.resize(C);
    std::iota(out.ck.begin(), out.ck.end(), 0);
  }
  out.ck_base = in_state ? state.data_ptr() : out.states.data_ptr();
  std::vector<uint8_t> used(P);
  for (int64_t row : out.seq) {
    TORCH_CHECK(row >= 0 && row < P && !used[row], who, ": slots must be distinct rows of state");
    used[row] = 1;
  }
  for (int64_t row : in_state ? out.ck : std::vector<int64_t>{}) {
    TORCH_CHECK(row >= 0 && row < P && !used[row], who, ": checkpoint_slots must be rows of state apart from slots and each other");
    used[row] = 1;
  }
  return out;
}
