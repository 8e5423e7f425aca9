// fmt formatters for tandem's small types, so messages can print them with {}.
#pragma once

#include <fmt/format.h>

#include <string>

#include "core/device.h"
#include "core/dtype.h"

template <>
struct fmt::formatter<tandem::DType> : fmt::formatter<const char*> {
  auto format(tandem::DType t, format_context& ctx) const {
    return fmt::formatter<const char*>::format(tandem::dtype_name(t), ctx);
  }
};

template <>
struct fmt::formatter<tandem::Device> : fmt::formatter<std::string> {
  auto format(const tandem::Device& d, format_context& ctx) const {
    return fmt::formatter<std::string>::format(d.str(), ctx);
  }
};
