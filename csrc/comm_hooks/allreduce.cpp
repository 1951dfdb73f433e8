// Native twin of ddpx/comm_hooks/allreduce.py: exact fp32 average.
#include "comm_hooks/native_hook.h"

namespace ddpx::comm_hooks {
namespace {

class Allreduce final : public NativeAlgorithm {
 public:
  explicit Allreduce(HookCore&) {}
  FuturePtr run(HookCore& core, c10d::GradBucket& bucket) override { return core.allreduce_average(bucket); }
};

}  // namespace
DDPX_REGISTER_NATIVE_HOOK("allreduce", Allreduce);
}  // namespace ddpx::comm_hooks
