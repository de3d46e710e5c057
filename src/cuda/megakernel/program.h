// The decode step as a program for one persistent kernel (step.cuh): the host turns the step's fixed structure
// into operations (an op: what it computes, its inputs and outputs, the counters it waits for and signals) and
// cuts each op into instructions (a slice of its rows), which a schedule deals out to per-SM instruction lists
// once, at load. The kernel interprets them; no grid barrier anywhere:
//   - dependencies go through counters: every instruction of an op adds 1 to the op's counter after its stores
//     are visible; a consumer waits until the counters it reads reach their target for this step. Counters count
//     up across steps (never reset): at step e (0-based, per block) the target is (e + 1) * (instructions of
//     the producer), so no memset node and no floating-point atomics - results are bit-identical run to run;
//   - each SM's list is in op order, so the earliest unfinished instruction of the whole grid never waits
//     (its producers come from earlier ops): with every block resident (one per SM) the program cannot deadlock.
// Plain structs shared by host and device code; the builder is host code (program.cpp).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "cuda/kernels/common.cuh"
#include "util/status.h"

namespace lily::cuda::mk {

enum class Opcode : uint16_t {
  gemv_q4 = 1,   // y[rows] = W x (+ residual), W 4- or 8-bit [rows, cols], x = in, RMSNorm(in) * norm_w or eq 19
  gdn_head = 2,  // the Gated DeltaNet step of (value head, 32-column block) pairs [row_begin, row_end) (eqs 14-18)
  moe_in = 3,    // act[s][i] = silu(G_s x)[i] (U_s x)[i] for the shared expert (s = 0) and the routed ones (eq 24)
  moe_out = 4,   // out[r] = residual[r] + sum_s w_s (D_s act[s])[r] (eqs 24-25)
  attn_part = 5,   // gated attention, eqs 9-11: (kv head, split) units' partial softmax(q K^T) V over their rows
  attn_merge = 6,  // eqs 11-12: the splits merged, times sigmoid(gate); units (query head, 32 dimensions)
};

// The gated attention layer's operands (Opcode::attn_part / attn_merge; eqs 9-12): 16 query heads, 2 kv heads,
// head_dim 256, partial RoPE on the first 64 dimensions, the bf16 K / V caches [max_ctx, 2, 256] of the chain
// (attention.cuh). A step attends over rows 0..*pos; an attn_part unit (kv head m, split s) takes the rows
// [s c, min((s + 1) c, n)) with n = *pos + 1 and c = ceil(n / n_splits) rounded up to 16, as attn_decode does. Rows
// < *pos stream in through the loader's pages (32 rows of one kv head a page, K then V); row *pos is this step's:
// every unit computes its kv head's k and v from the projection, unit s = 0 appends them to the caches.
struct AttnArgs {
  const float* proj = nullptr;    // [nq * 2 * 256 (q | gate per head) + 2 * 256 (k) + 2 * 256 (v)]
  const float* q_norm = nullptr;  // [256]
  const float* k_norm = nullptr;  // [256]
  __nv_bfloat16* k_cache = nullptr;
  __nv_bfloat16* v_cache = nullptr;
  const int* pos = nullptr;  // device: this token's position
  float* part_o = nullptr;   // [n_splits, nq, 256]: unnormalised partial outputs
  float* part_ml = nullptr;  // [n_splits, nq, 2]: the partials' max (natural-log units) and sum of exp
  int n_splits = 1;
  float rope_theta = 1e7f;
  float eps = 1e-6f;
};
constexpr int kAttnQHeads = 16, kAttnKvHeads = 2, kAttnDim = 256, kAttnRotary = 64;

// The Gated DeltaNet step's operands (Opcode::gdn_head): d_k = d_v = 128, conv kernel 4. An instruction's unit is
// one 32-column block of a value head (the delta rule's columns are independent): its slice of the state S[h]
// (128 rows x 32 columns fp32, 16 KB) is read by the consumers themselves before they wait for their input (no op
// of the step writes it but this one). The op writes o = S^T q_hat (eq 18); eq 19's gated norm is the
// out-projection's prologue (OpFlags::kGatedNorm), which reads every column of a head anyway.
struct GdnArgs {
  const float* proj = nullptr;     // [conv_dim (q|k|v) + value_dim (z) + n_v (b) + n_v (a)]: the in-projection
  float* conv_ring = nullptr;      // [4, conv_dim]: pre-conv vectors, position p in slot p % 4
  const float* conv_w = nullptr;   // [conv_dim, 4]
  const float* A_log = nullptr;    // [n_v]
  const float* dt_bias = nullptr;  // [n_v]
  float* S = nullptr;              // [n_v, d_k, d_v] fp32
  const int* pos = nullptr;        // device: this token's position
  int n_k = 16, n_v = 32;
};

// The MoE block's operands (Opcode::moe_in / moe_out). Slot 0 is the shared expert, slots 1..top_k the routed
// experts in rank order. The selection (eq 22) is taken from the router's logits by every block that needs it, with
// the chain's code (moe.cuh warp_route_top_k: the same experts, ties to the lower index): by the loader warp, which
// only then knows which expert's weights to fetch, and by moe_out's consumers for the routing weights.
struct MoeArgs {
  QMatrix gate, up, down;        // stacked [E, I, H], [E, I, H], [E, H, I], 4-bit
  QMatrix s_gate, s_up, s_down;  // the shared expert's [I, H], [I, H], [H, I]
  const float* logits = nullptr;  // [E + 1]: the router's logits, then the shared expert gate's logit
  int router_op = -1;             // the op that writes them
  uint32_t router_signals = 0;    // its instructions (set by the schedule)
  int n_experts = 0, top_k = 8, inter = 512;
};

enum OpFlags : uint16_t {
  kRmsNorm = 1,   // x = in / RMS(in) * norm_w (eqs 1-2, multiplier form)
  kResidual = 2,  // y = residual + W x (residual may alias y)
  kGatedNorm = 4, // x = norm_w * in / RMS(in over its head of kGdnDim columns) * silu(gate) (eq 19)
};

constexpr int kMaxWaits = 2;

// One operation of the step: everything its instructions share.
struct Op {
  Opcode code = Opcode::gemv_q4;
  uint16_t flags = 0;
  QMatrix m;                      // gemv_q4
  GdnArgs gdn;                    // gdn_head; out = o [n_v * d_v] before eq 19
  AttnArgs attn;                  // attn_part (out: part_o / part_ml), attn_merge (out: [16 * 256])
  MoeArgs moe;                    // moe_in (in: h, out: act [(top_k + 1) * I]), moe_out (in: act, residual: h)
  const float* in = nullptr;      // [cols]
  const float* norm_w = nullptr;  // [cols] (kRmsNorm), [kGdnDim] (kGatedNorm)
  const float* gate = nullptr;    // [cols] (kGatedNorm): z
  float eps = 1e-6f;
  const float* residual = nullptr;  // [rows] (kResidual)
  float* out = nullptr;             // [rows]
  int wait[kMaxWaits] = {-1, -1};   // counters this op reads (-1: none)
  uint32_t wait_count[kMaxWaits] = {0, 0};  // signals per step on each
  int signal = -1;                           // the counter of this op's output
};

// One instruction: rows [row_begin, row_end) of op `op`.
struct Instr {
  int op = 0;
  int row_begin = 0;
  int row_end = 0;
};

// What the kernel reads (device pointers).
struct ProgramView {
  const Op* ops = nullptr;
  const Instr* instrs = nullptr;   // all SMs' lists back to back
  const int* list_begin = nullptr; // [n_blocks + 1]: block b runs instrs[list_begin[b] .. list_begin[b + 1])
  unsigned long long* counters = nullptr;  // [n_counters], monotonic
  unsigned long long* epochs = nullptr;    // [n_blocks]: steps each block has run
  // Optional instruction timeline: [instrs][kTraceMarks] %globaltimer ns of the last step (null: off).
  unsigned long long* trace = nullptr;
  int n_blocks = 0;
};

// The timeline's marks per instruction (thread 0 of the block): start (before the input wait), inputs ready, x
// built, its own pages done, every consumer warp done, counter signalled; and the ns it waited for pages.
constexpr int kTraceMarks = 7;

// The rows one instruction covers are a multiple of this for a gemv of `cols` (a warp's rows in a page).
int gemv_row_quantum(int cols, int bits = 4);
// moe_in's rows are (slot, row) pairs, 16 to a page (gate and up rows: 36 KB); moe_out's rows are 8 to a page
// (the 9 slots' down rows).
constexpr int kMoeInRowsPerPage = 16;
constexpr int kMoeOutRowsPerPage = 8;
constexpr int kGdnDim = 128;  // d_k = d_v of the gdn_head op
constexpr int kGdnCols = 32;  // the columns of a value head's state one gdn_head unit steps

// The host side: ops added in step order, then a schedule for n_blocks SMs, uploaded once.
class Program {
 public:
  // Adds y = W x (+ residual) reading `waits` (ops whose outputs this one reads); returns its op id. W must be
  // 4-bit with cols 2048 or 4096, its scales and biases 16-byte aligned.
  Result<int> add_gemv(const QMatrix& m, const float* in, float* out, std::vector<int> waits,
                       const float* norm_w = nullptr, float eps = 1e-6f, const float* residual = nullptr);
  // y = W x (+ residual) with x = eq 19's gated norm of `o` (heads of kGdnDim columns) by `z` and norm_w [kGdnDim]:
  // the Gated DeltaNet layer's out-projection. W must be 4-bit with 4096 columns.
  Result<int> add_gated_gemv(const QMatrix& m, const float* o, const float* z, const float* norm_w, float* out,
                             std::vector<int> waits, const float* residual = nullptr, float eps = 1e-6f);


  // Deals every op's rows to n_blocks lists (each op cut into at most n_blocks slices of whole row quanta,
  // the larger slices rotated over the blocks from op to op so the bytes per block even out).
  Status schedule(int n_blocks);

  const std::vector<Op>& ops() const { return ops_; }
  const std::vector<Instr>& instrs() const { return instrs_; }
  const std::vector<int>& list_begin() const { return list_begin_; }
  // Instructions that signal op i's counter in one step.
  uint32_t signals_per_step(int op) const { return signals_[op]; }
  // Weight bytes block b streams in one step.
  size_t block_bytes(int b) const;
  std::string describe() const;  // one line per block: instructions and bytes
  // A timeline (DeviceProgram::trace) summed per op: the mean wait, x and page time of its instructions, and
  // when the op's last instruction finished and the next op's first input wait returned.
  std::string summarize_trace(const std::vector<unsigned long long>& marks) const;
  // The same timeline by label (label_op; unlabelled ops by opcode: "gemv", "gdn_head", "attn_part", ...): per
  // label its ops and instructions, the mean input wait, x and page time of an instruction, and its share of the
  // step: the sum over its ops of (the op's last instruction done - the op before's), so the shares add up to the
  // step's span from the first instruction's start to the last one's signal. Sets *span_us when given.
  std::string summarize_trace_by_label(const std::vector<unsigned long long>& marks, double* span_us = nullptr) const;
  void label_op(int op, std::string label);
  std::string label_of(int op) const;

  // Adds the MoE block (eqs 20-25) on the residual stream h [H] in place: the router (8-bit [E + 1, H], the router's
  // rows then the shared expert gate's row, RMSNorm(h) * norm_w as input) writing `logits` [E + 1], moe_in writing
  // `act` [(top_k + 1) * I] and moe_out adding the experts' outputs to h. `h_op` is the op that wrote h this step
  // (-1: none). Returns moe_out's op id (the next reader of h waits for it).
  Result<int> add_moe(const QMatrix& router, MoeArgs moe, float* h, const float* norm_w, float* logits, float* act,
                      int h_op, float eps = 1e-6f);

  // Adds the gated attention of one token (attn_part over the kv heads' splits, then attn_merge), reading the
  // in-projection op `in_proj` (-1: none, for op tests), writing softmax(q K^T / 16) V * sigmoid(gate) to out
  // [16 * 256] (the out-projection's input). Returns attn_merge's op id. Up to 132 splits.
  Result<int> add_attention(const AttnArgs& a, float* out, int in_proj);

  // Adds the Gated DeltaNet step of every value head (n_v * kGdnDim / kGdnCols units: a head's 32-column blocks),
  // reading the in-projection op `in_proj` (-1: none, for op tests), writing o = S^T q_hat (eq 18, before eq 19's
  // gated norm: add_gated_gemv) to out [n_v * 128].
  Result<int> add_gdn_heads(const GdnArgs& g, float* out, int in_proj);

 private:
  std::vector<Op> ops_;
  std::vector<Instr> instrs_;
  std::vector<int> list_begin_;
  std::vector<uint32_t> signals_;
  std::vector<std::string> labels_;  // by op ("" : the opcode's name)
};

size_t instr_weight_bytes(const Op& op, const Instr& in);

}  // namespace lily::cuda::mk
