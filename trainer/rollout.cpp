// LocalRollout: this rank's engine as the job's rollout.
#include "trainer/rollout.h"

#include "trainer/rollout_group.h"

namespace tandem::trainer {

void LocalRollout::publish(uint64_t version) { engine_.set_weights(group_.weights(), version); }

}  // namespace tandem::trainer
