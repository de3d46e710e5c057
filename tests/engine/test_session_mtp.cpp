// The session cache's disk tier with the MTP head on (`lily serve --cache-dir DIR --speculative mtp:K`), on the
// tiny model and the CPU backend:
//  - a saved sequence and checkpoint carry the head's state: after a load (and a restore) the head drafts to the
//    bit as the original does, also from a state with several pending rows or after a draft;
//  - an engine restarted on the same directory resumes a conversation with the cached tokens, greedy tokens,
//    drafts and acceptances of one that never stopped (the greedy tokens also those without speculation), and a
//    seeded sampled turn draws the same tokens;
//  - the mixed cases: a file without the head's state is refused by an engine with the head (left in place, the
//    request prefills), a file with it resumes an engine without the head; a head fingerprint of another head and
//    an old format version are refused; the model fingerprint does not change with an attached head;
//  - truncated, corrupt and inconsistent head parts are refused (format errors), never loaded or crashed on.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <filesystem>

#include "common/temp_dir.h"
#include "session_test_util.h"

namespace lily::test {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::ordered_json;
using lily::testing::TempDir;

std::unique_ptr<Backend> mtp_backend() {
  auto b = tiny_backend();
  Status st = b->enable_mtp();
  EXPECT_TRUE(st.ok()) << st.message();
  EXPECT_TRUE(b->mtp_enabled());
  return b;
}

int32_t argmax(const std::vector<float>& v) {
  return static_cast<int32_t>(std::max_element(v.begin(), v.end()) - v.begin());
}

std::vector<float> draft(Backend& be, SequenceState& seq, int32_t token) {
  std::vector<float> logits;
  Status st = be.mtp_draft(seq, token, &logits);
  EXPECT_TRUE(st.ok()) << st.message();
  return logits;
}

Result<std::unique_ptr<SequenceState>> load_sequence(Backend& be, const std::vector<uint8_t>& bytes,
                                                     bool whole = true) {
  ByteReader in(bytes);
  auto r = be.load_sequence(in);
  if (r.ok() && whole) {
    EXPECT_EQ(in.left(), 0u) << "the whole saved state is read";
  }
  return r;
}

Result<std::unique_ptr<Checkpoint>> load_checkpoint(Backend& be, const std::vector<uint8_t>& bytes) {
  ByteReader in(bytes);
  auto r = be.load_checkpoint(in);
  if (r.ok()) {
    EXPECT_EQ(in.left(), 0u) << "the whole saved checkpoint is read";
  }
  return r;
}

// What the head and the model do next on two sequences that should be the same: two chained drafts, a
// verification of three rows with two kept, a draft after it, then a plain forward. Every logit is compared to
// the bit (the head's part of the state decides the drafts, the main part everything else).
void expect_same_continuation(Backend& be, SequenceState& a, SequenceState& b, int32_t next, const char* what) {
  SCOPED_TRACE(what);
  const std::vector<float> a1 = draft(be, a, next), b1 = draft(be, b, next);
  ASSERT_EQ(a1, b1) << "first draft";
  const std::vector<float> a2 = draft(be, a, argmax(a1)), b2 = draft(be, b, argmax(a1));
  ASSERT_EQ(a2, b2) << "chained draft";
  const std::vector<int32_t> rows = {next, argmax(a1), argmax(a2)};
  std::vector<float> av, bv;
  ASSERT_TRUE(be.forward_verify(a, rows, &av).ok());
  ASSERT_TRUE(be.forward_verify(b, rows, &bv).ok());
  ASSERT_EQ(av, bv) << "verification";
  ASSERT_TRUE(be.accept_verified(a, 2).ok());
  ASSERT_TRUE(be.accept_verified(b, 2).ok());
  const int32_t t = (rows[2] + 3) % be.config().vocab_size;
  ASSERT_EQ(draft(be, a, t), draft(be, b, t)) << "draft after the verification";
  const std::vector<int32_t> more = ids(5, 77);
  ASSERT_EQ(forward(be, a, more), forward(be, b, more)) << "forward after it";
  ASSERT_EQ(draft(be, a, 11), draft(be, b, 11)) << "draft after the forward";
}

TEST(SessionMtpSerialization, SavedSequenceDraftsBitIdentically) {
  auto be = mtp_backend();
  const auto a = ids(40, 3);
  auto seq = be->new_sequence();
  forward(*be, *seq, std::span(a).first(25));
  const std::vector<uint8_t> bytes = saved(*seq);
  auto loaded = load_sequence(*be, bytes);
  ASSERT_TRUE(loaded.ok()) << loaded.status().message();
  EXPECT_EQ((*loaded)->n_tokens(), 25);
  EXPECT_EQ((*loaded)->bytes(), seq->bytes()) << "the head's KV and pending row count too";
  EXPECT_EQ(saved(**loaded), bytes) << "saved again: the same bytes";
  // A sequence saved without the head's part (a server without the head) has fewer bytes: the head's are there.
  auto plain = tiny_backend();
  auto plain_seq = plain->new_sequence();
  forward(*plain, *plain_seq, std::span(a).first(25));
  EXPECT_GT(bytes.size(), saved(*plain_seq).size());
  expect_same_continuation(*be, *seq, **loaded, a[25], "loaded after a prefill");
}

// The states the speculative loop leaves: several pending rows after a verification, and (in a direct use of
// the backend) draft entries past the position with a chained row, which the next forward drops - a saved state
// leaves them out, as a checkpoint does.
TEST(SessionMtpSerialization, StatesAfterVerificationsAndDraftsLoadAsTheNextForwardFindsThem) {
  auto be = mtp_backend();
  const auto a = ids(30, 4);
  auto seq = be->new_sequence();
  forward(*be, *seq, std::span(a).first(20));
  const std::vector<float> d1 = draft(*be, *seq, a[20]);
  std::vector<float> all;
  ASSERT_TRUE(be->forward_verify(*seq, std::vector<int32_t>{a[20], argmax(d1), 5, 6}, &all).ok());
  ASSERT_TRUE(be->accept_verified(*seq, 3).ok());  // three pending rows
  {
    auto loaded = load_sequence(*be, saved(*seq));
    ASSERT_TRUE(loaded.ok()) << loaded.status().message();
    auto twin = seq->clone();
    expect_same_continuation(*be, *twin, **loaded, 9, "three pending rows");
  }
  (void)draft(*be, *seq, 9);
  (void)draft(*be, *seq, 10);  // the head two entries past the position, a chained row
  auto loaded = load_sequence(*be, saved(*seq));
  ASSERT_TRUE(loaded.ok()) << loaded.status().message();
  std::vector<float> l;
  EXPECT_EQ(be->mtp_draft(**loaded, 10, &l).code(), ErrorCode::invalid_argument)
      << "no chained row: a forward comes first";
  auto twin = seq->clone();
  const std::vector<int32_t> next = {9, 12, 13};
  EXPECT_EQ(forward(*be, *twin, next), forward(*be, **loaded, next));
  expect_same_continuation(*be, *twin, **loaded, 14, "after drafts past the position");
}

TEST(SessionMtpSerialization, SavedCheckpointRestoresTheHeadLikeTheOriginal) {
  auto be = mtp_backend();
  const auto a = ids(30, 5);
  auto b = ids(30, 6);
  std::copy(a.begin(), a.begin() + 10, b.begin());
  auto seq = be->new_sequence();
  forward(*be, *seq, std::span(a).first(10));
  auto cp = seq->checkpoint();
  forward(*be, *seq, std::span(a).subspan(10));
  const std::vector<uint8_t> cp_bytes = saved(*cp);
  auto seq2 = load_sequence(*be, saved(*seq));
  auto cp2 = load_checkpoint(*be, cp_bytes);
  ASSERT_TRUE(seq2.ok() && cp2.ok());
  EXPECT_EQ((*cp2)->n_tokens(), 10);
  EXPECT_EQ((*cp2)->bytes(), cp->bytes()) << "the pending row";
  EXPECT_EQ(saved(**cp2), cp_bytes);
  ASSERT_TRUE(seq->restore(*cp).ok());
  ASSERT_TRUE((*seq2)->restore(**cp2).ok());
  EXPECT_EQ(forward(*be, *seq, std::span(b).subspan(10, 5)), forward(*be, **seq2, std::span(b).subspan(10, 5)));
  expect_same_continuation(*be, *seq, **seq2, b[15], "restored from a loaded checkpoint");
  // A checkpoint without the head's part is refused by a sequence with the head, not half-restored.
  auto plain = tiny_backend();
  auto plain_seq = plain->new_sequence();
  forward(*plain, *plain_seq, std::span(a).first(10));
  Status st = (*seq2)->restore(*plain_seq->checkpoint());
  EXPECT_EQ(st.code(), ErrorCode::invalid_argument) << st.message();
}

// The mixed cases in the backend: the head's part is read past without the head; with the head, a saved form
// without it is unsupported (the head's KV cannot be rebuilt from the main model's state).
TEST(SessionMtpSerialization, MixedHeadAndNoHead) {
  auto with = mtp_backend();
  auto without = tiny_backend();
  const auto a = ids(30, 7);
  auto s_with = with->new_sequence(), s_without = without->new_sequence();
  forward(*with, *s_with, std::span(a).first(12));
  auto cp_with = s_with->checkpoint();
  forward(*with, *s_with, std::span(a).subspan(12, 8));
  forward(*without, *s_without, std::span(a).first(12));
  auto cp_without = s_without->checkpoint();
  forward(*without, *s_without, std::span(a).subspan(12, 8));

  auto read_past = load_sequence(*without, saved(*s_with));
  auto cp_past = load_checkpoint(*without, saved(*cp_with));
  ASSERT_TRUE(read_past.ok()) << read_past.status().message();
  ASSERT_TRUE(cp_past.ok()) << cp_past.status().message();
  EXPECT_EQ(saved(**read_past), saved(*s_without)) << "exactly the state a server without the head has";
  EXPECT_EQ(saved(**cp_past), saved(*cp_without));
  const std::vector<int32_t> next = ids(6, 8);
  EXPECT_EQ(forward(*without, **read_past, next), forward(*without, *s_without, next));
  ASSERT_TRUE((*read_past)->restore(**cp_past).ok());
  ASSERT_TRUE(s_without->restore(*cp_without).ok());
  EXPECT_EQ(forward(*without, **read_past, next), forward(*without, *s_without, next));

  auto refused = load_sequence(*with, saved(*s_without));
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), ErrorCode::unsupported);
  EXPECT_NE(refused.status().message().find("saved without the MTP head's state"), std::string::npos)
      << refused.status().message();
  auto cp_refused = load_checkpoint(*with, saved(*cp_without));
  ASSERT_FALSE(cp_refused.ok());
  EXPECT_EQ(cp_refused.status().code(), ErrorCode::unsupported) << cp_refused.status().message();
}

// The head's part is the bytes after what a backend without the head writes for the same tokens, less its flag
// byte (0 there): flag, position (8 bytes), then the arrays, each a count (8 bytes) and its values.
size_t head_part_offset(const std::vector<int32_t>& tokens) {
  auto plain = tiny_backend();
  auto s = plain->new_sequence();
  forward(*plain, *s, tokens);
  return saved(*s).size() - 1;
}

TEST(SessionMtpSerialization, DamagedHeadPartsAreFormatErrors) {
  auto be = mtp_backend();
  const auto a = ids(16, 9);
  auto seq = be->new_sequence();
  forward(*be, *seq, a);
  const std::vector<uint8_t> good = saved(*seq);
  const size_t at = head_part_offset(a);
  ASSERT_EQ(good[at], 1) << "the head's flag";
  for (size_t cut : {at, at + 1, at + 5, at + 9, at + 13, (at + good.size()) / 2, good.size() - 5, good.size() - 1}) {
    auto r = load_sequence(*be, std::vector<uint8_t>(good.begin(), good.begin() + static_cast<ptrdiff_t>(cut)));
    ASSERT_FALSE(r.ok()) << cut;
    EXPECT_EQ(r.status().code(), ErrorCode::format) << cut << ": " << r.status().message();
  }
  auto patched = [&](size_t off, auto value) {
    std::vector<uint8_t> bad = good;
    std::memcpy(bad.data() + off, &value, sizeof value);
    return load_sequence(*be, bad, /*whole=*/false);
  };
  struct Case {
    size_t off;
    int64_t value;
    const char* message;
  };
  for (const Case& c : {Case{at + 1, 17, "the MTP head at 17, the sequence at 16"},
                        Case{at + 1, -1, "the MTP head at -1"},
                        Case{at + 1, 14, "MTP k: "},  // the arrays then have the wrong sizes
                        Case{at + 9, 3, "MTP k: 3 values"}}) {
    auto r = patched(c.off, c.value);
    ASSERT_FALSE(r.ok()) << c.message;
    EXPECT_EQ(r.status().code(), ErrorCode::format) << r.status().message();
    EXPECT_NE(r.status().message().find(c.message), std::string::npos) << r.status().message();
  }
  auto flag = patched(at, uint8_t{7});
  ASSERT_FALSE(flag.ok());
  EXPECT_NE(flag.status().message().find("MTP head flag 7"), std::string::npos) << flag.status().message();
  std::vector<uint8_t> longer = good;
  longer.push_back(0);
  ByteReader in(longer);
  auto r = be->load_sequence(in);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(in.left(), 1u) << "the backend reads exactly its part (the session file checks what is left)";
}

// ---------------------------------------------------------------------------------------- session files

Entry entry(Backend& be, int n, int salt) { return test::entry(be, n, salt, {16}); }

class SessionFileMtp : public ::testing::Test {
 protected:
  void SetUp() override {
    with_ = mtp_backend();
    without_ = tiny_backend();
    e_ = entry(*with_, 24, 10);
    ASSERT_TRUE(write_session_file(path("head"), owner(true), e_.snap).ok());
    Entry plain = entry(*without_, 24, 10);
    ASSERT_TRUE(write_session_file(path("plain"), owner(false), plain.snap).ok());
  }
  std::string path(const std::string& name) const { return dir_ / (name + ".lsess"); }
  // The reason read_session_file gives for `bytes` (written to a file) read by `who` into `be`.
  Status refused(const std::vector<uint8_t>& bytes, const SessionFileOwner& who, Backend& be) {
    write_file(path("x"), bytes);
    auto r = read_session_file(path("x"), who, be);
    EXPECT_FALSE(r.ok());
    return r.ok() ? Status() : r.status();
  }
  TempDir dir_{"sessmtp"};
  std::unique_ptr<Backend> with_, without_;
  Entry e_;
};

TEST_F(SessionFileMtp, RoundTripsTheHeadsState) {
  auto info = read_session_info(path("head"), owner(true));
  ASSERT_TRUE(info.ok()) << info.status().message();
  EXPECT_EQ(info->tokens, e_.seq->tokens);
  EXPECT_EQ(info->checkpoints, (std::vector<int64_t>{8, 16}));
  auto loaded = read_session_file(path("head"), owner(true), *with_);
  ASSERT_TRUE(loaded.ok()) << loaded.status().message();
  CachedSequence& l = **loaded;
  ASSERT_EQ(l.checkpoints.size(), 2u);
  EXPECT_EQ(saved(*l.state), e_.snap.state);
  {
    auto twin = e_.seq->state->clone();
    auto copy = l.state->clone();
    expect_same_continuation(*with_, *twin, *copy, 7, "from the file's state");
  }
  for (int64_t pos : {8, 16}) {
    auto twin = e_.seq->state->clone();
    auto copy = l.state->clone();
    ASSERT_TRUE(twin->restore(*e_.seq->checkpoints.at(pos)).ok());
    ASSERT_TRUE(copy->restore(*l.checkpoints.at(pos)).ok());
    expect_same_continuation(*with_, *twin, *copy, 7,
                             pos == 8 ? "from the file's checkpoint at 8" : "from the file's checkpoint at 16");
  }
}

TEST_F(SessionFileMtp, AServerWithoutTheHeadUsesAFileWithIt) {
  auto info = read_session_info(path("head"), owner(false));
  ASSERT_TRUE(info.ok()) << info.status().message();
  auto loaded = read_session_file(path("head"), owner(false), *without_);
  ASSERT_TRUE(loaded.ok()) << loaded.status().message();
  auto plain = read_session_file(path("plain"), owner(false), *without_);
  ASSERT_TRUE(plain.ok()) << plain.status().message();
  EXPECT_EQ(saved(*(*loaded)->state), saved(*(*plain)->state)) << "the main state is the one without the head";
  const std::vector<int32_t> next = ids(6, 11);
  ASSERT_TRUE((*loaded)->state->restore(*(*loaded)->checkpoints.at(8)).ok());
  ASSERT_TRUE((*plain)->state->restore(*(*plain)->checkpoints.at(8)).ok());
  EXPECT_EQ(forward(*without_, *(*loaded)->state, next), forward(*without_, *(*plain)->state, next));
}

TEST_F(SessionFileMtp, AServerWithTheHeadRefusesFilesWithoutItsHeadsState) {
  Status st = read_session_info(path("plain"), owner(true)).status();
  EXPECT_EQ(st.code(), ErrorCode::unsupported) << "another server may use it: left in place";
  EXPECT_NE(st.message().find("saved without the MTP head's state (by a server without --speculative)"),
            std::string::npos)
      << st.message();
  st = refused(read_bytes(path("plain")), owner(true), *with_);
  EXPECT_EQ(st.code(), ErrorCode::unsupported) << st.message();
  SessionFileOwner other_head = owner(true);
  other_head.mtp = std::string(64, 'b');
  st = refused(read_bytes(path("head")), other_head, *with_);
  EXPECT_EQ(st.code(), ErrorCode::unsupported);
  EXPECT_NE(st.message().find("of another head (fingerprint " + owner(true).mtp.substr(0, 12)), std::string::npos)
      << st.message();
  std::vector<uint8_t> v1 = read_bytes(path("head"));
  v1[8] = 1;  // a version 1 file: no head's part, a meta without the head's fingerprint
  st = refused(v1, owner(true), *with_);
  EXPECT_EQ(st.code(), ErrorCode::unsupported);
  EXPECT_NE(st.message().find("format version 1, this build reads 2"), std::string::npos) << st.message();
}

TEST_F(SessionFileMtp, DamagedFilesWithTheHeadsStateAreRefused) {
  const std::vector<uint8_t> good = read_bytes(path("head"));
  for (size_t cut : {size_t{100}, good.size() / 2, good.size() - 40, good.size() - 1}) {
    Status st = refused(std::vector<uint8_t>(good.begin(), good.begin() + static_cast<ptrdiff_t>(cut)), owner(true),
                        *with_);
    EXPECT_EQ(st.code(), ErrorCode::format) << cut << ": " << st.message();
    EXPECT_NE(st.message().find("truncated"), std::string::npos) << st.message();
  }
  for (size_t back : {size_t{1}, size_t{3}, size_t{30}}) {  // the last checkpoint's head part (its pending row)
    std::vector<uint8_t> bad = good;
    bad[bad.size() - back] ^= 0x20;
    Status st = refused(bad, owner(true), *with_);
    EXPECT_EQ(st.code(), ErrorCode::format) << back;
    EXPECT_NE(st.message().find("checksum mismatch in the state"), std::string::npos) << st.message();
  }
  // Whole and checksummed, but the head's part says the head is past the position: the backend's checks.
  SessionSnapshot snap = e_.snap;
  const size_t at = head_part_offset(snap.tokens);
  const int64_t past = static_cast<int64_t>(snap.tokens.size()) + 1;
  std::memcpy(snap.state.data() + at + 1, &past, sizeof past);
  ASSERT_TRUE(write_session_file(path("inconsistent"), owner(true), snap).ok());
  auto r = read_session_file(path("inconsistent"), owner(true), *with_);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), ErrorCode::format) << r.status().message();
  EXPECT_NE(r.status().message().find("the MTP head at 25, the sequence at 24"), std::string::npos)
      << r.status().message();
  // A head's part with a byte more than its arrays: the file's own check of the part's length.
  snap = e_.snap;
  snap.state.push_back(0);
  ASSERT_TRUE(write_session_file(path("longer"), owner(true), snap).ok());
  r = read_session_file(path("longer"), owner(true), *with_);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("1 bytes after the sequence state"), std::string::npos) << r.status().message();
}

TEST(ModelFingerprint, TheHeadHasItsOwn) {
  const fs::path dir = tiny_model().dir / "no_mtp_mlx";
  SynthOptions o;
  o.preset = "tiny";
  o.layout = CheckpointLayout::mlx;
  o.out_dir = dir.string();
  o.mtp = false;
  ASSERT_TRUE(synth_write(o).ok());
  auto bare = ModelWeights::load(dir.string());
  auto attached = ModelWeights::load(dir.string());
  ASSERT_TRUE(bare.ok() && attached.ok());
  ASSERT_TRUE(attached->attach_mtp(tiny_model().dir.string()).ok());
  EXPECT_GT(attached->mtp_tensors, 0u);
  EXPECT_EQ(model_fingerprint(*attached), model_fingerprint(*bare)) << "--mtp-from leaves the model's alone";
  EXPECT_EQ(mtp_fingerprint(*bare), "");
  const std::string head = mtp_fingerprint(*tiny_model().weights);
  EXPECT_EQ(head.size(), 64u);
  EXPECT_EQ(mtp_fingerprint(*attached), head) << "the same head, bound from the same files";
  auto other = synth_in_memory("tiny", CheckpointLayout::mlx, 12345);
  ASSERT_TRUE(other.ok());
  EXPECT_NE(mtp_fingerprint(*other), head);
}

// -------------------------------------------------------------------------------------------- engines

std::unique_ptr<Engine> spec_engine(int k, EngineOptions o = {}) {
  o.speculative_tokens = k;
  return std::make_unique<Engine>(mtp_backend(), tiny_model().tokenizer, o);
}

bool any_refusal(const std::vector<std::string>& log) {
  return std::any_of(log.begin(), log.end(), [](const std::string& l) { return l.find("refusing") != std::string::npos; });
}

std::string only_file(const TempDir& dir) {
  std::string file;
  for (const auto& e : fs::directory_iterator(dir.path()))
    if (e.path().extension() == ".lsess") file = e.path().string();
  return file;
}

// The second turn after `reply`: greedy, or seeded sampling whose drafts are often accepted and often
// rejected (two tokens biased far above the rest), so that its tokens depend on every draft's distribution and
// so on the head's state.
GenerationRequest second_turn(const std::string& reply, bool sampled) {
  GenerationRequest r = chat(turn_two(reply), sampled ? 16 : 12);
  if (!sampled) return r;
  const int32_t x = tiny_model().tokenizer.encode("a").at(0), y = tiny_model().tokenizer.encode("b").at(0);
  r.sampling.temperature = 2.0f;
  r.sampling.logit_bias = {{x, 100.0f}, {y, 100.0f}};
  r.sampling.seed = 42;
  return r;
}

// Both turns of the conversation on one engine, memory only: the reference.
struct Reference {
  std::string reply;
  GenerationResult one, two;
};
Reference reference(Engine& engine, bool sampled = false) {
  Reference r;
  r.one = run(engine, chat(turn_one()), &r.reply);
  r.two = run(engine, second_turn(r.reply, sampled));
  return r;
}

std::unique_ptr<Engine> engine_on(const TempDir& dir, std::vector<std::string>* log, int k) {
  return k > 0 ? spec_engine(k, with_disk(dir.str(), log)) : tiny_engine(with_disk(dir.str(), log));
}

// Turn one on an engine with the disk tier (k_first drafts, 0: none), then turn two on a new engine on the same
// directory; its stats once the file of turn two is written.
GenerationResult restarted(const TempDir& dir, std::vector<std::string>* log, int k_first, int k_second,
                           const std::string& reply, bool sampled, EngineStats* stats = nullptr) {
  {
    auto first = engine_on(dir, log, k_first);
    std::string r1;
    run(*first, chat(turn_one()), &r1);
    EXPECT_EQ(r1, reply);
  }  // destroyed: the writer finishes first
  auto engine = engine_on(dir, log, k_second);
  GenerationResult r = run(*engine, second_turn(reply, sampled));
  engine->flush_disk_cache();
  if (stats) *stats = engine->stats();
  return r;
}

TEST(SessionDiskMtp, RestartedSpeculativeEngineResumesWithTheSameTokensAndDrafts) {
  auto plain = tiny_engine();
  const Reference p = reference(*plain);
  auto memory = spec_engine(2);
  const Reference m = reference(*memory);
  ASSERT_EQ(m.one.tokens, p.one.tokens);
  ASSERT_EQ(m.two.tokens, p.two.tokens);
  ASSERT_GT(m.two.cached_tokens, 0);
  ASSERT_GT(m.two.drafted_tokens, 0);

  TempDir dir("mtp_restart");
  std::vector<std::string> log;
  EngineStats s;
  GenerationResult r = restarted(dir, &log, 2, 2, p.reply, false, &s);
  EXPECT_EQ(r.cached_tokens, m.two.cached_tokens);
  EXPECT_EQ(r.cached_tokens, p.two.cached_tokens);
  EXPECT_EQ(r.tokens, p.two.tokens) << "the greedy tokens without speculation";
  EXPECT_EQ(r.speculative_steps, m.two.speculative_steps);
  EXPECT_EQ(r.drafted_tokens, m.two.drafted_tokens);
  EXPECT_EQ(r.accepted_tokens, m.two.accepted_tokens);
  EXPECT_EQ(s.disk_hits, 1u);
  EXPECT_EQ(s.disk_refused, 0u);
  EXPECT_EQ(session_files(dir.str()), 1u) << "the conversation's file was replaced";
  EXPECT_FALSE(any_refusal(log)) << ::testing::PrintToString(log);
}

TEST(SessionDiskMtp, RestartedSpeculativeEngineDrawsTheSameSampledTokens) {
  auto memory = spec_engine(2);
  const Reference m = reference(*memory, /*sampled=*/true);
  ASSERT_GT(m.two.cached_tokens, 0);
  ASSERT_GT(m.two.accepted_tokens, 0);
  ASSERT_LT(m.two.accepted_tokens, m.two.drafted_tokens);
  TempDir dir("mtp_sampled");
  std::vector<std::string> log;
  GenerationResult r = restarted(dir, &log, 2, 2, m.reply, true);
  EXPECT_EQ(r.cached_tokens, m.two.cached_tokens);
  EXPECT_EQ(r.tokens, m.two.tokens);
  EXPECT_EQ(r.drafted_tokens, m.two.drafted_tokens);
  EXPECT_EQ(r.accepted_tokens, m.two.accepted_tokens);
  EXPECT_FALSE(any_refusal(log)) << ::testing::PrintToString(log);
}

TEST(SessionDiskMtp, AFileWithoutTheHeadIsRefusedAndTheRequestPrefills) {
  auto plain = tiny_engine();
  const Reference p = reference(*plain);
  TempDir dir("mtp_mixed_a");
  std::vector<std::string> log;
  EngineStats s;
  GenerationResult r = restarted(dir, &log, 0, 2, p.reply, false, &s);
  EXPECT_EQ(r.tokens, p.two.tokens);
  EXPECT_EQ(r.cached_tokens, 0);
  EXPECT_GT(r.drafted_tokens, 0);
  EXPECT_EQ(s.disk_refused, 1u);
  EXPECT_EQ(s.disk_hits, 0u);
  int refusals = 0;
  for (const std::string& line : log)
    refusals += line.find("refusing ") != std::string::npos &&
                line.find(": saved without the MTP head's state (by a server without --speculative)") !=
                    std::string::npos &&
                line.find("; left in place") != std::string::npos;
  EXPECT_EQ(refusals, 1) << ::testing::PrintToString(log);
  EXPECT_EQ(session_files(dir.str()), 2u) << "the old file left in place, the new conversation in its own";
  // A server without the head can use both.
  log.clear();
  auto again = tiny_engine(with_disk(dir.str(), &log));
  EXPECT_EQ(again->stats().disk_files, 2u);
  EXPECT_FALSE(any_refusal(log)) << ::testing::PrintToString(log);
}

TEST(SessionDiskMtp, AFileWithTheHeadResumesAnEngineWithoutIt) {
  auto plain = tiny_engine();
  const Reference p = reference(*plain);
  TempDir dir("mtp_mixed_b");
  std::vector<std::string> log;
  EngineStats s;
  GenerationResult r = restarted(dir, &log, 2, 0, p.reply, false, &s);
  EXPECT_EQ(r.tokens, p.two.tokens);
  EXPECT_EQ(r.cached_tokens, p.two.cached_tokens);
  EXPECT_EQ(s.disk_hits, 1u);
  EXPECT_EQ(s.disk_refused, 0u);
  EXPECT_FALSE(any_refusal(log)) << ::testing::PrintToString(log);
  // The conversation went on without the head: its file, rewritten, now has none, which a server with the
  // head refuses.
  ASSERT_EQ(session_files(dir.str()), 1u);
  log.clear();
  auto spec = spec_engine(1, with_disk(dir.str(), &log));
  EXPECT_EQ(spec->stats().disk_refused, 1u);
  EXPECT_EQ(spec->stats().disk_files, 0u);
}

TEST(SessionDiskMtp, ADamagedFileWithTheHeadIsRefusedAndTheRequestPrefills) {
  auto plain = tiny_engine();
  const Reference p = reference(*plain);
  for (bool truncate : {true, false}) {
    SCOPED_TRACE(truncate ? "truncated" : "a flipped byte in the head's part");
    TempDir dir("mtp_damaged");
    std::vector<std::string> log;
    {
      auto first = spec_engine(2, with_disk(dir.str(), &log));
      run(*first, chat(turn_one()));
    }
    const std::string file = only_file(dir);
    ASSERT_FALSE(file.empty());
    std::vector<uint8_t> bytes = read_bytes(file);
    if (truncate)
      bytes.resize(bytes.size() - 7);  // the last checkpoint's head part
    else
      bytes[bytes.size() - 3] ^= 1;
    write_file(file, bytes);
    auto engine = spec_engine(2, with_disk(dir.str(), &log));
    GenerationResult r = run(*engine, second_turn(p.reply, false));
    EXPECT_EQ(r.tokens, p.two.tokens);
    EXPECT_EQ(r.cached_tokens, 0);
    EXPECT_EQ(engine->stats().disk_refused, 1u);
    EXPECT_FALSE(fs::exists(file)) << "nothing could use it: deleted";
    const char* reason = truncate ? "truncated or appended to" : "checksum mismatch in the state";
    EXPECT_TRUE(std::any_of(log.begin(), log.end(), [&](const std::string& l) {
      return l.find("refusing " + file + ": ") != std::string::npos && l.find(reason) != std::string::npos &&
             l.find("; deleted") != std::string::npos;
    })) << ::testing::PrintToString(log);
  }
}

}  // namespace
}  // namespace lily::test
