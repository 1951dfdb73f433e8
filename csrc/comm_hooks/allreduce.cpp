// Native twin of ddpx/comm_hooks/allreduce.py: exact fp32 average.
#include "comm_hooks/native_hook.h"

namespace ddpx::comm_hooks {
namespace {

class Allreduce final : public NativeAlgorithm {
 public:
  explicit Allreduce(HookRunner&) {}
  FuturePtr run(HookRunner& runner, c10d::GradBucket& bucket) override { return runner.allreduce_average(bucket); }
};

}  // namespace
DDPX_REGISTER_NATIVE_HOOK("allreduce", Allreduce);
}  // namespace ddpx::comm_hooks
