// The memory a device has for new allocations now, for checks of sizes at start-up that name the
// setting to lower instead of failing later in an allocation.
#pragma once

#include "core/device.h"

namespace tandem {

// Bytes new allocations on `d` can take now: the kernel's MemAvailable for the CPU, the free
// memory of a CUDA device; 0 when unknown.
double memory_available(Device d);

}  // namespace tandem
