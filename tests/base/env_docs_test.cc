// The README's "Environment variables" table is base/env.h's table, and no TANDEM_* variable is
// named in the README or used in the library's sources without being in it. On a mismatch the
// test prints the table the README should hold.
#include <doctest/doctest.h>

#include <filesystem>
#include <fstream>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "tandem/base/env.h"

using namespace tandem;
namespace fs = std::filesystem;

namespace {

const fs::path kSourceDir = TANDEM_SOURCE_DIR;

std::string read_file(const fs::path& path) {
  std::ifstream in(path);
  REQUIRE_MESSAGE(in.good(), "cannot read ", path.string());
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

std::string values_cell(const env::Variable& v) {
  switch (v.type) {
    case env::Type::kBool: return "boolean";
    case env::Type::kInt:
      return v.max == env::kMaxInt ? fmt::format("integer ≥ {}", v.min) : fmt::format("integer {} to {}", v.min, v.max);
    case env::Type::kSeconds: return "seconds";
    case env::Type::kString: return "text";
    case env::Type::kChoice: {
      std::string out;
      for (auto choice : v.choices) out += fmt::format("{}`{}`", out.empty() ? "" : ", ", choice);
      return out;
    }
  }
  return {};
}

// The table as the README must show it, one string per line.
std::vector<std::string> expected_table() {
  std::vector<std::string> lines = {"| variable | values | default | what it does |", "|---|---|---|---|"};
  for (const env::Variable* v : env::kAll) {
    const std::string default_cell = v->default_value.empty() ? "unset" : fmt::format("`{}`", v->default_value);
    lines.push_back(fmt::format("| `{}` | {} | {} | {} |", v->name, values_cell(*v), default_cell, v->meaning));
  }
  return lines;
}

// The first Markdown table after the heading, one string per line.
std::vector<std::string> table_after(const std::string& text, const std::string& heading) {
  std::istringstream in(text);
  std::vector<std::string> table;
  bool in_section = false;
  for (std::string line; std::getline(in, line);) {
    if (line == heading) {
      in_section = true;
    } else if (in_section && line.starts_with("|")) {
      table.push_back(line);
    } else if (in_section && !table.empty()) {
      break;
    }
  }
  return table;
}

// -DTANDEM_CUDA=ON names a CMake option, not an environment variable.
bool is_cmake_option(const std::string& text, const std::smatch& name) {
  const auto at = static_cast<std::size_t>(name.position());
  return at >= 2 && text.compare(at - 2, 2, "-D") == 0;
}

std::set<std::string> table_names() {
  std::set<std::string> names;
  for (const env::Variable* v : env::kAll) names.emplace(v->name);
  return names;
}

}  // namespace

TEST_CASE("README.md's \"Environment variables\" table is base/env.h's") {
  const auto expected = expected_table();
  const auto actual = table_after(read_file(kSourceDir / "README.md"), "## Environment variables");
  std::string paste;
  for (const auto& line : expected) paste += line + "\n";
  CHECK_MESSAGE(actual == expected, "README.md's section \"## Environment variables\" should hold this table:\n",
                paste);
}

TEST_CASE("every TANDEM_* variable the README names is in the table") {
  const std::string readme = read_file(kSourceDir / "README.md");
  const auto names = table_names();
  const std::regex variable("TANDEM_[A-Z0-9_]+");
  for (auto it = std::sregex_iterator(readme.begin(), readme.end(), variable); it != std::sregex_iterator(); ++it) {
    if (is_cmake_option(readme, *it)) continue;
    CAPTURE(it->str());
    CHECK(names.contains(it->str()));
  }
}

TEST_CASE("every TANDEM_* name quoted in the library's sources is in the table") {
  const auto names = table_names();
  const std::regex literal(R"re("(?:[^"\\\n]|\\.)*")re");
  const std::regex variable("TANDEM_[A-Z0-9_]+");
  int files = 0;
  for (const char* module : {"base", "devices", "graph", "ops", "collective", "data", "strategy", "keras_like"}) {
    for (const auto& entry : fs::recursive_directory_iterator(kSourceDir / module)) {
      const auto extension = entry.path().extension();
      if (extension != ".h" && extension != ".cc" && extension != ".cu") continue;
      ++files;
      const std::string text = read_file(entry.path());
      for (auto l = std::sregex_iterator(text.begin(), text.end(), literal); l != std::sregex_iterator(); ++l) {
        const std::string quoted = l->str();
        for (auto v = std::sregex_iterator(quoted.begin(), quoted.end(), variable); v != std::sregex_iterator(); ++v) {
          if (is_cmake_option(quoted, *v)) continue;
          CAPTURE(entry.path().string());
          CAPTURE(v->str());
          CHECK(names.contains(v->str()));
        }
      }
    }
  }
  CHECK(files > 50);
}
