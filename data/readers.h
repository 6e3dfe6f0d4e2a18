// tandem/data/readers.h — files into tensors: IDX (MNIST's format) and CSV.
#pragma once

#include <string>
#include <vector>

#include "tandem/graph/tensor.h"

namespace tandem::data {

// Reads an IDX file, plain or gzip-compressed (detected from its first bytes). The tensor has the
// file's dimensions and element type (uint8, int32, float32 or float64; int8 and int16 widen to
// int32), on the host. A missing file raises NotFound naming the path; a bad magic number, a
// truncated header or truncated data raise DataLoss naming the file and the byte offset. The
// sizes the header declares are checked against the file before anything is allocated (memory
// grows only with data that is really there), and dimensions whose product, zeros left out,
// passes 16 GiB of data are refused as a corrupt header.
Tensor read_idx(const std::string& path);

struct CsvOptions {
  char delimiter = ',';
  bool header = true;  // the first line names the columns
};

struct CsvTable {
  std::vector<std::string> column_names;  // from the header, or "column_0", "column_1", ...
  Tensor values;                          // float32 [rows, columns]
};

// Reads a CSV file of numbers. Empty lines are skipped; a row with the wrong number of fields or a
// field that is not a number raises DataLoss naming the file, the line and the column, and a file
// without a line ("empty: no header row", or "no rows" without a header) raises DataLoss naming
// the file. A header alone is a table of no rows.
CsvTable read_csv(const std::string& path, const CsvOptions& options = {});

}  // namespace tandem::data
