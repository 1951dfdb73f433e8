#pragma once
// Only pybind11 here: module.cpp includes this and needs nothing of torch
// (torch/extension.h alone costs ~45 s of compile time on a small machine).
#include <pybind11/pybind11.h>

namespace ddpx::comm_hooks {
// Adds the native comm-hook registration functions to the Python module.
void bind(pybind11::module_& m);
}  // namespace ddpx::comm_hooks
