// The decode program's builder: ops in step order, cut into slices and dealt to per-SM lists (program.h).
#include "cuda/megakernel/program.h"

#include <algorithm>
#include <cstdio>
#include <map>

namespace lily::cuda::mk {

namespace {

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

}  // namespace

// A page holds 32 rows of 2048 4-bit columns or 16 of 4096 or of 2048 8-bit ones (36 KB with scales and biases);
// its rows are shared by the consumer warps, 2 or 1 rows each (step.cu).
int gemv_row_quantum(int cols, int bits) { return bits == 8 ? 1 : cols == 2048 ? 4 : 2; }

namespace {

int row_quantum(const Op& op) {
  switch (op.code) {
    case Opcode::gdn_head:
    case Opcode::attn_part:
    case Opcode::attn_merge: return 1;
    case Opcode::moe_in: return kMoeInRowsPerPage;
    case Opcode::moe_out: return kMoeOutRowsPerPage;
    default: return gemv_row_quantum(op.m.cols, op.m.bits);
  }
}

}  // namespace

size_t instr_weight_bytes(const Op& op, const Instr& in) {
  const size_t rows = static_cast<size_t>(in.row_end - in.row_begin);
  if (op.code == Opcode::gdn_head) return rows * kGdnDim * kGdnCols * 4;
  if (op.code == Opcode::attn_part || op.code == Opcode::attn_merge) return 0;  // the cache rows depend on *pos
  if (op.code == Opcode::moe_in) return rows * 2 * (op.moe.gate.bytes() / op.moe.gate.rows);
  if (op.code == Opcode::moe_out) return rows * (op.moe.top_k + 1) * (op.moe.down.bytes() / op.moe.down.rows);
  QMatrix slice = op.m;
  slice.rows = in.row_end - in.row_begin;
  return slice.bytes();
}

Result<int> Program::add_gemv(const QMatrix& m, const float* in, float* out, std::vector<int> waits,
                              const float* norm_w, float eps, const float* residual) {
  if (!((m.bits == 4 && (m.cols == 2048 || m.cols == 4096)) || (m.bits == 8 && m.cols == 2048)))
    return invalid_argument("megakernel gemv: %d-bit [%d, %d] (takes 4-bit with 2048 or 4096 columns, 8-bit with 2048)",
                            m.bits, m.rows, m.cols);
  if (m.rows <= 0 || m.rows % gemv_row_quantum(m.cols, m.bits) != 0)
    return invalid_argument("megakernel gemv: %d rows is not a multiple of %d", m.rows,
                            gemv_row_quantum(m.cols, m.bits));
  if (!m.w || !m.scales || !m.biases || !in || !out)
    return invalid_argument("megakernel gemv: null matrix, input or output");
  if (!aligned16(m.w) || !aligned16(m.scales) || !aligned16(m.biases) || !aligned16(in))
    return invalid_argument("megakernel gemv: weights, scales, biases and input must be 16-byte aligned");
  if (waits.size() > static_cast<size_t>(kMaxWaits))
    return invalid_argument("megakernel gemv: waits on %zu ops (at most %d)", waits.size(), kMaxWaits);
  Op op;
  op.code = Opcode::gemv_q4;
  op.flags = static_cast<uint16_t>((norm_w ? kRmsNorm : 0) | (residual ? kResidual : 0));
  op.m = m, op.in = in, op.norm_w = norm_w, op.eps = eps, op.residual = residual, op.out = out;
  const int id = static_cast<int>(ops_.size());
  for (size_t i = 0; i < waits.size(); ++i) {
    if (waits[i] < 0 || waits[i] >= id) return invalid_argument("megakernel gemv: waits on op %d of %d", waits[i], id);
    op.wait[i] = waits[i];
  }
  op.signal = id;
  ops_.push_back(op);
  return id;
}

Result<int> Program::add_gated_gemv(const QMatrix& m, const float* o, const float* z, const float* norm_w, float* out,
                                    std::vector<int> waits, const float* residual, float eps) {
  if (m.bits != 4 || m.cols != 4096)
    return invalid_argument("megakernel gated gemv: %d-bit [%d, %d] (takes 4-bit with 4096 columns)", m.bits, m.rows,
                            m.cols);
  if (!z || !norm_w || !aligned16(z) || !aligned16(norm_w))
    return invalid_argument("megakernel gated gemv: z and norm_w must be non-null and 16-byte aligned");
  ASSIGN_OR_RETURN(const int id, add_gemv(m, o, out, std::move(waits), nullptr, eps, residual));
  ops_[static_cast<size_t>(id)].flags |= kGatedNorm;
  ops_[static_cast<size_t>(id)].norm_w = norm_w;
  ops_[static_cast<size_t>(id)].gate = z;
  return id;
}

Result<int> Program::add_attention(const AttnArgs& a, float* out, int in_proj) {
  if (!a.proj || !a.q_norm || !a.k_norm || !a.k_cache || !a.v_cache || !a.pos || !a.part_o || !a.part_ml || !out)
    return invalid_argument("megakernel attention: a null operand");
  if (!aligned16(a.proj) || !aligned16(a.k_cache) || !aligned16(a.v_cache) || !aligned16(a.q_norm) ||
      !aligned16(a.k_norm))
    return invalid_argument("megakernel attention: the projection, norms and caches must be 16-byte aligned");
  if (a.n_splits < 1 || a.n_splits > 132)
    return invalid_argument("megakernel attention: %d splits (takes 1 to 132)", a.n_splits);
  const int id = static_cast<int>(ops_.size());
  if (in_proj < -1 || in_proj >= id) return invalid_argument("megakernel attention: waits on op %d of %d", in_proj, id);
  Op part;
  part.code = Opcode::attn_part;
  part.attn = a;
  part.m.rows = kAttnKvHeads * a.n_splits;  // units: (kv head, split)
  part.wait[0] = in_proj;
  part.signal = id;
  ops_.push_back(part);
  Op merge;
  merge.code = Opcode::attn_merge;
  merge.attn = a;
  merge.m.rows = kAttnQHeads * (kAttnDim / 32);  // units: (query head, 32 dimensions)
  merge.out = out;
  merge.wait[0] = id;
  merge.signal = id + 1;
  ops_.push_back(merge);
  return id + 1;
}

Result<int> Program::add_gdn_heads(const GdnArgs& g, float* out, int in_proj) {
  if (!g.proj || !g.conv_ring || !g.conv_w || !g.A_log || !g.dt_bias || !g.S || !g.pos || !out)
    return invalid_argument("megakernel gdn: a null operand");
  if (g.n_k <= 0 || g.n_v <= 0 || g.n_v % g.n_k != 0) return invalid_argument("megakernel gdn: %d / %d heads", g.n_v, g.n_k);
  if (!aligned16(g.S)) return invalid_argument("megakernel gdn: the state must be 16-byte aligned");
  const int id = static_cast<int>(ops_.size());
  if (in_proj < -1 || in_proj >= id) return invalid_argument("megakernel gdn: waits on op %d of %d", in_proj, id);
  Op op;
  op.code = Opcode::gdn_head;
  op.gdn = g;
  op.m.rows = g.n_v * (kGdnDim / kGdnCols);  // the schedule cuts "rows": here (value head, column block) units
  op.out = out;
  op.wait[0] = in_proj;
  op.signal = id;
  ops_.push_back(op);
  return id;
}

Result<int> Program::add_moe(const QMatrix& router, MoeArgs moe, float* h, const float* norm_w, float* logits,
                             float* act, int h_op, float eps) {
  const int H = router.cols, I = moe.inter, E = moe.n_experts;
  if (router.bits != 8 || router.rows != E + 1)
    return invalid_argument("megakernel moe: the router must be 8-bit [E + 1 = %d, H], got %d-bit [%d, %d]", E + 1,
                            router.bits, router.rows, router.cols);
  if (H != 2048 || I != 512 || E <= 0 || E > 256 || moe.top_k <= 0 || moe.top_k > 8)
    return invalid_argument("megakernel moe: H %d, I %d, %d experts, top %d (takes H 2048, I 512, <= 256, <= 8)", H, I,
                            E, moe.top_k);
  const QMatrix* in_mats[] = {&moe.gate, &moe.up, &moe.s_gate, &moe.s_up};
  for (const QMatrix* m : in_mats) {
    if (m->bits != 4 || m->rows != I || m->cols != H || !aligned16(m->w) || !aligned16(m->scales) || !aligned16(m->biases))
      return invalid_argument("megakernel moe: gate / up matrices must be 4-bit [%d, %d] per expert, 16-byte aligned", I, H);
  }
  for (const QMatrix* m : {&moe.down, &moe.s_down}) {
    if (m->bits != 4 || m->rows != H || m->cols != I || !aligned16(m->w) || !aligned16(m->scales) || !aligned16(m->biases))
      return invalid_argument("megakernel moe: down matrices must be 4-bit [%d, %d] per expert, 16-byte aligned", H, I);
  }
  if (!h || !norm_w || !logits || !act || !aligned16(act)) return invalid_argument("megakernel moe: a null operand");
  std::vector<int> h_wait;
  if (h_op >= 0) h_wait.push_back(h_op);
  ASSIGN_OR_RETURN(const int router_op, add_gemv(router, h, logits, h_wait, norm_w, eps));
  moe.logits = logits;
  moe.router_op = router_op;
  const int id = static_cast<int>(ops_.size());
  Op in;
  in.code = Opcode::moe_in;
  in.flags = kRmsNorm;
  in.m = moe.gate;  // the x prologue reads its columns
  in.m.rows = (moe.top_k + 1) * I;  // the schedule cuts (slot, row) pairs
  in.moe = moe;
  in.in = h, in.norm_w = norm_w, in.eps = eps, in.out = act;
  in.wait[0] = h_op, in.wait[1] = router_op;
  in.signal = id;
  ops_.push_back(in);
  Op out;
  out.code = Opcode::moe_out;
  out.m = moe.down;
  out.moe = moe;
  out.in = act, out.residual = h, out.out = h;
  out.flags = kResidual;
  out.wait[0] = id, out.wait[1] = router_op;  // h itself is ordered through moe_in's wait on h_op
  out.signal = id + 1;
  ops_.push_back(out);
  return id + 1;
}

Status Program::schedule(int n_blocks) {
  if (n_blocks <= 0) return invalid_argument("megakernel schedule: %d blocks", n_blocks);
  if (ops_.empty()) return invalid_argument("megakernel schedule: no ops");
  std::vector<std::vector<Instr>> lists(static_cast<size_t>(n_blocks));
  signals_.assign(ops_.size(), 0);
  int rotate = 0;
  for (size_t o = 0; o < ops_.size(); ++o) {
    const Op& op = ops_[o];
    const int quantum = row_quantum(op);
    const int quanta = op.m.rows / quantum;
    const int slices = std::min(quanta, n_blocks);
    // Slice s gets quanta/slices quanta, the first quanta%slices one more; slice s goes to block
    // (rotate + s) % n_blocks, and rotate moves past the larger slices so the next op's larger ones land elsewhere.
    const int base = quanta / slices, extra = quanta % slices;
    int row = 0;
    for (int s = 0; s < slices; ++s) {
      const int rows = (base + (s < extra ? 1 : 0)) * quantum;
      lists[static_cast<size_t>((rotate + s) % n_blocks)].push_back({static_cast<int>(o), row, row + rows});
      row += rows;
    }
    rotate = (rotate + (extra > 0 ? extra : slices)) % n_blocks;
    signals_[o] = static_cast<uint32_t>(slices);
  }
  for (Op& op : ops_) {
    for (int i = 0; i < kMaxWaits; ++i) op.wait_count[i] = op.wait[i] >= 0 ? signals_[op.wait[i]] : 0;
    if (op.moe.router_op >= 0) op.moe.router_signals = signals_[op.moe.router_op];
  }
  instrs_.clear();
  list_begin_.assign(1, 0);
  for (const auto& l : lists) {
    instrs_.insert(instrs_.end(), l.begin(), l.end());
    list_begin_.push_back(static_cast<int>(instrs_.size()));
  }
  return ok_status();
}

size_t Program::block_bytes(int b) const {
  size_t bytes = 0;
  for (int i = list_begin_[b]; i < list_begin_[b + 1]; ++i) bytes += instr_weight_bytes(ops_[instrs_[i].op], instrs_[i]);
  return bytes;
}

std::string Program::describe() const {
  std::string s;
  for (size_t b = 0; b + 1 < list_begin_.size(); ++b) {
    char line[96];
    std::snprintf(line, sizeof line, "block %zu: %d instructions, %.2f MB\n", b, list_begin_[b + 1] - list_begin_[b],
                   block_bytes(static_cast<int>(b)) / 1e6);
    s += line;
  }
  return s;
}

std::string Program::summarize_trace(const std::vector<unsigned long long>& marks) const {
  if (marks.size() != instrs_.size() * kTraceMarks) return "no timeline\n";
  struct Sum {
    double wait = 0, x = 0, pages = 0, page_wait = 0, sync = 0, signal = 0, max_x = 0, max_pages = 0;
    unsigned long long first_done = ~0ull;
    unsigned long long first_ready = ~0ull, last_done = 0, first_start = ~0ull;
    int n = 0;
  };
  std::vector<Sum> per_op(ops_.size());
  unsigned long long t0 = ~0ull;
  for (size_t i = 0; i < instrs_.size(); ++i) {
    const unsigned long long* m = &marks[i * kTraceMarks];
    Sum& s = per_op[static_cast<size_t>(instrs_[i].op)];
    s.wait += static_cast<double>(m[1] - m[0]);
    s.x += static_cast<double>(m[2] - m[1]);
    s.pages += static_cast<double>(m[3] - m[2]);
    s.page_wait += static_cast<double>(m[6]);
    s.max_x = std::max(s.max_x, static_cast<double>(m[2] - m[1]));
    s.max_pages = std::max(s.max_pages, static_cast<double>(m[3] - m[2]));
    s.first_done = std::min(s.first_done, m[5]);
    s.sync += static_cast<double>(m[4] - m[3]);
    s.signal += static_cast<double>(m[5] - m[4]);
    s.first_start = std::min(s.first_start, m[0]);
    s.first_ready = std::min(s.first_ready, m[1]);
    s.last_done = std::max(s.last_done, m[5]);
    ++s.n;
    t0 = std::min(t0, m[0]);
  }
  std::string out =
      "op  rows x cols   instrs  wait us  x us (max)  pages us (waited, max)  sync us  signal us  first ready us  "
      "done us (first, last)  gap us\n";
  for (size_t o = 0; o < ops_.size(); ++o) {
    const Sum& s = per_op[o];
    if (s.n == 0) continue;
    const double gap = o + 1 < ops_.size() && per_op[o + 1].n
                           ? (static_cast<double>(per_op[o + 1].first_ready) - static_cast<double>(s.last_done)) / 1e3
                           : 0.0;
    char line[200];
    std::snprintf(line, sizeof line,
                  "%-3zu %6d x %-5d %6d %8.2f %5.2f (%5.2f) %8.2f (%5.2f, %5.2f) %8.2f %10.2f %15.2f %9.2f %9.2f %6.2f\n", o,
                  ops_[o].m.rows, ops_[o].m.cols, s.n, s.wait / s.n / 1e3, s.x / s.n / 1e3, s.max_x / 1e3,
                  s.pages / s.n / 1e3, s.page_wait / s.n / 1e3, s.max_pages / 1e3, s.sync / s.n / 1e3,
                  s.signal / s.n / 1e3, (s.first_ready - t0) / 1e3, (s.first_done - t0) / 1e3,
                  (s.last_done - t0) / 1e3, gap);
    out += line;
  }
  return out;
}

void Program::label_op(int op, std::string label) {
  if (op < 0 || op >= static_cast<int>(ops_.size())) return;
  if (labels_.size() < ops_.size()) labels_.resize(ops_.size());
  labels_[static_cast<size_t>(op)] = std::move(label);
}

std::string Program::label_of(int op) const {
  if (op >= 0 && static_cast<size_t>(op) < labels_.size() && !labels_[static_cast<size_t>(op)].empty())
    return labels_[static_cast<size_t>(op)];
  switch (ops_[static_cast<size_t>(op)].code) {
    case Opcode::gemv_q4: return "gemv";
    case Opcode::gdn_head: return "gdn_head";
    case Opcode::moe_in: return "moe_in";
    case Opcode::moe_out: return "moe_out";
    case Opcode::attn_part: return "attn_part";
    case Opcode::attn_merge: return "attn_merge";
  }
  return "op";
}

std::string Program::summarize_trace_by_label(const std::vector<unsigned long long>& marks, double* span_us) const {
  if (marks.size() != instrs_.size() * kTraceMarks || instrs_.empty()) return "no timeline\n";
  std::vector<unsigned long long> last_done(ops_.size(), 0);
  unsigned long long t0 = ~0ull;
  for (size_t i = 0; i < instrs_.size(); ++i) {
    const unsigned long long* m = &marks[i * kTraceMarks];
    const size_t o = static_cast<size_t>(instrs_[i].op);
    last_done[o] = std::max(last_done[o], m[5]);
    t0 = std::min(t0, m[0]);
  }
  struct Sum {
    int ops = 0, instrs = 0;
    double wait = 0, x = 0, pages = 0, share = 0;
  };
  std::map<std::string, Sum> by;
  std::vector<std::string> order;  // labels in first-op order
  unsigned long long prev = t0;
  for (size_t o = 0; o < ops_.size(); ++o) {
    const std::string l = label_of(static_cast<int>(o));
    if (!by.count(l)) order.push_back(l);
    Sum& s = by[l];
    s.ops += 1;
    const unsigned long long done = std::max(last_done[o], prev);  // ops finish in op order on the critical path
    s.share += static_cast<double>(done - prev) / 1e3;
    prev = done;
  }
  for (size_t i = 0; i < instrs_.size(); ++i) {
    const unsigned long long* m = &marks[i * kTraceMarks];
    Sum& s = by[label_of(instrs_[i].op)];
    s.instrs += 1;
    s.wait += static_cast<double>(m[1] - m[0]) / 1e3;
    s.x += static_cast<double>(m[2] - m[1]) / 1e3;
    s.pages += static_cast<double>(m[3] - m[2]) / 1e3;
  }
  const double span = static_cast<double>(prev - t0) / 1e3;
  if (span_us) *span_us = span;
  std::string out = "label           ops  instrs  wait us    x us  pages us   share us      %\n";
  for (const std::string& l : order) {
    const Sum& s = by[l];
    const double n = std::max(s.instrs, 1);
    char line[160];
    std::snprintf(line, sizeof line, "%-14s %4d %7d %8.2f %7.2f %9.2f %10.1f %6.1f\n", l.c_str(), s.ops, s.instrs,
                  s.wait / n, s.x / n, s.pages / n, s.share, span > 0 ? 100.0 * s.share / span : 0.0);
    out += line;
  }
  char total[96];
  std::snprintf(total, sizeof total, "step span %.1f us (first instruction's start to the last signal)\n", span);
  return out + total;
}

}  // namespace lily::cuda::mk
