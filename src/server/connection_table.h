// The HTTP server's open connections, by client address, for admission under load: at most `max_total`
// connections and `max_per_client` from one address. When a cap is reached, a new connection does not wait or
// get refused while idle ones hold the slots: the oldest idle connection (one waiting for a request head) is
// evicted - of the same address for the per-address cap, of the address holding the most for the total cap -
// so a flood of idle connections cannot lock out /health, /metrics or anyone else. Busy connections (a
// request being read past its head, handled or answered) are never evicted; when only those fill the cap, the
// new connection is refused with 503. Not thread-safe: the server calls it under its own mutex.
#pragma once
#include <chrono>
#include <cstddef>
#include <map>
#include <string>
#include <vector>

namespace lily {

class ConnectionTable {
 public:
  ConnectionTable(size_t max_total, size_t max_per_client)
      : max_total_(max_total), max_per_client_(max_per_client) {}

  // Registers `fd` from `client` (an address without port), evicting an idle connection when a cap is reached
  // (its socket is shut down, which ends its thread's read); false: no room, the caller refuses `fd`.
  bool admit(int fd, const std::string& client);
  void set_idle(int fd, bool idle);
  void remove(int fd);
  size_t size() const { return conns_.size(); }
  bool empty() const { return conns_.empty(); }
  std::vector<int> fds() const;
  size_t evicted() const { return evicted_; }

 private:
  struct Conn {
    std::string client;
    bool idle = true, evicting = false;
    std::chrono::steady_clock::time_point idle_since;
  };
  size_t live_from(const std::string& client) const;  // connections not being evicted
  bool evict_oldest_idle(const std::string* client);  // nullptr: of the address holding the most

  size_t max_total_, max_per_client_;
  std::map<int, Conn> conns_;
  size_t evicted_ = 0;
};

}  // namespace lily
