// Names of element types.
#include "core/dtype.h"

#include <cstring>

#include "core/error.h"
#include "core/format.h"

namespace tandem {

const char* dtype_name(DType t) {
  switch (t) {
    case DType::f32:
      return "f32";
    case DType::bf16:
      return "bf16";
    case DType::f16:
      return "f16";
    case DType::i32:
      return "i32";
    case DType::i64:
      return "i64";
    case DType::u8:
      return "u8";
  }
  return "?";
}

DType dtype_from_name(const char* name) {
  for (DType t : {DType::f32, DType::bf16, DType::f16, DType::i32, DType::i64, DType::u8}) {
    if (std::strcmp(name, dtype_name(t)) == 0) return t;
  }
  TANDEM_FAIL("unknown dtype '{}': use one of f32, bf16, f16, i32, i64, u8", name);
}

}  // namespace tandem
