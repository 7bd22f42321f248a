// Read-only memory map of a whole model file.
//
// Tensors are used in place from the mapping, so the file stays mapped as long as any reader
// (and anything holding its shared_ptr) lives. If another process truncates the file while it
// is mapped, touching the lost pages raises SIGBUS; model files are assumed not to change
// under a running engine.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>

namespace k25 {

class MappedFile {
 public:
  // Missing file -> Error(kNotFound); any other OS failure (permissions, a directory,
  // mmap refused) -> Error(kIOError) with strerror. An empty file maps to size 0, data nullptr.
  static std::shared_ptr<MappedFile> open(const std::string& path);

  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const uint8_t* data() const { return data_; }
  uint64_t size() const { return size_; }
  const std::string& path() const { return path_; }

  // Hint the kernel to start reading the whole file ahead (model load reads all of it).
  // Best effort: failures are ignored.
  void advise_willneed() const;

 private:
  MappedFile(std::string path, const uint8_t* data, uint64_t size)
      : path_(std::move(path)), data_(data), size_(size) {}

  std::string path_;
  const uint8_t* data_;
  uint64_t size_;
};

}  // namespace k25
