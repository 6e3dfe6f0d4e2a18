// tests/collective/on_ranks.h — running one function on every rank of a group, and reading what
// each rank threw. Shared by the suites whose ranks are threads of the test (gloo_test,
// shared_memory_test, hierarchical_test).
#pragma once

#include <doctest/doctest.h>

#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "tandem/collective/communicator.h"

namespace tandem::testing {

using Group = std::vector<std::unique_ptr<collective::Communicator>>;

// Runs fn(communicator) on one thread per rank, all at once (ranks wait for each other inside a
// collective; NCCL needs every rank's call issued together); returns what each rank threw (null:
// nothing).
inline std::vector<std::exception_ptr> on_ranks(Group& group,
                                                const std::function<void(collective::Communicator&)>& fn) {
  std::vector<std::exception_ptr> errors(group.size());
  std::vector<std::thread> threads;
  for (std::size_t r = 0; r < group.size(); ++r) {
    threads.emplace_back([&, r] {
      try {
        fn(*group[r]);
      } catch (...) {
        errors[r] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  return errors;
}

inline void require_no_errors(const std::vector<std::exception_ptr>& errors) {
  for (std::size_t r = 0; r < errors.size(); ++r) {
    if (!errors[r]) continue;
    try {
      std::rethrow_exception(errors[r]);
    } catch (const std::exception& e) {
      FAIL("rank " << r << " threw: " << e.what());
    }
  }
}

// The message of an error if it is an E, else a description of what it was.
template <class E>
std::string error_as(const std::exception_ptr& error) {
  if (!error) return "<no error>";
  try {
    std::rethrow_exception(error);
  } catch (const E& e) {
    return e.what();
  } catch (const std::exception& e) {
    return std::string("<another error type: ") + e.what() + ">";
  }
}

}  // namespace tandem::testing
