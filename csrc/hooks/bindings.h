#pragma once
#include <torch/extension.h>

namespace ddpx::hooks {
// Adds the native comm-hook registration functions to the Python module.
void bind(pybind11::module_& m);
}  // namespace ddpx::hooks
