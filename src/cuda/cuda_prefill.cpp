// The prefill path: prompts in chunks of up to prefill_chunk rows (eqs 4-5 for every layer over the chunk's rows),
// through the tensor-core GEMMs (qgemm.cuh), the Gated DeltaNet scans (gdn_prefill.cuh), flash attention
// (attn_prefill.cuh) and the MoE block (moe_prefill.cuh); and forward_with_checkpoint, the engine's chat anchor.
#include <cmath>

#include "cuda/cuda_backend_impl.h"
#include "cuda/kernels/attn_prefill.cuh"
#include "cuda/kernels/dispatch.cuh"
#include "cuda/kernels/embed.cuh"
#include "cuda/kernels/gdn_prefill.cuh"
#include "cuda/kernels/moe_prefill.cuh"

namespace lily::cuda {

// The prefill kernels' shapes (qgemm: K a multiple of 64; gdn_prefill: d_k = d_v in {64, 128}, conv kernel 4;
// attn_prefill: head_dim in {64, 128, 256}): every preset of the model family. Other geometries (and
// prefill_chunk = 0) run prompts token by token through the decode step.
bool CudaBackend::prefill_supported() const {
  const ModelConfig& c = config();
  const bool dims64 = c.hidden_size % 64 == 0 && c.moe_intermediate_size % 64 == 0 &&
                      c.shared_expert_intermediate_size % 64 == 0 && c.linear_value_dim() % 64 == 0 &&
                      (c.num_attention_heads * c.head_dim) % 64 == 0;
  const bool gdn = c.linear_key_head_dim == c.linear_value_head_dim &&
                   (c.linear_key_head_dim == 64 || c.linear_key_head_dim == 128) && c.linear_conv_kernel_dim == 4;
  const bool attn = c.head_dim == 64 || c.head_dim == 128 || c.head_dim == 256;
  return options_.prefill_chunk > 0 && dims64 && gdn && attn;
}

namespace {

// From this many rows a dense projection on the wgmma path runs the GEMM on its W expanded to fp16, whose producer
// only copies (qgemm.cuh: QGemmParams::w16; bit-identical). H200, a 4K chunk: gdn_in 22.8 -> 15.4 ms, gdn_out 10.2
// -> 6.3, attn_in 5.7 -> 3.9, attn_out 3.4 -> 2.1 with an expansion every call (docs/PERF_NOTES.md, 2026-12-03,
// ninth session). Since 2026-12-04 every layer's projections are expanded once (2.57 GB at full geometry, counted
// in the prefill scratch) and kept: 1K prompt 36.33 -> 35.07 ms, 4K 98.46 -> 97.29; without the per-call expansion
// 256 rows win too (the 256-token prompt 18.71 ms from 512 rows, 18.15 from 256). The copies are in the tile order
// of qgemm_w16_halves (rows padded to a multiple of 256: gdn_in's 12,352 rows to 12,544, +23.6 MB over the 30 GDN
// layers; the other projections' row counts are multiples of 256): a block's W tile of a step is one contiguous
// 32 KB (measured: docs/PERF_NOTES.md 2026-12-07).
constexpr int kW16MinRows = 256;

// The prefill scratch's arrays, in elements, from the chunk and the geometry.
struct PrefillSizes {
  size_t residual, proj, a_in, a_mixer, kernels_bytes, head_logits, w16, experts16;
  size_t bytes() const {
    return 4 * residual + 4 * proj + 2 * a_in + 2 * a_mixer + kernels_bytes + 4 * head_logits + 2 * w16 +
           2 * experts16;
  }
};

// A matrix's fp16 copy rounded up to 256 bytes (each copy starts 16-byte aligned, as the GEMM's copies need).
size_t align_halves(size_t n) { return (n + 127) / 128 * 128; }

// One layer's expert copies (moe_expand_w16), halves.
size_t expert16_stride(const ModelConfig& c) {
  return align_halves(moe_w16_halves(c.num_experts, c.hidden_size, c.moe_intermediate_size));
}

// w16: the dense projections take the fp16-W GEMM (the wgmma path and a chunk of >= kW16MinRows rows): their
// resident fp16 copies; experts16: the experts' (KernelPaths::expert_copies).
PrefillSizes prefill_sizes(const ModelConfig& c, const DeviceModel& m, int chunk, int head_rows, bool w16,
                           bool experts16) {
  const size_t C = chunk, H = c.hidden_size, nq = c.num_attention_heads, D = c.head_dim;
  size_t proj_cols = 0;
  for (const DeviceLayer& l : m.layers)
    proj_cols = std::max<size_t>(proj_cols, l.type == LayerType::full_attention ? l.attn_in.rows : l.gdn_in.rows);
  const size_t mixer_cols = std::max<size_t>(c.linear_value_dim(), nq * D);
  PrefillSizes s;
  s.residual = C * H;
  s.proj = C * proj_cols;
  s.a_in = C * std::max(H, mixer_cols);
  s.a_mixer = C * mixer_cols;
  s.kernels_bytes = std::max({moe_prefill_scratch_bytes(chunk, c.hidden_size, c.moe_intermediate_size,
                                                        c.shared_expert_intermediate_size, c.num_experts,
                                                        c.num_experts_per_tok),
                              gdn_prefill_scratch_bytes(chunk, c.linear_num_key_heads, c.linear_num_value_heads,
                                                        c.linear_key_head_dim, c.linear_value_head_dim),
                              attn_prefill_scratch_bytes(chunk, c.num_attention_heads, c.head_dim),
                              kQgemmSplitScratchMax});
  s.head_logits = std::min<size_t>(C, head_rows) * c.vocab_size;
  s.w16 = 0;
  if (w16 && chunk >= kW16MinRows) {
    for (const DeviceLayer& l : m.layers) {
      const bool gdn = l.type == LayerType::linear_attention;
      for (const QMatrix* q : {gdn ? &l.gdn_in : &l.attn_in, gdn ? &l.gdn_out : &l.attn_out})
        s.w16 += align_halves(qgemm_w16_halves(*q));  // rows padded to a multiple of 256 (the copy's tile order)
    }
  }
  s.experts16 = experts16 ? m.layers.size() * expert16_stride(c) : 0;
  return s;
}

// moe_prefill's expert GEMMs for a layer; w16: the layer's expert copies or nullptr.
MoePrefillParams moe_params(const ModelConfig& c, const DeviceLayer& L, float* h, int T, void* scratch,
                            size_t scratch_bytes, const __half* w16) {
  MoePrefillParams p{L.router, L.shared_gate_row, L.expert_gate, L.expert_up, L.expert_down, L.shared_gate,
                     L.shared_up, L.shared_down, h, L.post_norm, c.rms_norm_eps, T, c.num_experts_per_tok,
                     scratch, scratch_bytes};
  p.w16 = w16;
  return p;
}

}  // namespace

size_t CudaBackend::prefill_scratch_needed() const {
  return prefill_sizes(config(), *model_, options_.prefill_chunk, kHeadRows, paths_.wgmma, paths_.expert_copies)
      .bytes();
}

size_t CudaBackend::expert_copies_bytes() const {
  return model_->layers.size() * expert16_stride(config()) * sizeof(__half);
}

// The experts' shapes the copies take (moe_expand_w16): 4-bit routed and shared experts, the shared expert as wide
// as a routed one, H a multiple of 128 and I of 64.
bool CudaBackend::expert_copies_fit() const {
  const ModelConfig& c = config();
  if (c.moe_intermediate_size != c.shared_expert_intermediate_size || c.hidden_size % 128 != 0 ||
      c.moe_intermediate_size % 64 != 0 || model_->layers.empty())
    return false;
  for (const DeviceLayer& L : model_->layers)
    for (const QMatrix* q : {&L.expert_gate, &L.expert_up, &L.expert_down, &L.shared_gate, &L.shared_up, &L.shared_down})
      if (q->bits != 4) return false;
  return true;
}

Status CudaBackend::ensure_prefill_scratch() {
  if (prefill_bytes_ > 0) return ok_status();
  const PrefillSizes z =
      prefill_sizes(config(), *model_, options_.prefill_chunk, kHeadRows, paths_.wgmma, paths_.expert_copies);
  RETURN_IF_ERROR(ph_.alloc(z.residual));
  RETURN_IF_ERROR(pproj_.alloc(z.proj));
  RETURN_IF_ERROR(pxb_.alloc(z.a_in));
  RETURN_IF_ERROR(pob_.alloc(z.a_mixer));
  RETURN_IF_ERROR(pscratch_.alloc(z.kernels_bytes));
  RETURN_IF_ERROR(plogits_.alloc(z.head_logits));
  RETURN_IF_ERROR(pw16_.alloc(z.w16));
  if (z.w16 > 0) {  // every layer's projections expanded once (qgemm_expand_w16)
    const DeviceModel& m = *model_;
    w16_off_.assign(m.layers.size(), {0, 0});
    size_t off = 0;
    for (size_t l = 0; l < m.layers.size(); ++l) {
      const DeviceLayer& L = m.layers[l];
      const bool gdn = L.type == LayerType::linear_attention;
      const QMatrix* mats[2] = {gdn ? &L.gdn_in : &L.attn_in, gdn ? &L.gdn_out : &L.attn_out};
      for (int i = 0; i < 2; ++i) {
        w16_off_[l][i] = off;
        CUDA_RETURN(qgemm_expand_w16(*mats[i], pw16_.ptr + off, stream_), "the fp16 copy of a dense projection");
        off += align_halves(qgemm_w16_halves(*mats[i]));
      }
    }
    CUDA_RETURN(cudaStreamSynchronize(stream_), "the fp16 copies of the dense projections");
  }
  RETURN_IF_ERROR(pexp16_.alloc(z.experts16));
  if (z.experts16 > 0) {  // every layer's experts expanded once
    expert16_stride_ = expert16_stride(config());
    for (size_t l = 0; l < model_->layers.size(); ++l) {
      const MoePrefillParams p = moe_params(config(), model_->layers[l], nullptr, 0, nullptr, 0, nullptr);
      CUDA_RETURN(moe_expand_w16(p, pexp16_.ptr + l * expert16_stride_, stream_), "the fp16 copies of the experts");
    }
    CUDA_RETURN(cudaStreamSynchronize(stream_), "the fp16 copies of the experts");
  }
  prefill_bytes_ = ph_.bytes() + pproj_.bytes() + pxb_.bytes() + pob_.bytes() + pscratch_.bytes() + plogits_.bytes() +
                   pw16_.bytes() + pexp16_.bytes();
  return ok_status();
}

// Layer l's Gated DeltaNet scan over the chunk's T rows. With 0 < split < T (and cp), the scan runs over rows
// [0, split), the conv ring and state S go into *cp (the state at pos0 + split), then over [split, T): the same two
// gdn_prefill calls as two chunks would make, while every other kernel still runs once over the T rows.
Status CudaBackend::prefill_gdn_mixer(CudaSequence& s, size_t l, int T, Profiler* prof, int split,
                                      CudaCheckpoint* cp) {
  const ModelConfig& c = config();
  const DeviceLayer& L = model_->layers[l];
  const bool two_calls = cp && split > 0 && split < T;
  for (int part = 0; part < (two_calls ? 2 : 1); ++part) {
    const int r0 = part == 0 ? 0 : split, Tp = two_calls ? (part == 0 ? split : T - split) : T;
    GdnPrefillParams g{pproj_.ptr + static_cast<size_t>(r0) * L.gdn_in.rows, Tp, static_cast<int>(s.n) + r0,
                       s.conv[l]->ptr, L.conv_w, L.A_log, L.dt_bias, s.S[l]->ptr, c.linear_num_key_heads,
                       c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim,
                       c.linear_conv_kernel_dim, L.gdn_norm, c.rms_norm_eps,
                       pob_.ptr + static_cast<size_t>(r0) * c.linear_value_dim(), pscratch_.ptr, pscratch_.bytes()};
    STEP_OP("gdn_prefill", 2.0 * s.S[l]->bytes(), gdn_prefill(g, stream_),
            4.0 * Tp * c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim);
    if (two_calls && part == 0) RETURN_IF_ERROR(copy_recurrent(s, *cp, static_cast<int>(l)));
  }
  return ok_status();
}

// An attention layer's mixer over T rows: pproj_ (q|k|v) to pob_ by flash attention against k / v, which get the
// rows' keys and values at positions pos0 .. pos0+T-1.
Status CudaBackend::prefill_attention(const DeviceLayer& L, __nv_bfloat16* k, __nv_bfloat16* v, int T, int pos0,
                                      Profiler* prof) {
  const ModelConfig& c = config();
  const float eps = c.rms_norm_eps;
  const double rows = T;
  AttnPrefillParams a{pproj_.ptr, T, pos0, L.q_norm, L.k_norm, c.num_attention_heads, c.num_key_value_heads,
                      c.head_dim, c.rotary_dim(), static_cast<float>(c.rope_theta), eps,
                      1.0f / std::sqrt(static_cast<float>(c.head_dim)), k, v, pob_.ptr, pscratch_.ptr,
                      pscratch_.bytes()};
  if (paths_.attn_wgmma) a.variant = 1;
  const double attended = rows * pos0 + rows * (rows + 1) / 2;  // causal: row t attends pos0 + t + 1 rows
  STEP_OP("attn_prefill", 0, attn_prefill(a, stream_), 4.0 * c.num_attention_heads * c.head_dim * attended);
  return ok_status();
}

// One layer over the T rows of the residual stream ph_: the input norm to fp16, the in projection to pproj_,
// `mixer` (pproj_ to pob_), the out projection added to ph_, then the MoE block.
Status CudaBackend::prefill_layer(const DeviceLayer& L, int T, const std::function<Status()>& mixer, Profiler* prof,
                                  int w16_layer) {
  const ModelConfig& c = config();
  const float eps = c.rms_norm_eps;
  const int H = c.hidden_size, k = c.num_experts_per_tok;
  const double rows = T;
  const bool wgmma = paths_.wgmma, gdn = L.type == LayerType::linear_attention;
  STEP_OP("rms_norm", rows * H * 6, rms_norm_rows(ph_.ptr, L.input_norm, T, H, eps, pxb_.ptr, stream_));
  const QMatrix& in = gdn ? L.gdn_in : L.attn_in;
  const QMatrix& out = gdn ? L.gdn_out : L.attn_out;
  // The model's layers have resident fp16 copies; the MTP head's layer (cuda_mtp.cpp) takes the dequantising tiles.
  const bool w16 = wgmma && T >= kW16MinRows && w16_layer >= 0 && static_cast<size_t>(w16_layer) < w16_off_.size();
  auto resident = [&](QGemmParams& g, int i, const QMatrix& w) {
    g.w16 = pw16_.ptr + w16_off_[static_cast<size_t>(w16_layer)][i];
    g.w16_bytes = qgemm_w16_halves(w) * sizeof(__half);
    g.w16_expanded = true;
  };
  QGemmParams gin{in, pxb_.ptr, T, GemmOut::f32, pproj_.ptr, 0, wgmma, pscratch_.ptr, pscratch_.bytes()};
  if (w16) resident(gin, 0, in);
  STEP_OP(gdn ? "qgemm gdn_in" : "qgemm attn_in", in.bytes(), qgemm(gin, stream_), 2.0 * rows * in.rows * in.cols);
  RETURN_IF_ERROR(mixer());
  QGemmParams gout{out, pob_.ptr, T, GemmOut::add_f32, ph_.ptr, 0, wgmma, pscratch_.ptr, pscratch_.bytes()};
  if (w16) resident(gout, 1, out);
  STEP_OP(gdn ? "qgemm gdn_out" : "qgemm attn_out", out.bytes(), qgemm(gout, stream_),
          2.0 * rows * out.rows * out.cols);
  const bool copies = expert16_stride_ > 0 && w16_layer >= 0 && static_cast<size_t>(w16_layer) < model_->layers.size();
  const MoePrefillParams moe = moe_params(c, L, ph_.ptr, T, pscratch_.ptr, pscratch_.bytes(),
                                          copies ? pexp16_.ptr + static_cast<size_t>(w16_layer) * expert16_stride_ : nullptr);
  const double moe_flops = 2.0 * rows * H *
                           (3.0 * k * c.moe_intermediate_size + 3.0 * c.shared_expert_intermediate_size +
                            c.num_experts + 1);
  STEP_OP("moe_prefill", 0, moe_prefill(moe, stream_), moe_flops);
  return ok_status();
}

// One chunk of T <= prefill_chunk rows at positions s.n .. s.n+T-1: the residual stream ph_ [T, H] in fp32, each
// block's input normalised to fp16 for the tensor-core GEMMs (fp16, not bf16: its 2^-11 rounding keeps the prefill
// within the decode path's accuracy; normalised activations stay far from its 65504 range). Leaves the final
// residual rows in ph_ for the lm_head.
Status CudaBackend::prefill_chunk(CudaSequence& s, const int* tokens, int T, Profiler* prof, int split,
                                  CudaCheckpoint* cp) {
  const DeviceModel& m = *model_;
  const int pos0 = static_cast<int>(s.n);
  const double rows = T;
  STEP_OP("embed", rows * m.embed.bytes() / m.embed.rows, embed_rows(m.embed, tokens, T, ph_.ptr, stream_));
  for (size_t l = 0; l < m.layers.size(); ++l) {
    const DeviceLayer& L = m.layers[l];
    if (L.type == LayerType::linear_attention) {
      RETURN_IF_ERROR(
          prefill_layer(L, T, [&] { return prefill_gdn_mixer(s, l, T, prof, split, cp); }, prof, static_cast<int>(l)));
    } else {
      RETURN_IF_ERROR(prefill_layer(L, T, [&] { return prefill_attention(L, s.k[l]->ptr, s.v[l]->ptr, T, pos0, prof); },
                                    prof, static_cast<int>(l)));
    }
  }
  s.n += T;
  return ok_status();
}

// Copies layer l's conv ring and state S (or, with l < 0, the whole recurrent region) into cp, on the stream.
Status CudaBackend::copy_recurrent(const CudaSequence& s, CudaCheckpoint& cp, int l) {
  if (l < 0) {
    CUDA_RETURN(cudaMemcpyAsync(cp.storage.ptr, s.storage.ptr, s.layout.recurrent_bytes, cudaMemcpyDeviceToDevice,
                                stream_), "checkpoint");
    return ok_status();
  }
  CUDA_RETURN(cudaMemcpyAsync(cp.conv[l]->ptr, s.conv[l]->ptr, s.conv[l]->bytes(), cudaMemcpyDeviceToDevice, stream_),
              "checkpoint");
  CUDA_RETURN(cudaMemcpyAsync(cp.S[l]->ptr, s.S[l]->ptr, s.S[l]->bytes(), cudaMemcpyDeviceToDevice, stream_),
              "checkpoint");
  return ok_status();
}

// Prefills the T tokens in tokens_ (device) in chunks; logits of the rows asked for go to the host. With cp, the
// recurrent state after the first `split` rows (0 < split < T) is copied into it on the way. With the MTP head,
// each chunk's rows are then read by it (mtp_read_rows: the residual rows are still in ph_).
Status CudaBackend::prefill(CudaSequence& s, int64_t T, LogitsRows rows, std::vector<float>* logits,
                            Profiler* prof, int64_t split, CudaCheckpoint* cp) {
  RETURN_IF_ERROR(ensure_prefill_scratch());
  const ModelConfig& c = config();
  const DeviceModel& m = *model_;
  const int64_t V = c.vocab_size, C = options_.prefill_chunk;
  const int H = c.hidden_size;
  for (int64_t off = 0; off < T; off += C) {
    const int Tc = static_cast<int>(std::min<int64_t>(C, T - off));
    const int in_chunk = cp && split > off && split < off + Tc ? static_cast<int>(split - off) : 0;
    RETURN_IF_ERROR(prefill_chunk(s, tokens_.ptr + off, Tc, prof, in_chunk, cp));
    if (cp && split == off + Tc) RETURN_IF_ERROR(copy_recurrent(s, *cp, -1));  // the split is a chunk boundary
    // The checkpoint's pending row for the head: the row before the split (the last a forward up to it reads).
    const int cp_row = cp && split - 1 >= off && split - 1 < off + Tc ? static_cast<int>(split - 1 - off) : -1;
    if (rows == LogitsRows::all) {  // the lm_head for every row, kHeadRows at a time
      for (int r = 0; r < Tc; r += kHeadRows) {
        const int R = std::min(kHeadRows, Tc - r);
        STEP_OP("rms_norm", R * H * 6.0,
                rms_norm_rows(ph_.ptr + static_cast<size_t>(r) * H, m.final_norm, R, H, c.rms_norm_eps, pxb_.ptr, stream_));
        QGemmParams head{m.lm_head, pxb_.ptr, R, GemmOut::f32, plogits_.ptr, 0};
        STEP_OP("qgemm lm_head", m.lm_head.bytes(), qgemm(head, stream_), 2.0 * R * V * H);
        CUDA_RETURN(cudaMemcpyAsync(logits->data() + (off + r) * V, plogits_.ptr, R * V * sizeof(float),
                                    cudaMemcpyDeviceToHost, stream_), "logits");
      }
    } else if (rows == LogitsRows::last && off + Tc == T) {  // one row: the decode GEMV
      GemvParams head{m.lm_head, ph_.ptr + static_cast<size_t>(Tc - 1) * H, GemvPrologue::rms_norm, m.final_norm,
                      nullptr, 0, c.rms_norm_eps, nullptr, logits_.ptr};
      STEP_OP("gemv lm_head", m.lm_head.bytes(), dispatch::gemv(head, stream_));
      CUDA_RETURN(cudaMemcpyAsync(logits->data(), logits_.ptr, V * sizeof(float), cudaMemcpyDeviceToHost, stream_),
                  "logits");
    }
    if (s.mtp_on) RETURN_IF_ERROR(mtp_read_rows(s, ph_.ptr, Tc, tokens_.ptr + off, prof, cp, cp_row));
  }
  CUDA_RETURN(set_position(s.pos.ptr, static_cast<int>(s.n), stream_), "position");
  return ok_status();
}

// One pass over the tokens with the checkpoint copied out at the split (engine/backend.h); `rows` refer to the
// tokens after it. No device memory for the checkpoint gives a null one, not an error.
Result<std::unique_ptr<Checkpoint>> CudaBackend::forward_with_checkpoint(SequenceState& base,
                                                                         std::span<const int32_t> tokens,
                                                                         int64_t split, LogitsRows rows,
                                                                         std::vector<float>* logits) {
  const int64_t T = static_cast<int64_t>(tokens.size());
  if (split <= 0 || split >= T) return invalid_argument("forward_with_checkpoint: split %lld outside (0, %lld)",
                                                        (long long)split, (long long)T);
  ASSIGN_OR_RETURN(CudaSequence * s, check_sequence(base, T));
  RETURN_IF_ERROR(check_tokens(tokens));
  if (!prefill_supported()) return Backend::forward_with_checkpoint(*s, tokens, split, rows, logits);
  const int64_t V = config().vocab_size;
  std::unique_ptr<CudaCheckpoint> cp = s->empty_checkpoint(s->n + split);
  RETURN_IF_ERROR(upload_tokens(tokens));
  if (s->mtp_on) RETURN_IF_ERROR(mtp_prepare(*s, 1));
  if (rows != LogitsRows::none) logits->resize(static_cast<size_t>((rows == LogitsRows::all ? T : 1) * V));
  RETURN_IF_ERROR(prefill(*s, T, rows, logits, nullptr, cp ? split : 0, cp.get()));
  CUDA_RETURN(cudaStreamSynchronize(stream_), "prefill");
  if (rows == LogitsRows::all) logits->erase(logits->begin(), logits->begin() + split * V);
  return std::unique_ptr<Checkpoint>(std::move(cp));
}

}  // namespace lily::cuda
