// Fuzzing harness: read_csv (data/readers.cc), the reader of CSV files of numbers. Each input is
// read twice, with a header and ',' and without one and ';'. Whatever the file holds, read_csv
// must return a table whose shape matches its names, or throw one of tandem's errors: anything
// else, a crash or a sanitizer report, is a finding.
#include <cstdint>

#include "fuzz/fuzz_input.h"
#include "tandem/base/errors.h"
#include "tandem/data/readers.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const auto& path = tandem::fuzz::input_file(data, size);
  for (const tandem::data::CsvOptions options : {tandem::data::CsvOptions{.delimiter = ',', .header = true},
                                                 tandem::data::CsvOptions{.delimiter = ';', .header = false}}) {
    try {
      const auto table = tandem::data::read_csv(path, options);
      const auto& shape = table.values.shape();
      TANDEM_FUZZ_CHECK(shape.rank() == 2);
      TANDEM_FUZZ_CHECK(shape[1] >= 1 && static_cast<std::size_t>(shape[1]) == table.column_names.size());
      // Every value came from a field of at least one byte.
      TANDEM_FUZZ_CHECK(static_cast<std::uint64_t>(shape.num_elements()) <= size);
    } catch (const tandem::Error&) {
      // Every malformed file is one of tandem's errors.
    }
  }
  return 0;
}
