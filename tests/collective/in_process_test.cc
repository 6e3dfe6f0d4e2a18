// What the in-process group has beyond the Communicator contract (contract/, which checks every
// collective and failure on it): the bounds of its size. Shares its program with
// hierarchical_test.cc.
#include <doctest/doctest.h>

#include "tandem/collective/in_process.h"

using namespace tandem;
using namespace tandem::collective;

TEST_CASE("in-process group: a group has 1 to 2^24 - 1 ranks") {
  CHECK_THROWS_WITH_AS(make_in_process_group(0), "make_in_process_group: a group has 1 to 2^24 - 1 ranks, got 0",
                       InvalidArgument);
  CHECK_THROWS_AS(make_in_process_group(1 << 24), InvalidArgument);
  CHECK(make_in_process_group(1).size() == 1);
  CHECK(reduce_op_name(ReduceOp::kMean) == "MEAN");
}
