// Shapes, tensor allocation, views and copies.
#include "core/tensor.h"

namespace tandem {

Shape::Shape(std::initializer_list<int64_t> dims) {
  for (int64_t d : dims) push_back(d);
}

int64_t Shape::numel() const {
  int64_t n = 1;
  for (int i = 0; i < ndim_; ++i) n *= dims_[static_cast<size_t>(i)];
  return n;
}

void Shape::push_back(int64_t n) {
  TANDEM_CHECK(ndim_ < kMaxDims, "a shape has at most {} dimensions", kMaxDims);
  TANDEM_CHECK(n >= 0, "negative dimension {} in shape {}", n, str());
  dims_[static_cast<size_t>(ndim_++)] = n;
}

bool Shape::operator==(const Shape& o) const {
  if (ndim_ != o.ndim_) return false;
  for (int i = 0; i < ndim_; ++i)
    if (dims_[static_cast<size_t>(i)] != o.dims_[static_cast<size_t>(i)]) return false;
  return true;
}

std::string Shape::str() const {
  std::string s = "(";
  for (int i = 0; i < ndim_; ++i) s += fmt::format("{}{}", i ? ", " : "", (*this)[i]);
  return s + ")";
}

Tensor Tensor::empty(const Shape& shape, DType dtype, Device device) {
  Tensor t;
  t.shape_ = shape;
  t.dtype_ = dtype;
  t.device_ = device;
  void* p = device_alloc(device, t.nbytes());
  t.storage_ = std::shared_ptr<void>(p, [device](void* q) { device_free(device, q); });
  t.data_ = p;
  return t;
}

Tensor Tensor::zeros(const Shape& shape, DType dtype, Device device) {
  Tensor t = empty(shape, dtype, device);
  t.zero();
  return t;
}

Tensor Tensor::wrap(void* data, const Shape& shape, DType dtype, Device device) {
  Tensor t;
  t.data_ = data;
  t.shape_ = shape;
  t.dtype_ = dtype;
  t.device_ = device;
  return t;
}

int64_t Tensor::size(int d) const {
  const int nd = shape_.ndim();
  const int i = d < 0 ? d + nd : d;
  TANDEM_CHECK(i >= 0 && i < nd, "dimension {} out of range for tensor {}", d, str());
  return shape_[i];
}

int64_t Tensor::stride(int d) const {
  const int nd = shape_.ndim();
  const int i = d < 0 ? d + nd : d;
  TANDEM_CHECK(i >= 0 && i < nd, "dimension {} out of range for tensor {}", d, str());
  int64_t s = 1;
  for (int k = i + 1; k < nd; ++k) s *= shape_[k];
  return s;
}

Tensor Tensor::view(const Shape& shape) const {
  TANDEM_CHECK(shape.numel() == numel(), "cannot view {} as {}: element counts differ", str(),
               shape.str());
  Tensor t = *this;
  t.shape_ = shape;
  return t;
}

Tensor Tensor::narrow(int64_t start, int64_t len) const {
  TANDEM_CHECK(ndim() >= 1 && start >= 0 && len >= 0 && start + len <= shape_[0],
               "narrow({}, {}) out of range for {}", start, len, str());
  Tensor t = *this;
  t.shape_[0] = len;
  t.data_ = static_cast<char*>(data_) + static_cast<size_t>(start * stride(0)) * dtype_size(dtype_);
  return t;
}

void Tensor::copy_from(const Tensor& src) {
  TANDEM_CHECK(src.shape() == shape_ && src.dtype() == dtype_, "copy from {} into {}", src.str(),
               str());
  copy_bytes(data_, device_, src.data(), src.device(), nbytes());
}

Tensor Tensor::to(Device device) const {
  Tensor t = empty(shape_, dtype_, device);
  t.copy_from(*this);
  return t;
}

void Tensor::zero() { fill_zero(data_, device_, nbytes()); }

std::string Tensor::str() const {
  return fmt::format("{}{}@{}", dtype_name(dtype_), shape_.str(), device_.str());
}

}  // namespace tandem
