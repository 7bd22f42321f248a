// safetensors reader: single files, directories and sharded checkpoints with an index.
//
// Tensors are views into memory-mapped files, which the checkpoint keeps alive. Every header
// is validated up front (sizes, offsets, dtypes), so a view's data always lies inside its
// file; bad files raise Error(kCorruptFile), valid files with a dtype k25 lacks kUnsupported.
// Format: https://github.com/huggingface/safetensors (8-byte LE header length, JSON header,
// data; offsets in the header are relative to the end of the header).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "model/mapped_file.h"

namespace k25 {

enum class DType { kF32, kF16, kBF16, kF64, kI64, kI32, kI16, kI8, kU8, kBool, kF8_E4M3, kF8_E5M2 };

const char* dtype_name(DType t);  // the safetensors spelling: "F32", "BF16", "F8_E4M3" ...
int64_t dtype_size(DType t);      // bytes per element

struct TensorView {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;  // row-major, as in the header (empty for a scalar)
  const uint8_t* data;         // inside the mapping; may be unaligned
  uint64_t nbytes;
  int64_t numel() const;       // product of shape (1 for a scalar)
};

class SafetensorsCheckpoint {
 public:
  // The safetensors crate's own limit; a real header is a few hundred KB.
  static constexpr uint64_t kMaxHeaderBytes = 100'000'000;

  // A directory: model.safetensors.index.json if present (its weight_map names the shards;
  // a listed shard that is missing -> kNotFound), else model.safetensors, else every
  // *.safetensors in it (sorted by name). A file: that file. Nothing found -> kNotFound.
  static std::shared_ptr<SafetensorsCheckpoint> open(const std::string& path_or_dir);

  const std::string& path() const { return path_; }
  // Shard files in load order.
  const std::vector<std::string>& files() const { return files_; }
  // Shards in load order, each in its header's order.
  const std::vector<TensorView>& tensors() const { return tensors_; }
  const TensorView* find(const std::string& name) const;
  // The "__metadata__" string maps of all shards merged (the first shard to set a key wins).
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

 private:
  SafetensorsCheckpoint() = default;
  void add_file(const std::string& file);

  std::string path_;
  std::vector<std::string> files_;
  std::vector<std::shared_ptr<const MappedFile>> maps_;
  std::vector<TensorView> tensors_;
  std::vector<size_t> tensor_file_;  // index into files_ of each tensor
  std::unordered_map<std::string, size_t> index_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace k25
