#include "hooks/bindings.h"

namespace ddpx::hooks {
void bind(pybind11::module_& m) {
  (void)m;  // native hooks are added by the comm-hooks work
}
}  // namespace ddpx::hooks
