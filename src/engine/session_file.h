// Session files: one cached sequence (engine/session_cache.h) on disk, for the disk tier of `lily serve
// --cache-dir` (docs/DESIGN.md section 2). A file is
//   header (128 bytes): magic "LILYSESS", format version, the model fingerprint, the backend's name, the
//            sizes of the two parts below, an XXH64 of the header and meta, an XXH64 of the payload
//   meta:    the token ids the state has consumed, the anchor, the recent marks, the checkpoint positions
//   payload: SequenceState::save (KV up to n_tokens + recurrent state), then Checkpoint::save of each
// so the index reads header + meta only (the tokens a prompt is matched against) and a load checks the whole
// file before the backend sees any of it. Values are in the host's byte order.
//
// The model fingerprint is a SHA-256 over config.json's fields (ModelConfig::to_json_text), the checkpoint
// layout, the name, shape, dtype and bits of the embedding, lm_head and each layer's first projection, the
// bound tensor count and bytes, and the first and last 4 KiB of the embedding, lm_head and those projections
// plus every norm vector: two checkpoints of one geometry (another seed, another quantization) differ there.
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

constexpr uint32_t kSessionFileVersion = 1;
constexpr const char* kSessionFileSuffix = ".lsess";

std::string model_fingerprint(const ModelWeights& weights);  // 64 hex digits

// What a file must match to be loaded: this model on this backend.
struct SessionFileOwner {
  std::string fingerprint;  // model_fingerprint()
  std::string backend;      // Backend::name()
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
