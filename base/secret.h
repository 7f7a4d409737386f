// What every refusal for a wrong job secret tells the operator to compare:
// the two ways a process gets the secret. One text, so that the UCX
// bootstrap, the coordinator and the servers say the same thing.
#pragma once

namespace psld {

inline constexpr char kSameSecretEverywhere[] =
    "PSLD_JOB_SECRET or PSLD_SECRET_FILE must be the same on every process of the job";

}  // namespace psld
