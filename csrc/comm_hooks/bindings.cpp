#include "comm_hooks/bindings.h"

#include <torch/extension.h>
#include <torch/csrc/distributed/c10d/reducer.hpp>

#include "comm_hooks/native_hook.h"

namespace py = pybind11;

namespace ddpx::comm_hooks {
void bind(pybind11::module_& m) {
  m.attr("has_native_hooks") = true;
  m.def("native_hook_kinds", &algorithm_kinds, "The native algorithms built into this extension.");
  m.def(
      "register_native_comm_hook",
      [](c10d::Reducer& reducer, c10d::ProcessGroup* group, c10d::ProcessGroup* executor_group, py::object state,
         const std::string& kind) {
        // The groups are held by Python through their own holder type; take
        // references of ours on the same objects.
        auto pg = c10::intrusive_ptr<c10d::ProcessGroup>::reclaim_copy(group);
        c10::intrusive_ptr<c10d::ProcessGroup> executor_pg;
        if (executor_group) executor_pg = c10::intrusive_ptr<c10d::ProcessGroup>::reclaim_copy(executor_group);
        auto runner = std::make_shared<HookRunner>(std::move(pg), std::move(executor_pg), std::move(state), kind);
        std::weak_ptr<HookRunner> weak = runner;  // the reducer owns the hook; these must not keep it
        reducer.register_comm_hook(std::make_unique<NativeHook>(std::move(runner)));
        return py::cpp_function([weak] {
          if (auto runner = weak.lock()) runner->close();
        });
      },
      py::arg("reducer"), py::arg("process_group"), py::arg("executor_group"), py::arg("state"), py::arg("kind"),
      "Register the native ddpx comm hook `kind` on a DDP reducer; `state` is the Python ddpx.comm_hooks state that "
      "owns options, counters and buffers. Returns the function that ends the hook's executor thread "
      "(HookState.close).");
}
}  // namespace ddpx::comm_hooks
