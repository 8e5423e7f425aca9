// Tensor: a typed, shaped, contiguous view of memory on one device, owning or borrowed.
#pragma once

#include <fmt/format.h>

#include <array>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>

#include "core/device.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/format.h"

namespace tandem {

constexpr int kMaxDims = 5;

// Sizes of up to kMaxDims dimensions, outermost first.
class Shape {
 public:
  Shape() = default;
  Shape(std::initializer_list<int64_t> dims);
  template <class It>
  Shape(It begin, It end) {
    for (; begin != end; ++begin) push_back(static_cast<int64_t>(*begin));
  }

  int ndim() const { return ndim_; }
  int64_t operator[](int d) const { return dims_[static_cast<size_t>(d)]; }
  int64_t& operator[](int d) { return dims_[static_cast<size_t>(d)]; }
  int64_t numel() const;
  void push_back(int64_t n);
  bool operator==(const Shape& o) const;
  std::string str() const;  // "(2, 3)"

 private:
  std::array<int64_t, kMaxDims> dims_{};
  int ndim_ = 0;
};

// Row-major contiguous tensor. Copies share the memory (like a shared_ptr); views never copy.
class Tensor {
 public:
  Tensor() = default;

  // Allocates owned memory (not for hot paths: use an Arena there). Contents are undefined.
  static Tensor empty(const Shape& shape, DType dtype, Device device = Device::cpu());
  static Tensor zeros(const Shape& shape, DType dtype, Device device = Device::cpu());
  // Borrows memory owned elsewhere (an arena, a mapped file); the caller keeps it alive.
  static Tensor wrap(void* data, const Shape& shape, DType dtype, Device device = Device::cpu());

  bool defined() const { return data_ != nullptr || shape_.ndim() > 0; }
  void* data() const { return data_; }
  template <class T>
  T* data_as() const {
    TANDEM_CHECK(dtype_ == dtype_of<T>, "tensor {} is {}, accessed as {}", shape_.str(), dtype_,
                 dtype_of<T>);
    return static_cast<T*>(data_);
  }
  const Shape& shape() const { return shape_; }
  int ndim() const { return shape_.ndim(); }
  // Size of dimension d; negative d counts from the end.
  int64_t size(int d) const;
  int64_t numel() const { return shape_.numel(); }
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype_); }
  DType dtype() const { return dtype_; }
  Device device() const { return device_; }
  // Elements between consecutive indices of dimension d.
  int64_t stride(int d) const;

  // Same memory, new shape with the same number of elements.
  Tensor view(const Shape& shape) const;
  // Rows [start, start + len) of dimension 0.
  Tensor narrow(int64_t start, int64_t len) const;

  // Synchronous copies; shapes and dtypes must match.
  void copy_from(const Tensor& src);
  Tensor to(Device device) const;
  void zero();

  std::string str() const;  // "f32(2, 3)@cpu"

 private:
  std::shared_ptr<void> storage_;
  void* data_ = nullptr;
  Shape shape_;
  DType dtype_ = DType::f32;
  Device device_;
};

}  // namespace tandem

template <>
struct fmt::formatter<tandem::Shape> : fmt::formatter<std::string> {
  auto format(const tandem::Shape& s, format_context& ctx) const {
    return fmt::formatter<std::string>::format(s.str(), ctx);
  }
};
