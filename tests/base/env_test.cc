// base/env: the parsing rules every TANDEM_* variable follows, and the typed accessors.
#include <doctest/doctest.h>

#include <cstdlib>
#include <optional>
#include <set>
#include <string>

#include "common/error_message.h"
#include "tandem/base/env.h"
#include "tandem/base/errors.h"

using namespace tandem;

namespace {

// Sets a variable of this process for one scope, then restores what was there.
class ScopedVariable {
 public:
  ScopedVariable(const env::Variable& variable, const char* value) : name_(variable.name) {
    if (const char* old = std::getenv(name_.c_str())) previous_ = old;
    if (value != nullptr) {
      ::setenv(name_.c_str(), value, 1);
    } else {
      ::unsetenv(name_.c_str());
    }
  }
  ~ScopedVariable() {
    if (previous_) {
      ::setenv(name_.c_str(), previous_->c_str(), 1);
    } else {
      ::unsetenv(name_.c_str());
    }
  }
  ScopedVariable(const ScopedVariable&) = delete;
  ScopedVariable& operator=(const ScopedVariable&) = delete;

 private:
  std::string name_;
  std::optional<std::string> previous_;
};

}  // namespace

TEST_CASE("booleans: 1/true/yes/on and 0/false/no/off in any case, with blanks around; nothing else") {
  for (const char* yes : {"1", "true", "TRUE", "Yes", "on", " on\t"}) {
    CAPTURE(yes);
    CHECK(env::parse_bool(env::kProfile, yes));
  }
  for (const char* no : {"0", "false", "False", "NO", "off", "0 "}) {
    CAPTURE(no);
    CHECK_FALSE(env::parse_bool(env::kProfile, no));
  }
  for (const char* bad : {"2", "maybe", "y", "enabled", "00", "1x", "-1"}) {
    CAPTURE(bad);
    CHECK(
        testing::error_message([&] { env::parse_bool(env::kProfile, bad); }) ==
        fmt::format("environment variable TANDEM_PROFILE=\"{}\": expected 1, true, yes, on, 0, false, no or off", bad));
  }
}

TEST_CASE("integers: the whole text, decimal, inside the variable's range") {
  CHECK(env::parse_int(env::kNumCpuDevices, "4") == 4);
  CHECK(env::parse_int(env::kNumCpuDevices, " 1024 ") == 1024);
  CHECK(env::parse_int(env::kRestartCount, "0") == 0);
  for (const char* bad : {"0", "1025", "-3", "4x", "x4", "4.0", "0x10", "1e3", "+-1", "99999999999999999999"}) {
    CAPTURE(bad);
    CHECK(testing::error_message([&] { env::parse_int(env::kNumCpuDevices, bad); }) ==
          fmt::format("environment variable TANDEM_NUM_CPU_DEVICES=\"{}\": expected an integer from 1 to 1024", bad));
  }
  CHECK(testing::error_message([] { env::parse_int(env::kRestartCount, "-1"); }) ==
        "environment variable TANDEM_RESTART_COUNT=\"-1\": expected a non-negative integer");
}

TEST_CASE("seconds: a positive decimal number, fractions allowed") {
  using std::chrono::milliseconds;
  CHECK(env::parse_seconds(env::kRendezvousTimeout, "60") == milliseconds(60000));
  CHECK(env::parse_seconds(env::kRendezvousTimeout, "0.25") == milliseconds(250));
  CHECK(env::parse_seconds(env::kRendezvousTimeout, "0.0001") == milliseconds(1));  // never "no time at all"
  for (const char* bad : {"0", "-5", "5s", "inf", "nan", "", "1e300"}) {
    CAPTURE(bad);
    CHECK(testing::error_message([&] { env::parse_seconds(env::kRendezvousTimeout, bad); }) ==
          fmt::format("environment variable TANDEM_RENDEZVOUS_TIMEOUT=\"{}\": expected a positive number of seconds",
                      bad));
  }
}

TEST_CASE("choices: one of the listed words in any case, returned in lower case") {
  CHECK(env::parse_choice(env::kGemm, "OpenBLAS") == "openblas");
  CHECK(env::parse_choice(env::kLogLevel, "warn") == "warn");
  CHECK(testing::error_message([] { env::parse_choice(env::kGemm, "mkl"); }) ==
        "environment variable TANDEM_GEMM=\"mkl\": expected auto, eigen or openblas");
  CHECK(testing::error_message([] { env::parse_choice(env::kWaitPolicy, "spin"); }) ==
        "environment variable TANDEM_WAIT_POLICY=\"spin\": expected adaptive, active or passive");
}

TEST_CASE("a bad value is quoted as it is, escapes included") {
  CHECK(testing::error_message([] { env::parse_bool(env::kCudaGraphs, "o\"n\n"); }) ==
        "environment variable TANDEM_CUDA_GRAPHS=\"o\\\"n\\n\": expected 1, true, yes, on, 0, false, no or off");
  // Bytes that are not UTF-8 (fmt's "{:?}" aborted the process on them) and a long value.
  CHECK(testing::error_message([] { env::parse_int(env::kRestartCount, "1\xd0\xd0"); }) ==
        "environment variable TANDEM_RESTART_COUNT=\"1\xd0\xd0\": expected a non-negative integer");
  CHECK(testing::error_message([] { env::parse_int(env::kRestartCount, std::string(100'000, 'x')); }).size() < 400);
}

TEST_CASE("the accessors read the process environment; unset, empty or blank means the default") {
  for (const char* unset : {static_cast<const char*>(nullptr), "", "  "}) {
    CAPTURE(unset ? unset : "(unset)");
    ScopedVariable graphs(env::kCudaGraphs, unset), profile(env::kProfile, unset), devices(env::kNumCpuDevices, unset),
        threads(env::kIntraOpThreads, unset), gemm(env::kGemm, unset), library(env::kCudnnLibrary, unset),
        timeout(env::kRendezvousTimeout, unset);
    CHECK(env::get_bool(env::kCudaGraphs));     // default 1
    CHECK_FALSE(env::get_bool(env::kProfile));  // default 0
    CHECK(env::get_int(env::kNumCpuDevices) == 1);
    CHECK_FALSE(env::find_int(env::kNumCpuDevices).has_value());
    CHECK_FALSE(env::is_set(env::kIntraOpThreads));
    CHECK_FALSE(env::find_int(env::kIntraOpThreads).has_value());
    CHECK(env::get_string(env::kGemm) == "auto");
    CHECK(env::get_string(env::kCudnnLibrary).empty());
    CHECK(env::get_seconds(env::kRendezvousTimeout) == std::chrono::seconds(300));
  }
  {
    ScopedVariable graphs(env::kCudaGraphs, "off"), devices(env::kNumCpuDevices, "3"), gemm(env::kGemm, "Eigen"),
        library(env::kCudnnLibrary, " /opt/cudnn/libcudnn.so.9 ");
    CHECK_FALSE(env::get_bool(env::kCudaGraphs));
    CHECK(env::get_int(env::kNumCpuDevices) == 3);
    CHECK(env::find_int(env::kNumCpuDevices) == 3);
    CHECK(env::is_set(env::kNumCpuDevices));
    CHECK(env::get_string(env::kGemm) == "eigen");
    CHECK(env::get_string(env::kCudnnLibrary) == "/opt/cudnn/libcudnn.so.9");
  }
  {
    // The two variables that read "0" differently before base/env: now both follow one rule.
    ScopedVariable graphs(env::kCudaGraphs, "false"), profile(env::kProfile, "false");
    CHECK_FALSE(env::get_bool(env::kCudaGraphs));
    CHECK_FALSE(env::get_bool(env::kProfile));
  }
  {
    ScopedVariable devices(env::kNumCpuDevices, "many");
    CHECK(testing::error_message([] { env::get_int(env::kNumCpuDevices); }) ==
          "environment variable TANDEM_NUM_CPU_DEVICES=\"many\": expected an integer from 1 to 1024");
  }
}

TEST_CASE("reading a variable as another type, or without a default, is a bug in tandem") {
  CHECK_THROWS_AS(env::get_bool(env::kNumCpuDevices), Internal);
  CHECK_THROWS_AS(env::parse_int(env::kProfile, "1"), Internal);
  ScopedVariable threads(env::kIntraOpThreads, nullptr);
  CHECK_THROWS_AS(env::get_int(env::kIntraOpThreads), Internal);
}

TEST_CASE("the table: unique TANDEM_* names, one-line meanings, defaults that parse") {
  std::set<std::string_view> names;
  for (const env::Variable* v : env::kAll) {
    CAPTURE(v->name);
    CHECK(v->name.starts_with("TANDEM_"));
    CHECK(names.insert(v->name).second);
    CHECK_FALSE(v->meaning.empty());
    CHECK(v->meaning.find('\n') == std::string_view::npos);
    CHECK(v->meaning.find('|') == std::string_view::npos);  // it is a cell of a Markdown table
    if (v->default_value.empty()) continue;
    switch (v->type) {
      case env::Type::kBool: CHECK_NOTHROW(env::parse_bool(*v, v->default_value)); break;
      case env::Type::kInt: CHECK_NOTHROW(env::parse_int(*v, v->default_value)); break;
      case env::Type::kSeconds: CHECK_NOTHROW(env::parse_seconds(*v, v->default_value)); break;
      case env::Type::kChoice: CHECK(env::parse_choice(*v, v->default_value) == v->default_value); break;
      case env::Type::kString: break;
    }
  }
}
