// The input lines of `lily chat`. On a terminal (stdin and stdout both ttys) and where lily was built with
// libedit, lines are edited as in a shell: arrow keys, Home/End, Ctrl-A/E/K/U/W, Up/Down through the history,
// Ctrl-R reverse search, and the user's ~/.editrc; a line ending in a backslash continues the message on the
// next line. The history is kept in memory and saved to $XDG_STATE_HOME/lily/chat_history (default
// ~/.local/state/lily/chat_history) after each line; if that file cannot be written the history stays in
// memory and the chat says so once. Otherwise (a pipe, a file, or a build without libedit) lines are read
// from stdin byte for byte, as a script expects.
#pragma once
#include <atomic>
#include <memory>
#include <string>

namespace lily::cli {

enum class ReadResult { line, eof, interrupted };

class LineReader {
 public:
  // `interrupted` is the flag the SIGINT handler sets: a Ctrl-C at the prompt ends the read as `interrupted`.
  explicit LineReader(const std::atomic<bool>& interrupted);
  ~LineReader();
  LineReader(const LineReader&) = delete;
  LineReader& operator=(const LineReader&) = delete;

  // One line without its newline, after the prompt "> " (shown on a terminal only).
  ReadResult read(std::string& line);
  bool editing() const;  // true: the libedit editor reads the lines
  // One line for the banner: where the history lives, or why lines are not edited; "" for a pipe.
  const std::string& note() const { return note_; }

 private:
  struct Editor;
  ReadResult read_plain(std::string& line);

  const std::atomic<bool>& interrupted_;
  const bool prompt_;
  std::unique_ptr<Editor> editor_;
  std::string note_;
};

// Where the chat history is saved: $XDG_STATE_HOME/lily/chat_history when XDG_STATE_HOME is an absolute path,
// else $HOME/.local/state/lily/chat_history; "" when neither is set.
std::string chat_history_path();

}  // namespace lily::cli
