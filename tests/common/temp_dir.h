// A fresh temporary directory for one test, removed with everything in it when the object goes out of scope.
// Names carry the process id and a counter, so parallel ctest processes and several dirs per test never collide.
#pragma once
#include <unistd.h>

#include <filesystem>
#include <string>

namespace lily::testing {

class TempDir {
 public:
  explicit TempDir(const std::string& tag = "") {
    static int counter = 0;
    path_ = std::filesystem::temp_directory_path() /
            ("lily_test_" + tag + "_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~TempDir() { std::filesystem::remove_all(path_); }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::filesystem::path& path() const { return path_; }
  std::string str() const { return path_.string(); }
  std::string operator/(const std::string& name) const { return (path_ / name).string(); }

 private:
  std::filesystem::path path_;
};

}  // namespace lily::testing
