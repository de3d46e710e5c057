// A blocking test client on a loopback socket (optionally from a given 127.x source address), with reads that
// give up after 5 s. Shared by the server's socket tests.
#pragma once
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <string>
#include <string_view>

#include <gtest/gtest.h>

namespace lily {

class Client {
 public:
  explicit Client(int port, const char* source = nullptr) {
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    if (source != nullptr) {
      sockaddr_in from{};
      from.sin_family = AF_INET;
      ::inet_pton(AF_INET, source, &from.sin_addr);
      EXPECT_EQ(::bind(fd_, reinterpret_cast<sockaddr*>(&from), sizeof(from)), 0);
    }
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(port));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    EXPECT_EQ(::connect(fd_, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
    timeval tv{5, 0};
    ::setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  }
  ~Client() { close(); }
  void close() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }
  bool send(std::string_view s) {
    while (!s.empty()) {
      ssize_t n = ::send(fd_, s.data(), s.size(), MSG_NOSIGNAL);
      if (n <= 0) return false;
      s.remove_prefix(static_cast<size_t>(n));
    }
    return true;
  }
  // Reads until `marker` has arrived (or the peer closes / 5 s pass).
  std::string read_until(std::string_view marker) {
    while (buf_.find(marker) == std::string::npos) {
      char tmp[65536];
      ssize_t n = ::recv(fd_, tmp, sizeof(tmp), 0);
      if (n <= 0) break;
      buf_.append(tmp, static_cast<size_t>(n));
    }
    size_t at = buf_.find(marker);
    size_t end = at == std::string::npos ? buf_.size() : at + marker.size();
    std::string out = buf_.substr(0, end);
    buf_.erase(0, end);
    return out;
  }
  std::string read_all() { return read_until(std::string(1, '\0') + "never"); }

 private:
  int fd_ = -1;
  std::string buf_;
};

}  // namespace lily
