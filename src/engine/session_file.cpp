#include "engine/session_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "util/sha256.h"

namespace lily {

namespace {

constexpr char kMagic[8] = {'L', 'I', 'L', 'Y', 'S', 'E', 'S', 'S'};
constexpr size_t kHeaderBytes = 128;
// Bounds on what a header may announce, so a corrupt size cannot ask for absurd allocations: the meta is
// token ids and positions (a 262,144-token context is 1 MiB of ids).
constexpr uint64_t kMaxMetaBytes = 64ull << 20;
constexpr size_t kMtpFingerprintBytes = 64;

struct Header {
  char magic[8];
  uint32_t version;
  uint32_t header_bytes;
  char fingerprint[64];
  char backend[16];
  uint64_t meta_bytes;
  uint64_t payload_bytes;
  uint64_t meta_hash;     // XXH64 of the header up to here and the meta
  uint64_t payload_hash;  // XXH64 of the payload
};
static_assert(sizeof(Header) <= kHeaderBytes);
constexpr size_t kMetaHashOffset = offsetof(Header, meta_hash);

void hash_linear(Sha256& h, const char* name, const Linear& l) {
  std::string desc =
      format("%s %lld %lld %d %d|", name, (long long)l.out, (long long)l.in, (int)l.dtype, l.bits);
  h.update(desc.data(), desc.size());
  const size_t n =
      l.out * l.in * (l.quantized() ? l.bits : 8 * static_cast<int64_t>(dtype_size(l.dtype))) / 8;
  const size_t edge = std::min<size_t>(n, 4096);
  if (l.w && edge > 0) {
    const auto* p = static_cast<const uint8_t*>(l.w);
    h.update(p, edge);
    h.update(p + n - edge, edge);
  }
}

void hash_floats(Sha256& h, const std::vector<float>& v) {
  h.update(v.data(), v.size() * sizeof(float));
}

// One file, read whole or its first n bytes.
class File {
 public:
  ~File() {
    if (fd_ >= 0) ::close(fd_);
  }
  Status open(const std::string& path) {
    fd_ = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);  // O_NONBLOCK: a FIFO must not hang us
    if (fd_ < 0)
      return error(errno == ENOENT ? ErrorCode::not_found : ErrorCode::io, "cannot open: %s",
                   std::strerror(errno));
    struct stat st {};
    if (::fstat(fd_, &st) != 0) return io_error("cannot stat: %s", std::strerror(errno));
    if (!S_ISREG(st.st_mode)) return io_error("not a regular file");
    size_ = static_cast<uint64_t>(st.st_size);
    return ok_status();
  }
  Status read(void* dst, size_t n, uint64_t offset) {
    auto* p = static_cast<uint8_t*>(dst);
    while (n > 0) {
      ssize_t got = ::pread(fd_, p, n, static_cast<off_t>(offset));
      if (got < 0 && errno == EINTR) continue;
      if (got < 0) return io_error("read failed: %s", std::strerror(errno));
      if (got == 0) return format_error("truncated: ends at %llu bytes", (unsigned long long)offset);
      p += got, n -= static_cast<size_t>(got), offset += static_cast<uint64_t>(got);
    }
    return ok_status();
  }
  uint64_t size() const { return size_; }

 private:
  int fd_ = -1;
  uint64_t size_ = 0;
};

std::string field(const char* p, size_t n) {
  return std::string(p, strnlen(p, n));
}

// The header's checks, in the order that names the most useful reason first.
Status check_header(const Header& h, const SessionFileOwner& owner, uint64_t file_bytes) {
  if (std::memcmp(h.magic, kMagic, sizeof kMagic) != 0)
    return format_error("not a lily session file (no magic)");
  if (h.version != kSessionFileVersion)
    return error(ErrorCode::unsupported, "format version %u, this build reads %u", h.version,
                 kSessionFileVersion);
  if (h.header_bytes != kHeaderBytes)
    return format_error("header of %u bytes, expected %zu", h.header_bytes, kHeaderBytes);
  const std::string fp = field(h.fingerprint, sizeof h.fingerprint), be = field(h.backend, sizeof h.backend);
  if (fp != owner.fingerprint)
    return error(ErrorCode::unsupported, "another model (fingerprint %.12s..., this model's %.12s...)",
                 fp.c_str(), owner.fingerprint.c_str());
  if (be != owner.backend)
    return error(ErrorCode::unsupported, "saved by the %s backend, this server runs %s", be.c_str(),
                 owner.backend.c_str());
  if (h.meta_bytes > kMaxMetaBytes)
    return format_error("meta of %llu bytes", (unsigned long long)h.meta_bytes);
  const uint64_t expect = kHeaderBytes + h.meta_bytes + h.payload_bytes;
  if (h.payload_bytes > file_bytes || expect != file_bytes)
    return format_error("%llu bytes, the header says %llu (truncated or appended to)",
                        (unsigned long long)file_bytes, (unsigned long long)expect);
  return ok_status();
}

uint64_t meta_hash(const uint8_t* header, std::span<const uint8_t> meta) {
  std::vector<uint8_t> buf(header, header + kMetaHashOffset);
  buf.insert(buf.end(), meta.begin(), meta.end());
  return xxhash64(buf.data(), buf.size());
}

struct Meta {
  std::vector<int32_t> tokens;
  int64_t anchor = 0;
  std::vector<int64_t> marks, checkpoints;
  std::string mtp;  // the MTP head's fingerprint; "": no head state
};

Status parse_meta(std::span<const uint8_t> bytes, Meta& m) {
  ByteReader in(bytes);
  uint64_t n = 0;
  RETURN_IF_ERROR(in.pod(&n, "token count"));
  if (n > in.left() / sizeof(int32_t))
    return format_error("%llu tokens in a meta of %zu bytes", (unsigned long long)n, bytes.size());
  m.tokens.resize(n);
  RETURN_IF_ERROR(in.bytes(m.tokens.data(), n * sizeof(int32_t), "tokens"));
  RETURN_IF_ERROR(in.pod(&m.anchor, "anchor"));
  for (auto* list : {&m.marks, &m.checkpoints}) {
    uint32_t k = 0;
    RETURN_IF_ERROR(in.pod(&k, "position count"));
    if (k > in.left() / sizeof(int64_t)) return format_error("%u positions in the rest of the meta", k);
    list->resize(k);
    RETURN_IF_ERROR(in.bytes(list->data(), k * sizeof(int64_t), "positions"));
  }
  char mtp[kMtpFingerprintBytes];
  RETURN_IF_ERROR(in.bytes(mtp, sizeof mtp, "MTP head fingerprint"));
  m.mtp = field(mtp, sizeof mtp);
  if (in.left() != 0) return format_error("%zu bytes after the meta", in.left());
  const auto len = static_cast<int64_t>(n);
  for (size_t i = 0; i < m.checkpoints.size(); ++i)
    if (m.checkpoints[i] <= 0 || m.checkpoints[i] > len ||
        (i > 0 && m.checkpoints[i] <= m.checkpoints[i - 1]))
      return format_error("checkpoint position %lld (of %lld tokens, ascending)", (long long)m.checkpoints[i],
                          (long long)len);
  if (m.anchor < 0 || m.anchor > len)
    return format_error("anchor %lld outside [0, %lld]", (long long)m.anchor, (long long)len);
  return ok_status();
}

// A server with the MTP head on takes only files with its head's state (session_file.h says why); one without
// takes either kind (the backend reads past the head's part).
Status check_mtp(const std::string& file_mtp, const SessionFileOwner& owner) {
  if (owner.mtp.empty() || file_mtp == owner.mtp) return ok_status();
  if (file_mtp.empty())
    return error(ErrorCode::unsupported,
                 "saved without the MTP head's state (by a server without --speculative); this server drafts with "
                 "the head, whose state only a prefill rebuilds");
  return error(ErrorCode::unsupported,
               "the MTP head's state of another head (fingerprint %.12s..., this head's %.12s...)", file_mtp.c_str(),
               owner.mtp.c_str());
}

// Header and meta checked (their hash included); the caller reads the payload.
Status read_head(File& f, const SessionFileOwner& owner, Header& h, std::vector<uint8_t>& head, Meta& m) {
  if (f.size() < kHeaderBytes)
    return format_error("truncated: %llu bytes, a header is %zu", (unsigned long long)f.size(), kHeaderBytes);
  head.resize(kHeaderBytes);
  RETURN_IF_ERROR(f.read(head.data(), kHeaderBytes, 0));
  std::memcpy(&h, head.data(), sizeof h);
  RETURN_IF_ERROR(check_header(h, owner, f.size()));
  head.resize(kHeaderBytes + h.meta_bytes);
  RETURN_IF_ERROR(f.read(head.data() + kHeaderBytes, h.meta_bytes, kHeaderBytes));
  std::span<const uint8_t> meta(head.data() + kHeaderBytes, h.meta_bytes);
  if (meta_hash(head.data(), meta) != h.meta_hash)
    return format_error("checksum mismatch in the header or token ids");
  RETURN_IF_ERROR(parse_meta(meta, m));
  return check_mtp(m.mtp, owner);
}

}  // namespace

std::string model_fingerprint(const ModelWeights& w) {
  Sha256 h;
  const std::string cfg = w.config.to_json_text(false);
  h.update(cfg.data(), cfg.size());
  std::string desc = format("|%s|%zu|%zu|", layout_name(w.layout), w.n_tensors - w.mtp_tensors,
                            w.tensor_bytes - w.mtp_tensor_bytes);
  h.update(desc.data(), desc.size());
  hash_linear(h, "embed_tokens", w.embed_tokens);
  hash_linear(h, "lm_head", w.lm_head);
  hash_floats(h, w.final_norm);
  for (const LayerWeights& l : w.layers) {
    hash_floats(h, l.input_norm);
    hash_floats(h, l.post_attention_norm);
    if (l.type == LayerType::full_attention)
      hash_linear(h, "q_proj", l.attn.q_proj);
    else
      hash_linear(h, "in_proj_qkv", l.gdn.in_proj_qkv);
  }
  return h.hex_digest();
}

std::string mtp_fingerprint(const ModelWeights& w) {
  if (!w.mtp) return "";
  const MtpWeights& m = *w.mtp;
  Sha256 h;
  std::string desc = format("mtp|%zu|%zu|", w.mtp_tensors, w.mtp_tensor_bytes);
  h.update(desc.data(), desc.size());
  hash_linear(h, "fc", m.fc);
  hash_linear(h, "q_proj", m.layer.attn.q_proj);
  for (const std::vector<float>* v : {&m.pre_fc_norm_embedding, &m.pre_fc_norm_hidden, &m.norm,
                                      &m.layer.input_norm, &m.layer.post_attention_norm})
    hash_floats(h, *v);
  return h.hex_digest();
}

size_t SessionSnapshot::bytes() const {
  return state.size() + (tokens.size() + 1) * sizeof(int32_t);
}

namespace {

Status write_all(int fd, const void* data, size_t n) {
  const auto* p = static_cast<const uint8_t*>(data);
  while (n > 0) {
    ssize_t put = ::write(fd, p, n);
    if (put < 0 && errno == EINTR) continue;
    if (put < 0) return io_error("write failed: %s", std::strerror(errno));
    p += put, n -= static_cast<size_t>(put);
  }
  return ok_status();
}

// Header and meta go first with the header still blank, then the payload piece by piece (one checkpoint in
// host memory at a time), then the finished header over the blank one.
Status write_parts(int fd, const SessionFileOwner& owner, const SessionSnapshot& s, uint64_t* file_bytes) {
  std::vector<uint8_t> head(kHeaderBytes, 0);
  ByteWriter w(head);
  w.pod<uint64_t>(s.tokens.size());
  w.bytes(s.tokens.data(), s.tokens.size() * sizeof(int32_t));
  w.pod<int64_t>(s.anchor);
  w.pod<uint32_t>(static_cast<uint32_t>(s.recent_marks.size()));
  w.bytes(s.recent_marks.data(), s.recent_marks.size() * sizeof(int64_t));
  w.pod<uint32_t>(static_cast<uint32_t>(s.checkpoints.size()));
  for (const auto& [pos, cp] : s.checkpoints) w.pod<int64_t>(pos);
  char mtp[kMtpFingerprintBytes] = {};
  std::memcpy(mtp, owner.mtp.data(), std::min(owner.mtp.size(), sizeof mtp));
  w.bytes(mtp, sizeof mtp);
  RETURN_IF_ERROR(write_all(fd, head.data(), head.size()));

  Xxh64 hash;
  uint64_t payload_bytes = 0;
  auto put = [&](const void* p, size_t n) {
    hash.update(p, n);
    payload_bytes += n;
    return write_all(fd, p, n);
  };
  const uint64_t state_len = s.state.size();
  RETURN_IF_ERROR(put(&state_len, sizeof state_len));
  RETURN_IF_ERROR(put(s.state.data(), s.state.size()));
  std::vector<uint8_t> part;
  for (const auto& [pos, cp] : s.checkpoints) {
    part.clear();
    ByteWriter pw(part);
    RETURN_IF_ERROR(cp->save(pw));
    const uint64_t len = part.size();
    RETURN_IF_ERROR(put(&len, sizeof len));
    RETURN_IF_ERROR(put(part.data(), part.size()));
  }

  Header h{};
  std::memcpy(h.magic, kMagic, sizeof kMagic);
  h.version = kSessionFileVersion;
  h.header_bytes = kHeaderBytes;
  std::memcpy(h.fingerprint, owner.fingerprint.data(),
              std::min(owner.fingerprint.size(), sizeof h.fingerprint));
  std::memcpy(h.backend, owner.backend.data(), std::min(owner.backend.size(), sizeof h.backend - 1));
  h.meta_bytes = head.size() - kHeaderBytes;
  h.payload_bytes = payload_bytes;
  std::memcpy(head.data(), &h, sizeof h);
  h.meta_hash = meta_hash(head.data(), std::span<const uint8_t>(head.data() + kHeaderBytes, h.meta_bytes));
  h.payload_hash = hash.digest();
  if (::pwrite(fd, &h, sizeof h, 0) != static_cast<ssize_t>(sizeof h))
    return io_error("write failed: %s", std::strerror(errno));
  if (::fdatasync(fd) != 0) return io_error("fdatasync failed: %s", std::strerror(errno));
  *file_bytes = head.size() + payload_bytes;
  return ok_status();
}

}  // namespace

Result<uint64_t> write_session_file(const std::string& path, const SessionFileOwner& owner,
                                    const SessionSnapshot& s) {
  // 0600: the token ids are the conversation.
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) return io_error("cannot create: %s", std::strerror(errno));
  uint64_t bytes = 0;
  Status st = write_parts(fd, owner, s, &bytes);
  if (::close(fd) != 0 && st.ok()) st = io_error("close failed: %s", std::strerror(errno));
  if (!st.ok()) return st;
  return bytes;
}

Result<SessionFileInfo> read_session_info(const std::string& path, const SessionFileOwner& owner) {
  File f;
  RETURN_IF_ERROR(f.open(path));
  Header h{};
  std::vector<uint8_t> head;
  Meta m;
  RETURN_IF_ERROR(read_head(f, owner, h, head, m));
  return SessionFileInfo{std::move(m.tokens), std::move(m.checkpoints), f.size()};
}

Result<std::unique_ptr<CachedSequence>> read_session_file(const std::string& path,
                                                          const SessionFileOwner& owner, Backend& backend) {
  File f;
  RETURN_IF_ERROR(f.open(path));
  Header h{};
  std::vector<uint8_t> head;
  Meta m;
  RETURN_IF_ERROR(read_head(f, owner, h, head, m));
  std::vector<uint8_t> payload(h.payload_bytes);
  RETURN_IF_ERROR(f.read(payload.data(), payload.size(), kHeaderBytes + h.meta_bytes));
  if (xxhash64(payload.data(), payload.size()) != h.payload_hash)
    return format_error("checksum mismatch in the state");

  auto seq = std::make_unique<CachedSequence>();
  seq->tokens = std::move(m.tokens);
  seq->anchor = m.anchor;
  seq->recent_marks = std::move(m.marks);
  ByteReader in(payload);
  // Each part is read through its own length so that a backend reading less or more than it wrote is caught.
  auto part = [&](const char* what) -> Result<ByteReader> {
    uint64_t len = 0;
    RETURN_IF_ERROR(in.pod(&len, what));
    ASSIGN_OR_RETURN(std::span<const uint8_t> bytes, in.view(len, what));
    return ByteReader(bytes);
  };
  ASSIGN_OR_RETURN(ByteReader state_in, part("sequence state"));
  ASSIGN_OR_RETURN(seq->state, backend.load_sequence(state_in));
  if (state_in.left() != 0) return format_error("%zu bytes after the sequence state", state_in.left());
  if (seq->state->n_tokens() != static_cast<int64_t>(seq->tokens.size()))
    return format_error("a state of %lld tokens with %zu token ids", (long long)seq->state->n_tokens(),
                        seq->tokens.size());
  for (int64_t pos : m.checkpoints) {
    ASSIGN_OR_RETURN(ByteReader cp_in, part("checkpoint"));
    ASSIGN_OR_RETURN(std::unique_ptr<Checkpoint> cp, backend.load_checkpoint(cp_in));
    if (cp_in.left() != 0)
      return format_error("%zu bytes after the checkpoint at %lld", cp_in.left(), (long long)pos);
    if (cp->n_tokens() != pos)
      return format_error("the checkpoint listed at %lld is at %lld", (long long)pos,
                          (long long)cp->n_tokens());
    seq->checkpoints[pos] = std::move(cp);
  }
  if (in.left() != 0) return format_error("%zu bytes after the last checkpoint", in.left());
  return seq;
}

}  // namespace lily
