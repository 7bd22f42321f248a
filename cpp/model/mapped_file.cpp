#include "model/mapped_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <limits>

#include "k25/status.h"

namespace k25 {

namespace {

[[noreturn]] void fail_errno(int err, const std::string& doing, const std::string& path) {
  const ErrorCode code = (err == ENOENT || err == ENOTDIR) ? ErrorCode::kNotFound
                                                          : ErrorCode::kIOError;
  const std::string msg = code == ErrorCode::kNotFound
                              ? "file not found: " + path
                              : "cannot " + doing + " " + path + ": " + std::strerror(err);
  fail(code, msg);
}

// Closes the descriptor on every path out of open(); the mapping does not need it.
struct FdCloser {
  int fd;
  ~FdCloser() {
    if (fd >= 0) ::close(fd);
  }
};

}  // namespace

std::shared_ptr<MappedFile> MappedFile::open(const std::string& path) {
  int fd;
  do {
    fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  } while (fd < 0 && errno == EINTR);
  if (fd < 0) fail_errno(errno, "open", path);
  FdCloser closer{fd};

  struct stat st;
  if (::fstat(fd, &st) != 0) fail_errno(errno, "stat", path);
  if (S_ISDIR(st.st_mode)) fail_errno(EISDIR, "map", path);
  if (!S_ISREG(st.st_mode))
    fail(ErrorCode::kIOError, "cannot map " + path + ": not a regular file");
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size > std::numeric_limits<size_t>::max())
    fail(ErrorCode::kIOError, "cannot map " + path + ": file too large for the address space");

  if (size == 0) return std::shared_ptr<MappedFile>(new MappedFile(path, nullptr, 0));

  void* p = ::mmap(nullptr, static_cast<size_t>(size), PROT_READ, MAP_PRIVATE, fd, 0);
  if (p == MAP_FAILED) fail_errno(errno, "mmap", path);
  return std::shared_ptr<MappedFile>(
      new MappedFile(path, static_cast<const uint8_t*>(p), size));
}

MappedFile::~MappedFile() {
  if (data_ != nullptr) ::munmap(const_cast<uint8_t*>(data_), static_cast<size_t>(size_));
}

void MappedFile::advise_willneed() const {
  if (data_ != nullptr)
    ::madvise(const_cast<uint8_t*>(data_), static_cast<size_t>(size_), MADV_WILLNEED);
}

}  // namespace k25
