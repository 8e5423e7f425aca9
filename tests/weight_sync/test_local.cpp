#include <catch2/catch.hpp>

#include <vector>

#include "core/error.h"
#include "kernels/ops.h"
#include "tests/testutil.h"
#include "weight_sync/local.h"

using namespace tandem;
using namespace tandem::test;
using weight_sync::LocalPublisher;
using weight_sync::Param;
using weight_sync::Transfer;

namespace {

std::vector<Param> params(DType dtype, uint64_t seed) {
  return {{"model.embed_tokens.weight", random_tensor({7, 5}, dtype, seed)},
          {"model.norm.weight", random_tensor({5}, dtype, seed + 1)}};
}

std::vector<Param> like(const std::vector<Param>& src, DType dtype) {
  std::vector<Param> out;
  for (const Param& p : src)
    out.push_back({p.name, Tensor::zeros(p.tensor.shape(), dtype, p.tensor.device())});
  return out;
}

}  // namespace

TEST_CASE("weight_sync local publish moves nothing when the engine reads the trainer's tensors",
          "[unit]") {
  const std::vector<Param> trainer = params(DType::f32, 1);
  const LocalPublisher pub(trainer, trainer);
  CHECK(pub.zero_copy());
  CHECK(pub.transfer(0) == Transfer::shared);
  const weight_sync::PublishStats st = pub.publish(3);
  CHECK(st.version == 3);
  CHECK(st.shared == 2);
  CHECK(st.bytes_written == 0);
}

TEST_CASE("weight_sync local publish copies same-dtype tensors and casts f32 to bf16 in one pass",
          "[unit]") {
  const std::vector<Param> trainer = params(DType::f32, 2);
  const std::vector<Param> same = like(trainer, DType::f32);
  const std::vector<Param> half = like(trainer, DType::bf16);

  const LocalPublisher copy(trainer, same);
  CHECK_FALSE(copy.zero_copy());
  CHECK(copy.transfer(1) == Transfer::copy);
  const weight_sync::PublishStats sc = copy.publish(1);
  CHECK(sc.copied == 2);
  CHECK(sc.bytes_written == (35 + 5) * 4);
  for (size_t i = 0; i < trainer.size(); ++i)
    CHECK(bitwise_equal(same[i].tensor, trainer[i].tensor));

  const LocalPublisher cast(trainer, half);
  CHECK(cast.transfer(0) == Transfer::cast);
  const weight_sync::PublishStats sh = cast.publish(2);
  CHECK(sh.cast == 2);
  CHECK(sh.bytes_written == (35 + 5) * 2);
  for (size_t i = 0; i < trainer.size(); ++i) {
    // The same rounding as the kernels' cast, which the bf16 engine weights of a loaded model get.
    const Tensor expected = Tensor::zeros(trainer[i].tensor.shape(), DType::bf16);
    ops::cast(trainer[i].tensor, expected);
    CHECK(bitwise_equal(half[i].tensor, expected));
  }
}

TEST_CASE("weight_sync local publish refuses layouts that do not match naming the tensor",
          "[unit]") {
  const std::vector<Param> trainer = params(DType::f32, 3);
  std::vector<Param> renamed = like(trainer, DType::f32);
  renamed[1].name = "model.final_norm.weight";
  CHECK_THROWS_WITH(LocalPublisher(trainer, renamed),
                    Catch::Contains("'model.norm.weight' on the trainer") &&
                        Catch::Contains("'model.final_norm.weight' on the engine"));
  std::vector<Param> reshaped = like(trainer, DType::f32);
  reshaped[0].tensor = Tensor::zeros({5, 7}, DType::f32);
  CHECK_THROWS_WITH(LocalPublisher(trainer, reshaped),
                    Catch::Contains("model.embed_tokens.weight is (7, 5) on the trainer"));
  const std::vector<Param> fewer(trainer.begin(), trainer.begin() + 1);
  CHECK_THROWS_WITH(LocalPublisher(trainer, fewer), Catch::Contains("2 parameter tensors"));
}
