// libedit's native API (histedit.h): its own history, key bindings and prompt, without the readline
// emulation's globals. EL_SIGNAL is on: while el_gets waits, libedit catches SIGTSTP/SIGCONT (back to cooked
// mode before the job stops, raw mode and a redraw after `fg`), SIGWINCH, and SIGINT, which it passes on to
// chat's own handler after restoring the terminal; the read then fails with EINTR and el_gets returns, so a
// Ctrl-C at the prompt reaches the chat as `interrupted`.
#include "cli/line_reader.h"

#include <unistd.h>

#include <cerrno>
#include <clocale>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#if LILY_HAVE_LIBEDIT
#include <histedit.h>
#endif

namespace lily::cli {

std::string chat_history_path() {
  const char* state = std::getenv("XDG_STATE_HOME");
  if (state != nullptr && state[0] == '/') return std::string(state) + "/lily/chat_history";
  const char* home = std::getenv("HOME");  // the XDG spec: relative paths in XDG_* are ignored
  if (home != nullptr && home[0] != '\0') return std::string(home) + "/.local/state/lily/chat_history";
  return "";
}

#if LILY_HAVE_LIBEDIT

namespace {

constexpr int kHistoryLines = 1000;

// "> ", or "… " while a message goes on over several lines (EL_CLIENTDATA points at the flag).
extern "C" char* chat_prompt(EditLine* el) {
  static char first[] = "> ", more[] = "\xe2\x80\xa6 ";
  bool* continued = nullptr;
  el_get(el, EL_CLIENTDATA, &continued);
  return continued != nullptr && *continued ? more : first;
}

// Editing multi-byte text needs a UTF-8 LC_CTYPE; the environment's if it is one, else C.UTF-8.
void use_utf8_ctype() {
  const char* loc = std::setlocale(LC_CTYPE, "");
  const bool utf8 =
      loc != nullptr && (std::strstr(loc, "UTF-8") != nullptr || std::strstr(loc, "utf8") != nullptr);
  if (!utf8) std::setlocale(LC_CTYPE, "C.UTF-8");
}

// libedit binds the arrows itself (from the terminal's description and the ANSI forms); these are the keys
// terminals send in their normal mode that it leaves unbound, which would otherwise type their tail.
void bind_common_keys(EditLine* el) {
  static const char* const kBindings[][2] = {
      {"\\e[H", "ed-move-to-beg"},       {"\\e[1~", "ed-move-to-beg"}, {"\\eOH", "ed-move-to-beg"},
      {"\\e[F", "ed-move-to-end"},       {"\\e[4~", "ed-move-to-end"}, {"\\eOF", "ed-move-to-end"},
      {"\\e[3~", "ed-delete-next-char"},                                // Delete
      {"\\e[1;5D", "ed-prev-word"},      {"\\e[1;3D", "ed-prev-word"},  // Ctrl-Left, Alt-Left
      {"\\e[1;5C", "em-next-word"},      {"\\e[1;3C", "em-next-word"},  // Ctrl-Right, Alt-Right
  };
  for (const auto& [keys, command] : kBindings) el_set(el, EL_BIND, keys, command, nullptr);
}

}  // namespace

struct LineReader::Editor {
  EditLine* el = nullptr;
  History* hist = nullptr;
  HistEvent ev{};
  std::string path;        // "" : history in memory only
  bool continued = false;  // the line before ended in a backslash

  ~Editor() {
    if (el != nullptr) el_end(el);  // also restores the terminal
    if (hist != nullptr) history_end(hist);
  }

  // The history file's directory is made if needed; "" when the history will be saved, else why not.
  std::string open_history() {
    history(hist, &ev, H_SETSIZE, kHistoryLines);
    history(hist, &ev, H_SETUNIQUE, 1);  // a line repeated at once is kept once
    path = chat_history_path();
    if (path.empty()) return "history not saved: neither XDG_STATE_HOME nor HOME is set";
    std::error_code ec;
    std::filesystem::create_directories(std::filesystem::path(path).parent_path(), ec);
    if (ec) {
      std::string why = "history not saved: cannot create " +
                        std::filesystem::path(path).parent_path().string() + ": " + ec.message();
      path.clear();
      return why;
    }
    if (std::filesystem::exists(path, ec)) history(hist, &ev, H_LOAD, path.c_str());
    return "";
  }

  // Adds a line to the history and saves the file (libedit writes it mode 0600). On failure the history
  // stays in memory and the error is reported once.
  void remember(const std::string& line, std::string& report) {
    if (line.empty()) return;
    history(hist, &ev, H_ENTER, line.c_str());
    if (path.empty()) return;
    if (history(hist, &ev, H_SAVE, path.c_str()) < 0) {
      report = "history not saved: cannot write " + path + ": " + std::strerror(errno);
      path.clear();
    }
  }
};

LineReader::LineReader(const std::atomic<bool>& interrupted)
    : interrupted_(interrupted), prompt_(isatty(STDIN_FILENO)) {
  if (!prompt_) return;
  if (!isatty(STDOUT_FILENO)) {
    note_ = "line editing is off: stdout is not a terminal";
    return;
  }
  use_utf8_ctype();
  auto ed = std::make_unique<Editor>();
  ed->hist = history_init();
  ed->el = ed->hist != nullptr ? el_init("lily", stdin, stdout, stderr) : nullptr;
  if (ed->el == nullptr) {
    note_ = "line editing is off: libedit could not start";
    return;
  }
  el_set(ed->el, EL_EDITOR, "emacs");
  el_set(ed->el, EL_CLIENTDATA, &ed->continued);
  el_set(ed->el, EL_PROMPT, chat_prompt);
  el_set(ed->el, EL_HIST, history, ed->hist);
  el_set(ed->el, EL_SIGNAL, 1);
  el_set(ed->el, EL_BIND, "^R", "em-inc-search-prev", nullptr);  // emacs mode binds ^R to redisplay
  bind_common_keys(ed->el);
  el_source(ed->el, nullptr);  // ~/.editrc may rebind keys
  note_ = ed->open_history();
  if (note_.empty()) note_ = "history: " + ed->path + " (Up/Down, Ctrl-R)";
  editor_ = std::move(ed);
}

LineReader::~LineReader() = default;

bool LineReader::editing() const {
  return editor_ != nullptr;
}

// A line that ends in a backslash goes on on the next one (the message gets a newline there); each line is
// one history entry.
ReadResult LineReader::read(std::string& line) {
  if (!editor_) return read_plain(line);
  line.clear();
  editor_->continued = false;
  while (true) {
    int count = 0;
    errno = 0;
    const char* s = el_gets(editor_->el, &count);
    if (s == nullptr || count <= 0) {
      if (interrupted_.load()) return ReadResult::interrupted;
      if (count < 0 && errno == EINTR) continue;  // another signal (a resize, a resume)
      // Ctrl-D on an empty line, or the terminal went away; what was continued so far is still sent.
      return editor_->continued ? ReadResult::line : ReadResult::eof;
    }
    std::string part(s, static_cast<size_t>(count));
    while (!part.empty() && (part.back() == '\n' || part.back() == '\r')) part.pop_back();
    std::string report;
    editor_->remember(part, report);
    if (!report.empty()) std::fprintf(stderr, "lily chat: %s\n", report.c_str());
    editor_->continued = !part.empty() && part.back() == '\\';
    if (!editor_->continued) {
      line += part;
      return ReadResult::line;
    }
    part.back() = '\n';
    line += part;
  }
}

#else  // built without libedit: plain lines even on a terminal

struct LineReader::Editor {};

LineReader::LineReader(const std::atomic<bool>& interrupted)
    : interrupted_(interrupted), prompt_(isatty(STDIN_FILENO)) {
  if (prompt_) note_ = "line editing is off: lily was built without libedit";
}

LineReader::~LineReader() = default;

bool LineReader::editing() const {
  return false;
}

ReadResult LineReader::read(std::string& line) {
  return read_plain(line);
}

#endif

// Bytes up to '\n' from stdin; `interrupted` when Ctrl-C arrives before Enter.
ReadResult LineReader::read_plain(std::string& line) {
  if (prompt_) {
    std::fputs("> ", stdout);
    std::fflush(stdout);
  }
  line.clear();
  while (true) {
    errno = 0;
    int c = std::fgetc(stdin);
    if (c == EOF) {
      if (std::ferror(stdin) && errno == EINTR) {
        std::clearerr(stdin);
        if (interrupted_.load()) return ReadResult::interrupted;
        continue;
      }
      return line.empty() ? ReadResult::eof : ReadResult::line;
    }
    if (c == '\n') return ReadResult::line;
    line.push_back(static_cast<char>(c));
  }
}

}  // namespace lily::cli
