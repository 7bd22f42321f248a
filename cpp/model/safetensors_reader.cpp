#include "model/safetensors_reader.h"

#include <algorithm>
#include <filesystem>
#include <limits>
#include <string_view>
#include <system_error>

#include "k25/status.h"
#include "model/json.h"

namespace k25 {

namespace fs = std::filesystem;

namespace {

struct DTypeInfo {
  const char* name;
  DType dtype;
  int64_t size;
};

constexpr DTypeInfo kDTypes[] = {
    {"F32", DType::kF32, 4},         {"F16", DType::kF16, 2},
    {"BF16", DType::kBF16, 2},       {"F64", DType::kF64, 8},
    {"I64", DType::kI64, 8},         {"I32", DType::kI32, 4},
    {"I16", DType::kI16, 2},         {"I8", DType::kI8, 1},
    {"U8", DType::kU8, 1},           {"BOOL", DType::kBool, 1},
    {"F8_E4M3", DType::kF8_E4M3, 1}, {"F8_E5M2", DType::kF8_E5M2, 1},
};

const DTypeInfo& info(DType t) {
  for (const auto& d : kDTypes)
    if (d.dtype == t) return d;
  fail(ErrorCode::kInternal, "unknown DType value");
}

const DTypeInfo* find_dtype(const std::string& name) {
  for (const auto& d : kDTypes)
    if (name == d.name) return &d;
  return nullptr;
}

std::string quoted(const std::string& s) { return quote_for_message(s); }

[[noreturn]] void corrupt(const std::string& file, const std::string& why) {
  fail(ErrorCode::kCorruptFile, file + ": " + why);
}

// A non-negative JSON integer, or the header is corrupt.
uint64_t header_uint(const Json& j, const std::string& file, const std::string& what) {
  if (!j.is_int() || j.as_int() < 0) corrupt(file, what + " is not a non-negative integer");
  return static_cast<uint64_t>(j.as_int());
}

bool exists_as_file(const fs::path& p) {
  std::error_code ec;
  return fs::is_regular_file(p, ec);
}

}  // namespace

const char* dtype_name(DType t) { return info(t).name; }
int64_t dtype_size(DType t) { return info(t).size; }

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;  // validated not to overflow at load
  return n;
}

std::shared_ptr<SafetensorsCheckpoint> SafetensorsCheckpoint::open(const std::string& path_or_dir) {
  std::shared_ptr<SafetensorsCheckpoint> ck(new SafetensorsCheckpoint());
  ck->path_ = path_or_dir;
  std::error_code ec;
  const fs::path root(path_or_dir);
  const fs::file_status st = fs::status(root, ec);
  if (ec || !fs::exists(st)) {
    if (ec && ec != std::errc::no_such_file_or_directory && ec != std::errc::not_a_directory)
      fail(ErrorCode::kIOError, "cannot access " + path_or_dir + ": " + ec.message());
    fail(ErrorCode::kNotFound, "model path not found: " + path_or_dir);
  }
  if (!fs::is_directory(st)) {
    ck->add_file(path_or_dir);
    return ck;
  }

  const fs::path index_path = root / "model.safetensors.index.json";
  if (exists_as_file(index_path)) {
    const std::string index_file = index_path.string();
    auto map = MappedFile::open(index_file);
    const Json index = Json::parse(
        std::string_view(reinterpret_cast<const char*>(map->data()), map->size()), index_file);
    const Json* wm = index.find("weight_map");
    if (wm == nullptr || !wm->is_object())
      corrupt(index_file, "has no \"weight_map\" object");
    std::vector<std::string> shards;
    for (const auto& [tensor, shard] : wm->items()) {
      if (!shard.is_string())
        corrupt(index_file, "weight_map entry " + quoted(tensor) + " is not a file name");
      const fs::path rel(shard.as_string());
      // Shards live next to the index; refusing other paths keeps a hostile index from
      // pointing the loader at arbitrary files.
      bool escapes = rel.empty() || rel.is_absolute();
      for (const auto& part : rel)
        if (part == "..") escapes = true;
      if (escapes)
        corrupt(index_file, "weight_map entry " + quoted(tensor) + " names shard " +
                                quoted(shard.as_string()) + " outside the model directory");
      shards.push_back(shard.as_string());
    }
    std::sort(shards.begin(), shards.end());
    shards.erase(std::unique(shards.begin(), shards.end()), shards.end());
    if (shards.empty()) corrupt(index_file, "weight_map lists no tensors");
    for (const auto& s : shards) {
      const fs::path p = root / s;
      if (!exists_as_file(p))
        fail(ErrorCode::kNotFound, "shard " + quoted(s) + " listed in " + index_file +
                                       " is missing (" + p.string() + ")");
    }
    for (const auto& s : shards) ck->add_file((root / s).string());
    for (const auto& [tensor, shard] : wm->items()) {
      const TensorView* t = ck->find(tensor);
      const std::string expected = (root / shard.as_string()).string();
      if (t == nullptr || ck->files_[ck->tensor_file_[t - ck->tensors_.data()]] != expected)
        corrupt(index_file, "weight_map puts tensor " + quoted(tensor) + " in " +
                                quoted(shard.as_string()) + ", but that shard does not hold it");
    }
    return ck;
  }

  const fs::path single = root / "model.safetensors";
  if (exists_as_file(single)) {
    ck->add_file(single.string());
    return ck;
  }

  std::vector<std::string> found;
  for (fs::directory_iterator it(root, ec), end; !ec && it != end; it.increment(ec)) {
    const fs::path& p = it->path();
    if (p.extension() == ".safetensors" && exists_as_file(p)) found.push_back(p.string());
  }
  if (ec) fail(ErrorCode::kIOError, "cannot list " + path_or_dir + ": " + ec.message());
  if (found.empty())
    fail(ErrorCode::kNotFound, "no .safetensors files in " + path_or_dir);
  std::sort(found.begin(), found.end());
  for (const auto& f : found) ck->add_file(f);
  return ck;
}

void SafetensorsCheckpoint::add_file(const std::string& file) {
  std::shared_ptr<const MappedFile> map = MappedFile::open(file);
  const uint64_t size = map->size();
  if (size < 8)
    fail(ErrorCode::kCorruptFile, file + " is truncated: needs 8 bytes at offset 0, file has " +
                                      std::to_string(size));
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | map->data()[i];
  if (header_len > kMaxHeaderBytes)
    corrupt(file, "header length " + std::to_string(header_len) + " exceeds the limit of " +
                      std::to_string(kMaxHeaderBytes) + " bytes");
  if (header_len > size - 8)
    fail(ErrorCode::kCorruptFile, file + " is truncated: needs " + std::to_string(header_len) +
                                      " header bytes at offset 8, file has " +
                                      std::to_string(size));
  const Json header = Json::parse(
      std::string_view(reinterpret_cast<const char*>(map->data() + 8), header_len),
      file + " header");
  if (!header.is_object()) corrupt(file, "header is not a JSON object");

  const uint64_t data_begin = 8 + header_len;
  const uint64_t data_size = size - data_begin;
  const size_t file_index = files_.size();
  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") {
      if (!entry.is_object()) corrupt(file, "__metadata__ is not an object");
      for (const auto& [k, v] : entry.items()) {
        if (!v.is_string()) corrupt(file, "__metadata__ value " + quoted(k) + " is not a string");
        metadata_.emplace(k, v.as_string());
      }
      continue;
    }
    const std::string what = "tensor " + quoted(name);
    if (!entry.is_object()) corrupt(file, what + " is not a JSON object");
    const Json* dtype = entry.find("dtype");
    const Json* shape = entry.find("shape");
    const Json* offsets = entry.find("data_offsets");
    if (dtype == nullptr || !dtype->is_string()) corrupt(file, what + " has no dtype string");
    if (shape == nullptr || !shape->is_array()) corrupt(file, what + " has no shape array");
    if (offsets == nullptr || !offsets->is_array() || offsets->size() != 2)
      corrupt(file, what + " has no [begin, end] data_offsets");
    const DTypeInfo* dt = find_dtype(dtype->as_string());
    if (dt == nullptr)
      fail(ErrorCode::kUnsupported, file + ": " + what + " has dtype " +
                                        quoted(dtype->as_string()) +
                                        ", which k25 does not support");

    TensorView t;
    t.name = name;
    t.dtype = dt->dtype;
    uint64_t numel = 1;
    for (size_t i = 0; i < shape->size(); ++i) {
      const uint64_t d = header_uint((*shape)[i], file, what + " shape[" + std::to_string(i) + "]");
      if (__builtin_mul_overflow(numel, d, &numel) ||
          numel > uint64_t(std::numeric_limits<int64_t>::max()))
        corrupt(file, what + " has too many elements");
      t.shape.push_back(static_cast<int64_t>(d));
    }
    uint64_t nbytes = 0;
    if (__builtin_mul_overflow(numel, uint64_t(dt->size), &nbytes))
      corrupt(file, what + " has too many elements");
    const uint64_t begin = header_uint((*offsets)[0], file, what + " data_offsets[0]");
    const uint64_t end = header_uint((*offsets)[1], file, what + " data_offsets[1]");
    if (begin > end || end - begin != nbytes)
      corrupt(file, what + " has data_offsets [" + std::to_string(begin) + ", " +
                        std::to_string(end) + "] but its " + dt->name + " shape needs " +
                        std::to_string(nbytes) + " bytes");
    if (end > data_size)
      fail(ErrorCode::kCorruptFile,
           file + " is truncated: " + what + " needs bytes up to offset " +
               std::to_string(data_begin + end) + ", file has " + std::to_string(size));
    t.nbytes = nbytes;
    t.data = map->data() + data_begin + begin;

    auto [it, inserted] = index_.emplace(t.name, tensors_.size());
    if (!inserted) {
      const std::string& other = tensor_file_[it->second] == file_index
                                     ? file
                                     : files_[tensor_file_[it->second]];
      corrupt(file, what + " also appears in " + other);
    }
    tensors_.push_back(std::move(t));
    tensor_file_.push_back(file_index);
  }
  files_.push_back(file);
  maps_.push_back(std::move(map));
}

const TensorView* SafetensorsCheckpoint::find(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

}  // namespace k25
