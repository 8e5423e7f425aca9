// CPU embedding gather and its backward scatter-add (arguments already checked).
#pragma once

#include <cstdint>

#include "core/tensor.h"

namespace tandem::ops::cpu {

// The first position of ids (T) i32 whose id is outside [0, V), or -1.
int64_t first_bad_id(const Tensor& ids, int64_t V);
// out (T, C) f32 = table (V, C) [ids]; ids are checked while gathering: a row with an id outside
// [0, V) is written as zeros. Returns the first such position, or -1.
int64_t embedding(const Tensor& ids, const Tensor& table, const Tensor& out);
// dtable (V, C) [+]= the rows of dout (T, C) added at ids (T), each row in token order. All ids
// must be in range (the caller checked them).
void embedding_backward(const Tensor& ids, const Tensor& dout, const Tensor& dtable,
                        bool accumulate);

}  // namespace tandem::ops::cpu
