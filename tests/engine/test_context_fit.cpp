// The arithmetic of the load-time memory check and `--ctx-size auto` (engine/context_fit.h): a sequence's bytes
// from the geometry, the largest context that fits, and the error that names it.
#include <gtest/gtest.h>

#include "engine/context_fit.h"
#include "model/config.h"

namespace lily {
namespace {

// The model's geometry: 40 layers, every fourth full attention (2 KV heads x 256, bf16), the rest Gated DeltaNet
// (conv ring 4 x 8192 and state 32 x 128 x 128, fp32).
ModelConfig full_geometry() {
  ModelConfig c;
  c.num_key_value_heads = 2, c.head_dim = 256;
  c.linear_num_key_heads = 16, c.linear_num_value_heads = 32, c.linear_key_head_dim = 128;
  c.linear_value_head_dim = 128, c.linear_conv_kernel_dim = 4;
  c.max_position_embeddings = 262144;
  for (int l = 0; l < 40; ++l)
    c.layer_types.push_back(l % 4 == 3 ? LayerType::full_attention : LayerType::linear_attention);
  return c;
}

TEST(ContextFit, SequenceBytesFromTheGeometry) {
  const SequenceBytes b = sequence_bytes(full_geometry());
  EXPECT_EQ(b.per_token, 10u * 2 * 2 * 256 * 2);  // 20 KiB a token: K and V of 10 attention layers
  // 30 conv rings (4 x 8192 floats) and states (32 x 128 x 128 floats), plus alignment slack.
  const size_t recurrent = 30u * (4 * 8192 * 4 + 32 * 128 * 128 * 4);
  EXPECT_GE(b.fixed, recurrent);
  EXPECT_LE(b.fixed, recurrent + (2 * 40 + 1) * 256);
}

TEST(ContextFit, LargestContextThatFits) {
  ContextFit f;
  f.sequence = {1000, 20480};
  f.scratch_bytes = 5000, f.reserve_bytes = 4000;
  f.free_bytes = 10000 + 20480 * 100;  // exactly 100 tokens after fixed + scratch + reserve
  EXPECT_EQ(max_context_that_fits(f, 1 << 20), 100);
  f.free_bytes -= 1;
  EXPECT_EQ(max_context_that_fits(f, 1 << 20), 99);
  EXPECT_EQ(max_context_that_fits(f, 50), 50);  // at most the model's maximum
  f.free_bytes = 9999;                          // not even the fixed part
  EXPECT_EQ(max_context_that_fits(f, 1 << 20), 0);
  f.free_bytes = 0;
  EXPECT_EQ(max_context_that_fits(f, 1 << 20), 0);
  f.sequence.per_token = 0, f.free_bytes = 20000;  // no attention layers: any length
  EXPECT_EQ(max_context_that_fits(f, 777), 777);
}

// An H200's 141 GB with the ~21 GB model loaded: 32K fits easily, the model's 262,144 too (5 GiB of KV).
TEST(ContextFit, TheModelOnAnH200) {
  ContextFit f;
  f.sequence = sequence_bytes(full_geometry());
  f.free_bytes = size_t{120} << 30, f.scratch_bytes = size_t{3} << 30, f.reserve_bytes = size_t{1} << 30;
  EXPECT_EQ(max_context_that_fits(f, 262144), 262144);
  EXPECT_TRUE(check_context_fits(f, 32768, 262144, "H200").ok());
  f.free_bytes = size_t{6} << 30;  // a 24 GB card after the weights: 2 GiB for KV
  const int64_t fits = max_context_that_fits(f, 262144);
  EXPECT_EQ(fits, static_cast<int64_t>(((size_t{2} << 30) - f.sequence.fixed) / f.sequence.per_token));
  EXPECT_TRUE(check_context_fits(f, fits, 262144, "GPU").ok());
  const Status st = check_context_fits(f, fits + 1, 262144, "RTX 4090");
  EXPECT_EQ(st.code(), ErrorCode::out_of_range);
  EXPECT_NE(st.message().find("RTX 4090"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("the largest context that fits is " + std::to_string(fits) + " tokens"),
            std::string::npos)
      << st.message();
  EXPECT_NE(st.message().find("--ctx-size auto"), std::string::npos) << st.message();
  f.free_bytes = size_t{1} << 30;  // the reserve alone
  const Status none = check_context_fits(f, 16, 262144, "GPU");
  EXPECT_EQ(none.code(), ErrorCode::out_of_range);
  EXPECT_NE(none.message().find("too little for any context"), std::string::npos) << none.message();
}

// The optional allocation (the CUDA backend's fp16 expert copies, 64.7 GB at full geometry) is taken only with room
// for 8 sequences of the context and an 8 GiB session cache beside it.
TEST(ContextFit, OptionalAllocationLeavesRoomForTheStreams) {
  ContextFit f;
  f.sequence = {1000, 100};
  f.scratch_bytes = 5000, f.reserve_bytes = 4000;
  // 4 streams of 50 tokens: 4 x (1000 + 5000) + scratch 5000 + extra 2000 + reserve 4000 + headroom 3000.
  f.free_bytes = 4 * 6000 + 5000 + 2000 + 4000 + 3000;
  EXPECT_TRUE(optional_fits(f, 2000, 50, 1 << 20, 4, 3000));
  EXPECT_FALSE(optional_fits(f, 2001, 50, 1 << 20, 4, 3000));  // one byte more
  EXPECT_FALSE(optional_fits(f, 2000, 51, 1 << 20, 4, 3000));  // one token more in each of the 4
  EXPECT_TRUE(optional_fits(f, 2000, 50 + 3 * 60, 1 << 20, 1, 3000));  // one stream holds the others' bytes
  EXPECT_FALSE(optional_fits(f, 0, 0, 1 << 20, 4, 3000));             // no context
  EXPECT_FALSE(optional_fits(f, 0, 50, 40, 4, 3000));                 // past the model's maximum
  EXPECT_FALSE(optional_fits(f, 0, 50, 1 << 20, 0, 3000));            // no stream
  // The model with 3 GiB of other scratch and 64,700 MiB of copies: 120 GiB free after the weights (an H200) holds
  // them beside 8 sequences of the model's 262,144 tokens (~116 GiB in all); 110 GiB beside 8 of 32K (~81 GiB)
  // only; the 60 GiB of an 80 GB card, never.
  ContextFit h;
  h.sequence = sequence_bytes(full_geometry());
  h.scratch_bytes = size_t{3} << 30, h.reserve_bytes = size_t{1} << 30;
  const size_t copies = size_t{64700} << 20, cache = size_t{8} << 30;
  h.free_bytes = size_t{120} << 30;
  EXPECT_TRUE(optional_fits(h, copies, 262144, 262144, 8, cache));
  h.free_bytes = size_t{110} << 30;
  EXPECT_TRUE(optional_fits(h, copies, 32768, 262144, 8, cache));
  EXPECT_FALSE(optional_fits(h, copies, 262144, 262144, 8, cache));
  h.free_bytes = size_t{60} << 30;
  EXPECT_FALSE(optional_fits(h, copies, 4096, 262144, 8, cache));
}

}  // namespace
}  // namespace lily
