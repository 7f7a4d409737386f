// lib/config/secret_file.cc — the job secret from a file (PSLD_SECRET_FILE),
// and the rules that keep it off command lines.
#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "lib/config/sources.h"

namespace psld::config_detail {
namespace {

constexpr size_t kMaxSecretBytes = 4096;

Result<std::string> read_secret(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOCTTY);
  if (fd < 0) {
    return NotFound(
        fmt::format("PSLD_SECRET_FILE {}: cannot open it: {}", path, std::strerror(errno)));
  }
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  struct stat st = {};
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    return InvalidArgument(fmt::format("PSLD_SECRET_FILE {}: not a regular file", path));
  }
  // What ssh asks of a private key: owned by whoever runs the job, and
  // readable by nobody else.
  if (st.st_uid != geteuid()) {
    return InvalidArgument(
        fmt::format("PSLD_SECRET_FILE {}: owned by uid {}, not by this process's user (uid {})",
                    path, st.st_uid, geteuid()));
  }
  if ((st.st_mode & 077) != 0) {
    return InvalidArgument(
        fmt::format("PSLD_SECRET_FILE {}: mode {:04o} lets group or others read it: chmod 600 {}",
                    path, st.st_mode & 07777, path));
  }
  std::string text(kMaxSecretBytes + 1, '\0');
  size_t got = 0;
  while (got < text.size()) {
    const ssize_t n = ::read(fd, text.data() + got, text.size() - got);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      return NotFound(fmt::format("PSLD_SECRET_FILE {}: {}", path, std::strerror(errno)));
    }
    if (n == 0) break;
    got += static_cast<size_t>(n);
  }
  if (got > kMaxSecretBytes) {
    return InvalidArgument(
        fmt::format("PSLD_SECRET_FILE {}: longer than {} bytes", path, kMaxSecretBytes));
  }
  text.resize(got);
  // One trailing newline is the editor's, not the secret's.
  if (!text.empty() && text.back() == '\n') text.pop_back();
  if (!text.empty() && text.back() == '\r') text.pop_back();
  if (text.empty()) return InvalidArgument(fmt::format("PSLD_SECRET_FILE {}: empty", path));
  return text;
}

}  // namespace

Status apply_secret_rules(const Env& env, bool args_on_command_line, Config& c) {
  const std::string source = source_of(c, "job.secret");
  if (args_on_command_line && source.rfind("flag", 0) == 0) {
    return InvalidArgument(
        "job.secret: a flag shows the secret to every user of this machine (ps); give it in a "
        "file named by PSLD_SECRET_FILE (mode 0600) or in env PSLD_JOB_SECRET");
  }
  const char* path = env.get("PSLD_SECRET_FILE");
  if (path == nullptr || *path == '\0') return Status::Ok();
  if (source != "default") {
    return InvalidArgument(fmt::format(
        "job.secret is set{} and PSLD_SECRET_FILE names {}: give the secret one way only",
        from(source), path));
  }
  auto secret = read_secret(path);
  if (!secret.ok()) return secret.status();
  c.job.secret = std::move(secret).value();
  c.sources["job.secret"] = fmt::format("file {} (env PSLD_SECRET_FILE)", path);
  return Status::Ok();
}

}  // namespace psld::config_detail
