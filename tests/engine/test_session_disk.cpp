// The session cache's disk tier on the tiny model (CPU backend): a saved sequence and checkpoint load back
// and continue bit-identically; session files round-trip and every damaged or foreign file is refused with
// the reason; an engine restarted on the same directory resumes a conversation with the same greedy tokens
// as one that never stopped; the disk budget evicts the least recently used files; stale temporaries go.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "common/temp_dir.h"
#include "session_test_util.h"

namespace lily::test {
namespace {

namespace fs = std::filesystem;
using lily::testing::TempDir;

TEST(SessionSerialization, SavedSequenceContinuesBitIdentically) {
  auto be = tiny_backend();
  auto a = ids(40, 3);
  auto seq = be->new_sequence();
  forward(*be, *seq, std::span(a).first(25));
  std::vector<uint8_t> bytes = saved(*seq);
  ByteReader in(bytes);
  auto loaded = be->load_sequence(in);
  ASSERT_TRUE(loaded.ok()) << loaded.status().message();
  EXPECT_EQ(in.left(), 0u);
  EXPECT_EQ((*loaded)->n_tokens(), 25);
  EXPECT_EQ((*loaded)->bytes(), seq->bytes());
  EXPECT_EQ(forward(*be, **loaded, std::span(a).subspan(25)), forward(*be, *seq, std::span(a).subspan(25)));
}

TEST(SessionSerialization, SavedCheckpointRestoresLikeTheOriginal) {
  auto be = tiny_backend();
  auto a = ids(30, 4), b = ids(30, 5);
  std::copy(a.begin(), a.begin() + 10, b.begin());
  auto seq = be->new_sequence();
  forward(*be, *seq, std::span(a).first(10));
  auto cp = seq->checkpoint();
  forward(*be, *seq, std::span(a).subspan(10));
  std::vector<uint8_t> state = saved(*seq), cp_bytes = saved(*cp);
  ByteReader sin(state), cin(cp_bytes);
  auto seq2 = be->load_sequence(sin);
  auto cp2 = be->load_checkpoint(cin);
  ASSERT_TRUE(seq2.ok() && cp2.ok());
  EXPECT_EQ((*cp2)->n_tokens(), 10);
  EXPECT_EQ((*cp2)->bytes(), cp->bytes());
  ASSERT_TRUE((*seq2)->restore(**cp2).ok());
  ASSERT_TRUE(seq->restore(*cp).ok());
  EXPECT_EQ(forward(*be, **seq2, std::span(b).subspan(10)), forward(*be, *seq, std::span(b).subspan(10)));
}

TEST(SessionSerialization, AFreshSequenceRoundTrips) {
  auto be = tiny_backend();
  auto seq = be->new_sequence();
  std::vector<uint8_t> bytes = saved(*seq);
  ByteReader in(bytes);
  auto loaded = be->load_sequence(in);
  ASSERT_TRUE(loaded.ok()) << loaded.status().message();
  auto a = ids(8, 6);
  EXPECT_EQ(forward(*be, **loaded, a), forward(*be, *seq, a));
}

TEST(SessionSerialization, ShortOrMisshapenStateIsAFormatError) {
  auto be = tiny_backend();
  auto seq = be->new_sequence();
  forward(*be, *seq, ids(12, 7));
  std::vector<uint8_t> bytes = saved(*seq);
  for (size_t cut : {size_t{0}, size_t{5}, size_t{12}, bytes.size() / 2, bytes.size() - 1}) {
    ByteReader in(std::span<const uint8_t>(bytes).first(cut));
    auto r = be->load_sequence(in);
    ASSERT_FALSE(r.ok()) << cut;
    EXPECT_EQ(r.status().code(), ErrorCode::format) << r.status().message();
  }
  std::vector<uint8_t> bad = bytes;
  const uint32_t layers = 99;  // the layer count follows the position
  std::memcpy(bad.data() + 8, &layers, 4);
  ByteReader in(bad);
  auto r = be->load_sequence(in);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("99 layers"), std::string::npos) << r.status().message();
}

Entry entry(Backend& be, int n, int salt) { return test::entry(be, n, salt, {16, n - 1}); }

TEST(SessionFile, RoundTripsAnEntry) {
  TempDir dir("sessfile");
  auto be = tiny_backend();
  Entry e = entry(*be, 24, 8);
  const std::string path = dir / "a.lsess";
  auto bytes = write_session_file(path, owner(), e.snap);
  ASSERT_TRUE(bytes.ok()) << bytes.status().message();
  EXPECT_EQ(*bytes, fs::file_size(path));
  EXPECT_EQ(fs::status(path).permissions() & fs::perms::all, fs::perms::owner_read | fs::perms::owner_write);
  EXPECT_FALSE(write_session_file(path, owner(), e.snap).ok());  // never over an existing file
  auto info = read_session_info(path, owner());
  ASSERT_TRUE(info.ok()) << info.status().message();
  EXPECT_EQ(info->tokens, e.seq->tokens);
  EXPECT_EQ(info->checkpoints, (std::vector<int64_t>{8, 16}));
  EXPECT_EQ(info->file_bytes, *bytes);
  auto loaded = read_session_file(path, owner(), *be);
  ASSERT_TRUE(loaded.ok()) << loaded.status().message();
  CachedSequence& l = **loaded;
  EXPECT_EQ(l.tokens, e.seq->tokens);
  EXPECT_EQ(l.anchor, 16);
  EXPECT_EQ(l.recent_marks, e.seq->recent_marks);
  ASSERT_EQ(l.checkpoints.size(), 2u);
  // Resumed at the checkpoint at 8 with other tokens after it: the same logits as the original entry.
  auto next = ids(10, 9);
  ASSERT_TRUE(l.state->restore(*l.checkpoints.at(8)).ok());
  ASSERT_TRUE(e.seq->state->restore(*e.seq->checkpoints.at(8)).ok());
  EXPECT_EQ(forward(*be, *l.state, next), forward(*be, *e.seq->state, next));
}

class SessionFileChecks : public ::testing::Test {
 protected:
  void SetUp() override {
    be_ = tiny_backend();
    Entry e = entry(*be_, 24, 10);
    ASSERT_TRUE(write_session_file(dir_ / "good.lsess", owner(), e.snap).ok());
    good_ = read_bytes(dir_ / "good.lsess");
  }
  // The reason read_session_file gives for `bytes` (written to a file), and its code.
  Status refused(const std::vector<uint8_t>& bytes, const SessionFileOwner& who = owner()) {
    const std::string path = dir_ / "x.lsess";
    write_file(path, bytes);
    auto r = read_session_file(path, who, *be_);
    EXPECT_FALSE(r.ok());
    return r.ok() ? Status() : r.status();
  }
  TempDir dir_{"sesscheck"};
  std::unique_ptr<Backend> be_;
  std::vector<uint8_t> good_;
};

TEST_F(SessionFileChecks, Truncated) {
  for (size_t cut : {size_t{0}, size_t{7}, size_t{127}, size_t{200}, good_.size() - 1}) {
    Status st = refused(std::vector<uint8_t>(good_.begin(), good_.begin() + static_cast<ptrdiff_t>(cut)));
    EXPECT_EQ(st.code(), ErrorCode::format) << cut << ": " << st.message();
    EXPECT_NE(st.message().find("truncated"), std::string::npos) << st.message();
  }
}

TEST_F(SessionFileChecks, FlippedBytes) {
  for (size_t at : {size_t{140}, good_.size() / 2, good_.size() - 1}) {  // in the token ids; in the state
    std::vector<uint8_t> bad = good_;
    bad[at] ^= 0x10;
    Status st = refused(bad);
    EXPECT_EQ(st.code(), ErrorCode::format) << at;
    EXPECT_NE(st.message().find("checksum mismatch"), std::string::npos) << st.message();
  }
}

TEST_F(SessionFileChecks, ForeignModelBackendOrVersion) {
  Status st = refused(good_, SessionFileOwner{std::string(64, 'a'), "cpu", ""});
  EXPECT_EQ(st.code(), ErrorCode::unsupported);
  EXPECT_NE(st.message().find("another model"), std::string::npos) << st.message();
  st = refused(good_, SessionFileOwner{owner().fingerprint, "cuda", ""});
  EXPECT_EQ(st.code(), ErrorCode::unsupported);
  EXPECT_NE(st.message().find("saved by the cpu backend, this server runs cuda"), std::string::npos)
      << st.message();
  for (uint8_t version : {1, 3}) {  // 1: before the MTP head's part; the version follows the 8-byte magic
    std::vector<uint8_t> other = good_;
    other[8] = version;
    st = refused(other);
    EXPECT_EQ(st.code(), ErrorCode::unsupported);
    EXPECT_NE(st.message().find(format("format version %u, this build reads 2", version)), std::string::npos)
        << st.message();
  }
}

TEST_F(SessionFileChecks, JunkAppendedAndUnreadable) {
  std::vector<uint8_t> junk(5000);
  for (size_t i = 0; i < junk.size(); ++i) junk[i] = static_cast<uint8_t>(i * 2654435761u >> 13);
  Status st = refused(junk);
  EXPECT_EQ(st.code(), ErrorCode::format);
  EXPECT_NE(st.message().find("no magic"), std::string::npos) << st.message();
  std::vector<uint8_t> longer = good_;
  longer.push_back(0);
  st = refused(longer);
  EXPECT_EQ(st.code(), ErrorCode::format);
  EXPECT_NE(st.message().find("appended"), std::string::npos) << st.message();
  fs::create_directory(dir_ / "d.lsess");
  auto r = read_session_info(dir_ / "d.lsess", owner());
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), ErrorCode::io) << r.status().message();
  r = read_session_info(dir_ / "missing.lsess", owner());
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), ErrorCode::not_found);
}

TEST(ModelFingerprint, DistinguishesCheckpoints) {
  const std::string a = model_fingerprint(*tiny_model().weights);
  EXPECT_EQ(a.size(), 64u);
  EXPECT_EQ(a, model_fingerprint(*tiny_model().weights));
  auto same = synth_in_memory("tiny", CheckpointLayout::mlx, 0);       // tiny_model()'s, not from its files
  auto other = synth_in_memory("tiny", CheckpointLayout::mlx, 12345);  // the same geometry, other weights
  ASSERT_TRUE(same.ok() && other.ok());
  EXPECT_EQ(model_fingerprint(*same), a);
  EXPECT_NE(model_fingerprint(*other), a);
}

TEST(SessionDisk, RestartedEngineResumesWithTheSameTokens) {
  // Reference: both turns on one engine, memory only.
  auto ref = tiny_engine();
  std::string reply;
  GenerationResult ref1 = run(*ref, chat(turn_one()), &reply);
  GenerationResult ref2 = run(*ref, chat(turn_two(reply)));
  ASSERT_GT(ref2.cached_tokens, 0);

  TempDir dir("restart");
  std::vector<std::string> log;
  {
    auto first = tiny_engine(with_disk(dir.str(), &log));
    std::string r1;
    GenerationResult t1 = run(*first, chat(turn_one()), &r1);
    EXPECT_EQ(t1.tokens, ref1.tokens);
    EXPECT_EQ(r1, reply);
  }  // destroyed: the writer finishes first
  EXPECT_EQ(session_files(dir.str()), 1u);
  auto second = tiny_engine(with_disk(dir.str(), &log));
  GenerationResult t2 = run(*second, chat(turn_two(reply)));
  EXPECT_EQ(t2.cached_tokens, ref2.cached_tokens);
  EXPECT_EQ(t2.tokens, ref2.tokens);
  EngineStats s = second->stats();
  EXPECT_EQ(s.disk_hits, 1u);
  EXPECT_EQ(s.cache_hits, 1u);
  second->flush_disk_cache();
  EXPECT_EQ(session_files(dir.str()), 1u);  // the conversation's file was replaced, not added to
  for (const std::string& line : log) EXPECT_EQ(line.find("refusing"), std::string::npos) << line;
}

TEST(SessionDisk, AnEntryEvictedFromMemoryLoadsFromItsFile) {
  auto ref = tiny_engine();
  std::string reply;
  run(*ref, chat(turn_one()), &reply);
  GenerationResult ref2 = run(*ref, chat(turn_two(reply)));

  TempDir dir("evicted");
  std::vector<std::string> log;
  EngineOptions o = with_disk(dir.str(), &log);
  o.session_cache_bytes = 1;  // every entry leaves memory as soon as it is released
  auto engine = tiny_engine(o);
  run(*engine, chat(turn_one()));
  engine->flush_disk_cache();
  EXPECT_EQ(engine->stats().cache_entries, 0u);
  GenerationResult t2 = run(*engine, chat(turn_two(reply)));
  EXPECT_EQ(t2.cached_tokens, ref2.cached_tokens);
  EXPECT_EQ(t2.tokens, ref2.tokens);
  EXPECT_EQ(engine->stats().disk_hits, 1u);
}

TEST(SessionDisk, ABadFileIsRefusedAndTheRequestPrefills) {
  auto ref = tiny_engine();
  std::string reply;
  run(*ref, chat(turn_one()), &reply);
  GenerationResult ref2 = run(*ref, chat(turn_two(reply)));

  TempDir dir("refuse");
  std::vector<std::string> log;
  {
    auto first = tiny_engine(with_disk(dir.str(), &log));
    run(*first, chat(turn_one()));
  }
  ASSERT_EQ(session_files(dir.str()), 1u);
  std::string file;
  for (const auto& e : fs::directory_iterator(dir.path())) file = e.path().string();
  std::vector<uint8_t> bytes = read_bytes(file);
  bytes[bytes.size() - 3] ^= 1;  // in the state: the header and tokens still index
  write_file(file, bytes);
  write_file(dir / "junk.lsess", std::vector<uint8_t>(300, 7));
  write_file(dir / "notes.txt", {'h', 'i'});
  log.clear();
  auto second = tiny_engine(with_disk(dir.str(), &log));
  ASSERT_FALSE(fs::exists(dir / "junk.lsess"));
  GenerationResult t2 = run(*second, chat(turn_two(reply)));
  EXPECT_EQ(t2.tokens, ref2.tokens);
  EXPECT_EQ(t2.cached_tokens, 0);
  EXPECT_FALSE(fs::exists(file));
  EXPECT_TRUE(fs::exists(dir / "notes.txt"));
  int refusals = 0;
  for (const std::string& line : log) {
    if (line.find("refusing " + file + ": checksum mismatch in the state; deleted") != std::string::npos)
      ++refusals;
    if (line.find("junk.lsess: not a lily session file (no magic); deleted") != std::string::npos) ++refusals;
    if (line.find("ignoring " + (dir / "notes.txt")) != std::string::npos) ++refusals;
  }
  EXPECT_EQ(refusals, 3) << ::testing::PrintToString(log);
  EXPECT_EQ(second->stats().disk_refused, 2u);
}

TEST(SessionDisk, BudgetEvictsTheLeastRecentlyUsedFiles) {
  TempDir dir("budget");
  std::vector<std::string> log;
  auto probe = tiny_engine(with_disk(dir.str(), &log));
  run(*probe, greedy_request(ids(40, 1), 3));
  probe->flush_disk_cache();
  const uint64_t one = probe->stats().disk_bytes;
  ASSERT_GT(one, 0u);
  probe.reset();
  fs::remove_all(dir.path());

  auto engine = tiny_engine(with_disk(dir.str(), &log, one * 5 / 2));  // room for two
  for (int salt = 1; salt <= 4; ++salt) {
    run(*engine, greedy_request(ids(40, salt), 3));
    engine->flush_disk_cache();
  }
  EngineStats s = engine->stats();
  EXPECT_EQ(s.disk_files, 2u);
  EXPECT_EQ(s.disk_evictions, 2u);
  EXPECT_LE(s.disk_bytes, one * 5 / 2);
  EXPECT_EQ(session_files(dir.str()), 2u);
  // The two kept are the last two; the first is gone from memory too after clear_cache.
  engine->clear_cache();
  EXPECT_EQ(run(*engine, greedy_request(ids(40, 4), 3)).cached_tokens, 39);
  EXPECT_EQ(run(*engine, greedy_request(ids(40, 1), 3)).cached_tokens, 0);
}

TEST(SessionDisk, StaleTemporariesGoAndAnUnusableDirectoryTurnsTheTierOff) {
  TempDir dir("tmp");
  write_file(dir / ".0123456789abcdef.999999999.1.tmp", {1, 2, 3});  // no such process
  const std::string live = format(".0123456789abcdef.%d.1.tmp", (int)::getppid());
  write_file(dir / live, {1, 2, 3});
  std::vector<std::string> log;
  auto d = SessionDisk::open(
      SessionDiskOptions{dir.str(), 1 << 20, 1 << 20, [&](const std::string& l) { log.push_back(l); }},
      owner());
  ASSERT_TRUE(d);
  EXPECT_FALSE(fs::exists(dir / ".0123456789abcdef.999999999.1.tmp"));
  EXPECT_TRUE(fs::exists(dir / live));  // another running process may be writing it

  write_file(dir / "plain", {1});
  log.clear();
  EXPECT_FALSE(SessionDisk::open(
      SessionDiskOptions{dir / "plain", 0, 1 << 20, [&](const std::string& l) { log.push_back(l); }},
      owner()));
  EXPECT_FALSE(SessionDisk::open(
      SessionDiskOptions{dir / "plain/sub", 0, 1 << 20, [&](const std::string& l) { log.push_back(l); }},
      owner()));
  ASSERT_EQ(log.size(), 2u);
  EXPECT_NE(log[0].find("not a directory; sessions are kept in memory only"), std::string::npos) << log[0];
  EXPECT_NE(log[1].find("cannot create it"), std::string::npos) << log[1];
  // A missing directory is created.
  EXPECT_TRUE(SessionDisk::open(
      SessionDiskOptions{dir / "new/deeper", 0, 1 << 20, [&](const std::string& l) { log.push_back(l); }},
      owner()));
  EXPECT_TRUE(fs::is_directory(dir / "new/deeper"));
  EXPECT_EQ(fs::status(dir / "new/deeper").permissions() & fs::perms::all, fs::perms::owner_all);
}

}  // namespace
}  // namespace lily::test
