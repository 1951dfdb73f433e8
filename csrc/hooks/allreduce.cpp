// Native twin of ddpx/hooks/allreduce.py: exact fp32 average.
#include "hooks/native_hook.h"

namespace ddpx::hooks {
namespace {

class Allreduce final : public NativeAlgorithm {
 public:
  explicit Allreduce(HookCore&) {}
  FuturePtr run(HookCore& core, c10d::GradBucket& bucket) override { return core.allreduce_average(bucket); }
};

}  // namespace
DDPX_REGISTER_NATIVE_HOOK("allreduce", Allreduce);
}  // namespace ddpx::hooks
