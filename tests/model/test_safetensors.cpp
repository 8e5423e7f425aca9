// Safetensors files: write/read round trips, sharded checkpoints, and every malformed input
// answered by one tandem::Error naming the file and the tensor.
#include <unistd.h>

#include <catch2/catch.hpp>

#include <cstring>
#include <filesystem>
#include <fstream>

#include "model/safetensors.h"
#include "tests/testutil.h"

using namespace tandem;
using namespace tandem::model;
using Catch::Contains;
namespace fs = std::filesystem;

namespace {

// A file with this header (padded to 8 bytes, as HF pads) and data_bytes bytes of 0x01.
void write_raw(const std::string& path, std::string header, size_t data_bytes) {
  header.append((8 - header.size() % 8) % 8, ' ');
  std::ofstream out(path, std::ios::binary);
  uint64_t n = header.size();
  unsigned char le[8];
  for (int i = 0; i < 8; ++i) le[i] = static_cast<unsigned char>(n >> (8 * i));
  out.write(reinterpret_cast<const char*>(le), 8);
  out << header << std::string(data_bytes, '\x01');
}

std::vector<NamedTensor> sample_tensors() {
  return {{"b.weight", test::random_tensor({3, 5}, DType::f32, 1)},
          {"a.bias", test::random_tensor({7}, DType::bf16, 2)},
          {"c.half", test::random_tensor({2, 2, 3}, DType::f16, 3)},
          {"ids", test::random_ints({4}, DType::i64, 4, -5, 5)},
          {"mask", test::random_ints({5}, DType::i32, 5, 0, 2)}};
}

}  // namespace

TEST_CASE("safetensors files round trip tensors metadata and order", "[unit]") {
  test::TempDir dir("roundtrip");
  const std::string path = dir.file("x.safetensors");
  const auto tensors = sample_tensors();
  write_safetensors(path, tensors, {{"format", "pt"}, {"note", "hi"}});
  CHECK_FALSE(fs::exists(path + ".tmp"));

  // The header is padded with spaces to a multiple of 8 bytes.
  std::ifstream in(path, std::ios::binary);
  unsigned char le[8];
  in.read(reinterpret_cast<char*>(le), 8);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | le[i];
  CHECK(n % 8 == 0);

  SafetensorsFile f(path);
  CHECK(f.metadata().at("format") == "pt");
  CHECK(f.metadata().at("note") == "hi");
  REQUIRE(f.tensors().size() == tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const SafetensorsEntry& e = f.tensors()[i];
    CHECK(e.name == tensors[i].name);  // data in the order given
    CHECK(e.dtype == tensors[i].tensor.dtype());
    CHECK(e.shape == tensors[i].tensor.shape());
    CHECK(test::bitwise_equal(f.view(e.name), tensors[i].tensor));
    Tensor copy = Tensor::empty(e.shape, e.dtype);
    f.read_into(e.name, copy);
    CHECK(test::bitwise_equal(copy, tensors[i].tensor));
  }
  CHECK(f.find("nope") == nullptr);
  REQUIRE_THROWS_WITH(f.at("nope"), Contains(path) && Contains("'nope'"));

  // Float tensors cast on read; other dtypes refuse.
  Tensor as_f32 = Tensor::empty({7}, DType::f32);
  f.read_into("a.bias", as_f32);
  CHECK(test::to_f64(as_f32) == test::to_f64(tensors[1].tensor));
  Tensor as_bf16 = Tensor::empty({3, 5}, DType::bf16);
  f.read_into("b.weight", as_bf16);
  CHECK(test::max_abs_diff(test::to_f64(as_bf16), test::to_f64(tensors[0].tensor)) < 1e-2);
  Tensor wrong_shape = Tensor::empty({5, 3}, DType::f32);
  REQUIRE_THROWS_WITH(f.read_into("b.weight", wrong_shape),
                      Contains(path) && Contains("b.weight") && Contains("(3, 5)"));
  Tensor wrong_kind = Tensor::empty({4}, DType::f32);
  REQUIRE_THROWS_WITH(f.read_into("ids", wrong_kind), Contains(path) && Contains("'ids'"));
}

TEST_CASE("safetensors checkpoints read single files and sharded indexes", "[unit]") {
  test::TempDir dir("ckpt");
  const auto tensors = sample_tensors();
  write_safetensors(dir.file("s1.safetensors"), std::span(tensors).first(2));
  write_safetensors(dir.file("s2.safetensors"), std::span(tensors).subspan(2));
  std::ofstream(dir.file("model.safetensors.index.json"))
      << R"({"metadata": {"total_size": 1}, "weight_map": {"b.weight": "s1.safetensors",
          "a.bias": "s1.safetensors", "c.half": "s2.safetensors", "ids": "s2.safetensors",
          "mask": "s2.safetensors"}})";
  SafetensorsCheckpoint ck(dir.path.string());
  CHECK(ck.files().size() == 2);
  CHECK(ck.names() == std::vector<std::string>{"b.weight", "a.bias", "c.half", "ids", "mask"});
  for (const NamedTensor& t : tensors) CHECK(test::bitwise_equal(ck.view(t.name), t.tensor));
  REQUIRE_THROWS_WITH(ck.file_of("zzz"),
                      Contains("model.safetensors.index.json") && Contains("'zzz'"));

  SafetensorsCheckpoint single(dir.file("s1.safetensors"));
  CHECK(single.names() == std::vector<std::string>{"b.weight", "a.bias"});

  // An index that points a tensor at the wrong shard names both.
  std::ofstream(dir.file("bad.safetensors.index.json"))
      << R"({"weight_map": {"b.weight": "s2.safetensors"}})";
  REQUIRE_THROWS_WITH(SafetensorsCheckpoint(dir.file("bad.safetensors.index.json")),
                      Contains("bad.safetensors.index.json") && Contains("'b.weight'") &&
                          Contains("s2.safetensors"));
  REQUIRE_THROWS_WITH(SafetensorsCheckpoint((dir.path / "none").string()), Contains("none"));
  std::ofstream(dir.file("gone.safetensors.index.json"))
      << R"({"weight_map": {"b.weight": "s9.safetensors"}})";
  REQUIRE_THROWS_WITH(SafetensorsCheckpoint(dir.file("gone.safetensors.index.json")),
                      Contains("s9.safetensors"));
}

TEST_CASE("malformed safetensors files give one error naming the file and tensor", "[unit]") {
  test::TempDir dir("bad");
  const std::string good = dir.file("good.safetensors");
  write_safetensors(good, sample_tensors());

  SECTION("truncated data") {
    const std::string p = dir.file("trunc.safetensors");
    fs::copy_file(good, p);
    fs::resize_file(p, fs::file_size(p) - 6);
    REQUIRE_THROWS_WITH(SafetensorsFile(p),
                        Contains(p) && Contains("'mask'") && Contains("outside"));
  }
  SECTION("header size past the end of the file") {
    const std::string p = dir.file("short.safetensors");
    fs::copy_file(good, p);
    fs::resize_file(p, 40);
    REQUIRE_THROWS_WITH(SafetensorsFile(p), Contains(p) && Contains("header size"));
  }
  SECTION("shorter than the size field") {
    const std::string p = dir.file("tiny.safetensors");
    std::ofstream(p) << "abc";
    REQUIRE_THROWS_WITH(SafetensorsFile(p), Contains(p) && Contains("8"));
  }
  SECTION("offsets that do not match the shape") {
    const std::string p = dir.file("offsets.safetensors");
    write_raw(p, R"({"w": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 20]}})", 24);
    REQUIRE_THROWS_WITH(SafetensorsFile(p),
                        Contains(p) && Contains("'w'") && Contains("20 bytes") && Contains("24"));
  }
  SECTION("unknown dtype") {
    const std::string p = dir.file("dtype.safetensors");
    write_raw(p, R"({"w": {"dtype": "F64", "shape": [2], "data_offsets": [0, 16]}})", 16);
    REQUIRE_THROWS_WITH(SafetensorsFile(p), Contains(p) && Contains("'w'") && Contains("F64"));
  }
  SECTION("bad JSON and bad fields") {
    const std::string p = dir.file("json.safetensors");
    write_raw(p, R"({"w": {"dtype": "F32", )", 0);
    REQUIRE_THROWS_WITH(SafetensorsFile(p), Contains(p) && Contains("JSON"));
    write_raw(p, R"({"w": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 0]}})", 0);
    REQUIRE_THROWS_WITH(SafetensorsFile(p), Contains(p) && Contains("'w'") && Contains("shape"));
    write_raw(p, R"({"w": {"dtype": "F32", "shape": [1]}})", 4);
    REQUIRE_THROWS_WITH(SafetensorsFile(p),
                        Contains(p) && Contains("'w'") && Contains("data_offsets"));
    write_raw(p, R"({"__metadata__": {"n": 1}})", 0);
    REQUIRE_THROWS_WITH(SafetensorsFile(p), Contains(p) && Contains("__metadata__"));
  }
  SECTION("unaligned data reads through an aligned copy") {
    const std::string p = dir.file("unaligned.safetensors");
    write_raw(p,
              R"({"u": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]},
                  "w": {"dtype": "F32", "shape": [2], "data_offsets": [2, 10]}})",
              10);
    SafetensorsFile f(p);
    CHECK(test::to_f64(f.view("w")) == std::vector<double>(2, 2.3694278e-38f));
    Tensor w = Tensor::empty({2}, DType::f32);
    f.read_into("w", w);
    float expected;
    const unsigned char ones[4] = {1, 1, 1, 1};
    std::memcpy(&expected, ones, 4);
    CHECK(w.data_as<float>()[0] == expected);
    CHECK(w.data_as<float>()[1] == expected);
  }
  SECTION("missing file") {
    REQUIRE_THROWS_WITH(SafetensorsFile(dir.file("absent.safetensors")),
                        Contains("absent.safetensors"));
  }
}
