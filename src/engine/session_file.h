// Session files: one cached sequence (engine/session_cache.h) on disk, for the disk tier of `lily serve
// --cache-dir` (docs/DESIGN.md section 2). A file is
//   header (128 bytes): magic "LILYSESS", format version, the model fingerprint, the backend's name, the
//            sizes of the two parts below, an XXH64 of the header and meta, an XXH64 of the payload
//   meta:    the token ids the state has consumed, the anchor, the recent marks, the checkpoint positions, and
//            the MTP head's fingerprint (64 hex digits; all zero bytes: the state holds no head state)
//   payload: SequenceState::save (KV up to n_tokens + recurrent state, + the MTP head's state when the server's
//            backend has the head on), then Checkpoint::save of each (+ the head's part: its KV length, the
//            rows it has not read)
// so the index reads header + meta only (the tokens a prompt is matched against) and a load checks the whole
// file before the backend sees any of it. Values are in the host's byte order.
//
// Versions: 1 had no MTP head's part (a server with --speculative could not use it); such a file is refused
// as another format version and left in place.
//
// The MTP head (`--speculative mtp:K`). A server with the head on keeps the head's state in every sequence
// (Backend::enable_mtp), and a file it writes holds that state too, so a conversation resumed after a restart
// drafts exactly as it would have without the restart (the same drafts, acceptances and, with a seed, the same
// sampled tokens). The two mixed cases:
// - A file without the head's state (written by a server without --speculative), read by a server with the
//   head on: refused (unsupported, left in place for such a server). The head's KV entries are computed from
//   the main model's hidden rows of every position, which the file does not hold and only a prefill
//   recomputes; loaded without them the head would attend over missing entries for the rest of that
//   conversation, its drafts mostly rejected, and a server run for speed would decode that conversation
//   slower than with no speculation, and differently from one that prefilled. One prefill gives it back the
//   head's full state, from then on kept in its new file. Likewise a head's state of another head (a
//   different --mtp-from: another head fingerprint).
// - A file with the head's state, read by a server without the head: used. The main model's state is whole and
//   exactly what a prefill computes (the output is that of a prefill, to the bit), and the backend reads past
//   the head's part; the file is rewritten without it once the conversation goes on there.
//
// The model fingerprint is a SHA-256 over config.json's fields (ModelConfig::to_json_text), the checkpoint
// layout, the name, shape, dtype and bits of the embedding, lm_head and each layer's first projection, the
// bound tensor count and bytes (the MTP head's not counted), and the first and last 4 KiB of the embedding,
// lm_head and those projections plus every norm vector: two checkpoints of one geometry (another seed, another
// quantization) differ there. The MTP head's fingerprint is its own (mtp_fingerprint: its tensors' count and
// bytes, its fc and attention projection, its norms), so the model's does not change with --mtp-from and a
// file of one is usable by a server with or without the head as above.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "engine/backend.h"
#include "engine/session_cache.h"
#include "util/status.h"

namespace lily {

constexpr uint32_t kSessionFileVersion = 2;
constexpr const char* kSessionFileSuffix = ".lsess";

std::string model_fingerprint(const ModelWeights& weights);  // 64 hex digits
std::string mtp_fingerprint(const ModelWeights& weights);    // 64 hex digits; "" without a head

// What a file must match to be loaded: this model on this backend, and the MTP head when it is on.
struct SessionFileOwner {
  std::string fingerprint;  // model_fingerprint()
  std::string backend;      // Backend::name()
  // mtp_fingerprint() when the backend's sequences carry the head's state (Backend::mtp_enabled), else "".
  // Written into the files; a file must have this one (see above) unless it is "".
  std::string mtp;
};

// An entry as the writer thread gets it: the state already saved (it changes once the entry is reused), the
// checkpoints by reference (they are immutable).
struct SessionSnapshot {
  std::vector<int32_t> tokens;
  int64_t anchor = 0;
  std::vector<int64_t> recent_marks;
  std::vector<uint8_t> state;  // SequenceState::save
  std::map<int64_t, std::shared_ptr<const Checkpoint>> checkpoints;
  size_t bytes() const;  // held in memory while it waits for the writer (checkpoints not counted)
};

// Writes a new file at `path` (which must not exist) and syncs it; its size. The checkpoints are saved here,
// one at a time. A failed write leaves a partial file for the caller to remove.
Result<uint64_t> write_session_file(const std::string& path, const SessionFileOwner& owner,
                                    const SessionSnapshot& s);

// What the index keeps of a file.
struct SessionFileInfo {
  std::vector<int32_t> tokens;
  std::vector<int64_t> checkpoints;  // positions, ascending
  uint64_t file_bytes = 0;
};

// Errors say what is wrong with the file (the caller names it): ErrorCode::unsupported for a well-formed file
// of another model, backend or format version (left alone: another server may use it); format for a
// truncated, corrupt or foreign file (nothing another server could use either); io when it cannot be read;
// not_found when it is gone (evicted meanwhile).
Result<SessionFileInfo> read_session_info(const std::string& path, const SessionFileOwner& owner);
// The entry itself, its state and checkpoints loaded into `backend` (out_of_range: no memory for them).
Result<std::unique_ptr<CachedSequence>> read_session_file(const std::string& path,
                                                          const SessionFileOwner& owner, Backend& backend);

}  // namespace lily
