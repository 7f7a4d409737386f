// bench/run_cmd.h — `psld bench run` (tools/psld.cc calls it): the benchmark
// suites, repeated, into one Google Benchmark-shaped report (bench/report.h)
// that `psld bench compare` reads.
#pragma once

#include <string>
#include <vector>

#include "bench/report.h"

namespace psld::bench {

// argv holds what follows "psld bench run". Returns the exit status: 0 when
// every suite ran, 1 when one failed, 2 on bad options.
int cmd_run(int argc, char** argv);

// One repetition's rows of a Google Benchmark suite, as `psld bench run`
// keeps them: names prefixed "<suite>/", every row's yardstick named and its
// ratio computed against the yardstick row of the same repetition (the same
// process run), with `speed` the metric compared ("bytes_per_second",
// "items_per_second", or "real_time", where the ratio is yardstick time over
// row time). Rows whose yardstick is missing from the run keep no ratio.
// Exposed for tests.
enum class Speed : uint8_t { kBytesPerSecond, kItemsPerSecond, kInverseTime };
void add_ratios(std::vector<Row>& rows, const std::string& suite,
                std::string (*yardstick_of)(const std::string& name), Speed speed);

}  // namespace psld::bench
