// Element types of tensors: sizes, names and the C++ type of each. Free of fmt (CUDA includes it).
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/half.h"

namespace tandem {

enum class DType : uint8_t { f32, bf16, f16, i32, i64, u8 };

constexpr size_t dtype_size(DType t) {
  switch (t) {
    case DType::f32:
    case DType::i32:
      return 4;
    case DType::bf16:
    case DType::f16:
      return 2;
    case DType::i64:
      return 8;
    case DType::u8:
      return 1;
  }
  return 0;
}

const char* dtype_name(DType t);
// Parses "f32", "bf16", ...; throws tandem::Error naming the accepted names otherwise.
DType dtype_from_name(const char* name);

constexpr bool dtype_is_float(DType t) {
  return t == DType::f32 || t == DType::bf16 || t == DType::f16;
}

template <class T>
struct DTypeOf;
template <>
struct DTypeOf<float> {
  static constexpr DType value = DType::f32;
};
template <>
struct DTypeOf<bf16> {
  static constexpr DType value = DType::bf16;
};
template <>
struct DTypeOf<f16> {
  static constexpr DType value = DType::f16;
};
template <>
struct DTypeOf<int32_t> {
  static constexpr DType value = DType::i32;
};
template <>
struct DTypeOf<int64_t> {
  static constexpr DType value = DType::i64;
};
template <>
struct DTypeOf<uint8_t> {
  static constexpr DType value = DType::u8;
};
template <class T>
inline constexpr DType dtype_of = DTypeOf<T>::value;

}  // namespace tandem
