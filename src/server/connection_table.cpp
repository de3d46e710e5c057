#include "server/connection_table.h"

#include <sys/socket.h>

#include <unordered_map>

namespace lily {

size_t ConnectionTable::live_from(const std::string& client) const {
  size_t n = 0;
  for (const auto& [fd, c] : conns_) n += !c.evicting && c.client == client;
  return n;
}

bool ConnectionTable::evict_oldest_idle(const std::string* client) {
  std::string target;
  if (client != nullptr) {
    target = *client;
  } else {  // the address holding the most live connections, among those with an idle one
    std::unordered_map<std::string, size_t> held;
    for (const auto& [fd, c] : conns_) held[c.client] += !c.evicting;
    size_t most = 0;
    for (const auto& [fd, c] : conns_) {
      if (!c.evicting && c.idle && held[c.client] > most) most = held[c.client], target = c.client;
    }
    if (most == 0) return false;
  }
  int victim = -1;
  for (const auto& [fd, c] : conns_) {
    if (c.evicting || !c.idle || c.client != target) continue;
    if (victim < 0 || c.idle_since < conns_.at(victim).idle_since) victim = fd;
  }
  if (victim < 0) return false;
  conns_.at(victim).evicting = true;
  ::shutdown(victim, SHUT_RDWR);  // its thread's poll wakes, reads EOF, and the thread closes it
  ++evicted_;
  return true;
}

bool ConnectionTable::admit(int fd, const std::string& client) {
  if (live_from(client) >= max_per_client_ && !evict_oldest_idle(&client)) return false;
  size_t live = 0;
  for (const auto& [other, c] : conns_) live += !c.evicting;
  if (live >= max_total_ && !evict_oldest_idle(nullptr)) return false;
  conns_[fd] = Conn{client, true, false, std::chrono::steady_clock::now()};
  return true;
}

void ConnectionTable::set_idle(int fd, bool idle) {
  auto it = conns_.find(fd);
  if (it == conns_.end() || it->second.idle == idle) return;
  it->second.idle = idle;
  if (idle) it->second.idle_since = std::chrono::steady_clock::now();
}

void ConnectionTable::remove(int fd) {
  conns_.erase(fd);
}

std::vector<int> ConnectionTable::fds() const {
  std::vector<int> out;
  for (const auto& [fd, c] : conns_) out.push_back(fd);
  return out;
}

}  // namespace lily
