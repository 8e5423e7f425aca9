// Tensors, views and arenas.
#include <catch2/catch.hpp>

#include "core/arena.h"
#include "core/tensor.h"
#include "tests/testutil.h"

using namespace tandem;

TEST_CASE("tensor views share memory and narrow selects rows", "[unit]") {
  Tensor t = test::random_tensor({4, 6}, DType::f32, 1);
  CHECK(t.numel() == 24);
  CHECK(t.stride(0) == 6);
  CHECK(t.stride(-1) == 1);
  Tensor v = t.view({2, 12});
  CHECK(v.data() == t.data());
  Tensor rows = t.narrow(1, 2);
  CHECK(rows.shape() == Shape{2, 6});
  CHECK(rows.data_as<float>()[0] == t.data_as<float>()[6]);
  CHECK_THROWS_AS(t.view({5, 5}), Error);
  CHECK_THROWS_AS(t.narrow(3, 2), Error);
  CHECK_THROWS_AS(t.data_as<int32_t>(), Error);
  CHECK_THROWS_AS(Shape({1, 2, 3, 4, 5, 6}), Error);
}

TEST_CASE("tensor copies round-trip and errors name the shapes", "[unit]") {
  Tensor a = test::random_tensor({3, 5}, DType::bf16, 2);
  Tensor b = Tensor::zeros({3, 5}, DType::bf16);
  b.copy_from(a);
  CHECK(test::bitwise_equal(a, b));
  Tensor c = Tensor::zeros({5, 3}, DType::bf16);
  try {
    c.copy_from(a);
    FAIL("copy between shapes must throw");
  } catch (const Error& e) {
    const std::string msg = e.what();
    CHECK(msg.find("(3, 5)") != std::string::npos);
    CHECK(msg.find("(5, 3)") != std::string::npos);
    // The place in the source is kept apart from the sentence the user reads.
    CHECK(msg.find("tensor.cpp") == std::string::npos);
    CHECK(e.where().find("tensor.cpp:") != std::string::npos);
  }
}

TEST_CASE("arenas hand out aligned, fixed addresses and can be emptied and released", "[unit]") {
  Arena arena(ArenaClass::activations, Device::cpu(), 4096);
  Tensor a = arena.alloc({10}, DType::f32);
  Tensor b = arena.alloc({3}, DType::bf16);
  CHECK(reinterpret_cast<uintptr_t>(a.data()) % Arena::kAlignment == 0);
  CHECK(reinterpret_cast<uintptr_t>(b.data()) % Arena::kAlignment == 0);
  CHECK(b.data() != a.data());
  CHECK(arena.used() == 256 + 6);
  arena.reset();
  CHECK(arena.alloc({10}, DType::f32).data() == a.data());
  CHECK_THROWS_AS(arena.alloc({2000}, DType::f32), Error);
  arena.release();
  CHECK_FALSE(arena.reserved());
  CHECK_THROWS_AS(arena.alloc({1}, DType::f32), Error);
  arena.reserve();
  CHECK(arena.alloc({1}, DType::f32).numel() == 1);
}
