// data/text.h: reading text files, byte and character vocabularies (UTF-8 replaced as Python
// does), saving and loading them, next-token windows and the train/validation split.
#include <doctest/doctest.h>
#include <zlib.h>

#include <algorithm>
#include <fstream>
#include <numeric>
#include <set>

#include "common/error_message.h"
#include "common/temp_dir.h"
#include "tandem/data/detail/utf8.h"
#include "tandem/data/text.h"

using namespace tandem;
using data::Dataset;
using data::Vocabulary;
using tandem::testing::error_message;

namespace {

struct TempDir : testing::TempDir {
  TempDir() : testing::TempDir("tandem_text_test") {}
};

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  REQUIRE(out.good());
}

std::string gzip_bytes(const std::string& text) {
  uLongf size = compressBound(static_cast<uLong>(text.size())) + 32;
  std::string out(size, '\0');
  z_stream stream{};
  // windowBits 15 + 16: a gzip wrapper (header and CRC trailer) rather than zlib's.
  REQUIRE(deflateInit2(&stream, Z_BEST_COMPRESSION, Z_DEFLATED, 15 + 16, 8, Z_DEFAULT_STRATEGY) == Z_OK);
  stream.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(text.data()));
  stream.avail_in = static_cast<uInt>(text.size());
  stream.next_out = reinterpret_cast<Bytef*>(out.data());
  stream.avail_out = static_cast<uInt>(out.size());
  REQUIRE(deflate(&stream, Z_FINISH) == Z_STREAM_END);
  out.resize(stream.total_out);
  deflateEnd(&stream);
  return out;
}

std::vector<std::int32_t> ids_of(const Tensor& t) { return t.to_vector<std::int32_t>(); }

// The code points Python's bytes.decode("utf-8", errors="replace") gives, written out by hand.
std::u32string decoded(const std::string& bytes) { return data::detail::decode_utf8(bytes); }

constexpr char32_t R = 0xFFFD;

}  // namespace

TEST_CASE("read_text_file reads plain and gzip files, deciding by the magic bytes, not the name") {
  TempDir dir;
  const std::string text = "Hello, world\n\xc3\xa9t\xc3\xa9\nthe end";
  write_bytes(dir.file("plain.txt"), text);
  write_bytes(dir.file("plain-named.gz"), text);
  write_bytes(dir.file("gzip-named.txt"), gzip_bytes(text));
  write_bytes(dir.file("empty.txt"), "");
  CHECK(data::read_text_file(dir.file("plain.txt")) == text);
  CHECK(data::read_text_file(dir.file("plain-named.gz")) == text);
  CHECK(data::read_text_file(dir.file("gzip-named.txt")) == text);
  CHECK(data::read_text_file(dir.file("empty.txt")).empty());
  // Bigger than the first read's chunk, compressed well: the buffer grows as the stream inflates.
  std::string big;
  for (int i = 0; i < 200000; ++i) big += "line " + std::to_string(i % 97) + "\n";
  write_bytes(dir.file("big.gz"), gzip_bytes(big));
  CHECK(data::read_text_file(dir.file("big.gz")) == big);
}

TEST_CASE("read_text_file: a missing file, a corrupt or truncated gzip stream are typed errors naming the file") {
  TempDir dir;
  auto message = error_message<NotFound>([&] { data::read_text_file(dir.file("missing.txt")); });
  CHECK(contains(message, dir.file("missing.txt")));

  std::string gz = gzip_bytes(std::string(5000, 'x') + "the text goes on and on");
  write_bytes(dir.file("truncated.gz"), gz.substr(0, gz.size() / 2));
  message = error_message<DataLoss>([&] { data::read_text_file(dir.file("truncated.gz")); });
  CHECK(contains(message, dir.file("truncated.gz")));
  CHECK(contains(message, "truncated"));

  std::string bad_data = gz;
  for (std::size_t i = 12; i < 30; ++i) bad_data[i] = static_cast<char>(0xff);  // the deflate stream
  write_bytes(dir.file("corrupt.gz"), bad_data);
  message = error_message<DataLoss>([&] { data::read_text_file(dir.file("corrupt.gz")); });
  CHECK(contains(message, dir.file("corrupt.gz")));

  std::string bad_crc = gz;
  bad_crc[bad_crc.size() - 8] = static_cast<char>(bad_crc[bad_crc.size() - 8] ^ 1);  // the CRC32 trailer
  write_bytes(dir.file("crc.gz"), bad_crc);
  message = error_message<DataLoss>([&] { data::read_text_file(dir.file("crc.gz")); });
  CHECK(contains(message, dir.file("crc.gz")));

  write_bytes(dir.file("header-only.gz"), std::string("\x1f\x8b", 2));
  message = error_message<DataLoss>([&] { data::read_text_file(dir.file("header-only.gz")); });
  CHECK(contains(message, dir.file("header-only.gz")));
}

TEST_CASE("UTF-8 decoding replaces invalid sequences exactly as Python's errors=\"replace\" (maximal subparts)") {
  // Valid sequences of every length, at the edges of their ranges.
  CHECK(decoded("a\x7f") == U"a\x7f");
  CHECK(decoded("\xc2\x80\xdf\xbf") == std::u32string{0x80, 0x7FF});
  CHECK(decoded("\xe0\xa0\x80\xed\x9f\xbf\xee\x80\x80\xef\xbf\xbf") == std::u32string{0x800, 0xD7FF, 0xE000, 0xFFFF});
  CHECK(decoded("\xf0\x90\x80\x80\xf4\x8f\xbf\xbf") == std::u32string{0x10000, 0x10FFFF});
  CHECK(decoded("\xe2\x82\xac") == std::u32string{0x20AC});
  CHECK(decoded("\xef\xbf\xbd") == std::u32string{R});  // U+FFFD itself
  // A lone continuation byte, and bytes that start no sequence (C0, C1, F5..FF): one U+FFFD each.
  CHECK(decoded("a\x80"
                "b") == std::u32string{'a', R, 'b'});
  CHECK(decoded("\x80\xbf") == std::u32string{R, R});
  CHECK(decoded("\xf5\x80") == std::u32string{R, R});
  CHECK(decoded("\xfe\xff") == std::u32string{R, R});
  CHECK(decoded("\xf8\x88\x80\x80\x80") == std::u32string{R, R, R, R, R});  // old 5-byte form
  // Overlong forms: the lead byte cannot be followed by what follows, so each byte is replaced.
  CHECK(decoded(std::string("\xc0\x80", 2)) == std::u32string{R, R});
  CHECK(decoded("\xc1\xbf") == std::u32string{R, R});
  CHECK(decoded("\xe0\x80\x80") == std::u32string{R, R, R});
  CHECK(decoded("\xf0\x80\x80\x80") == std::u32string{R, R, R, R});
  // Surrogates (ED A0..BF) and values past U+10FFFF (F4 90..).
  CHECK(decoded("\xed\xa0\x80") == std::u32string{R, R, R});
  CHECK(decoded("\xed\xbf\xbf") == std::u32string{R, R, R});
  CHECK(decoded("\xf4\x90\x80\x80") == std::u32string{R, R, R, R});
  // Truncated sequences: the maximal valid prefix becomes one U+FFFD, at the end or mid-text.
  CHECK(decoded("\xc2") == std::u32string{R});
  CHECK(decoded("\xe0\xa0") == std::u32string{R});
  CHECK(decoded("\xf0\x90\x80") == std::u32string{R});
  CHECK(decoded("\xf0\x90\x80z") == std::u32string{R, 'z'});
  CHECK(decoded("\xe2\x82\xe2\x82\xac") == std::u32string{R, 0x20AC});
  CHECK(decoded("\xe1\x80\xe2\xf0\x91\x92\xf1\xbf\x41") == std::u32string{R, R, R, R, 'A'});
  // The Unicode Standard's own example (Table 3-8's text): 61 F1 80 80 E1 80 C2 62 80 63 80 BF 64.
  CHECK(decoded("a\xf1\x80\x80\xe1\x80\xc2"
                "b\x80"
                "c\x80\xbf"
                "d") == std::u32string{'a', R, R, R, 'b', R, 'c', R, R, 'd'});
  CHECK(decoded("").empty());
}

TEST_CASE("a character vocabulary is the sorted set of the text's characters; ids follow that order") {
  // b, C0 (invalid: U+FFFD), a, the euro sign, b again.
  const std::string text =
      "b\xc0"
      "a\xe2\x82\xac"
      "b";
  const auto vocab = Vocabulary::from_text(text);
  CHECK(vocab.kind() == Vocabulary::Kind::kCharacters);
  CHECK(vocab.characters() == std::u32string{'a', 'b', 0x20AC, R});
  CHECK(vocab.size() == 4);
  CHECK(vocab.get_vocabulary() == std::vector<std::string>{"a", "b", "\xe2\x82\xac", "\xef\xbf\xbd"});
  const auto ids = vocab.encode(text);
  CHECK(ids.dtype() == DType::kI32);
  CHECK(ids.shape() == Shape{5});
  CHECK(ids_of(ids) == std::vector<std::int32_t>{1, 3, 0, 2, 1});
  // Decoding gives the text with the invalid byte replaced (what Python's decode gives).
  CHECK(vocab.decode(ids) ==
        "b\xef\xbf\xbd"
        "a\xe2\x82\xac"
        "b");
  // int64 ids and any shape decode too.
  CHECK(vocab.decode(Tensor::from_vector<std::int64_t>({2, 0, 1, 0}, {2, 2})) ==
        "\xe2\x82\xac"
        "aba");
  // Surrogate bytes and an overlong form replace to U+FFFD, which is then one character.
  const auto replaced = Vocabulary::from_text("\xed\xa0\x80z\xc1\xbf");
  CHECK(replaced.characters() == std::u32string{'z', R});
  CHECK(ids_of(replaced.encode("\xed\xa0\x80z\xc1\xbf")) == std::vector<std::int32_t>{1, 1, 1, 0, 1, 1});
}

TEST_CASE("encoding a character the vocabulary lacks names it and its position; an OOV id is opt-in") {
  const auto vocab = Vocabulary::from_text("abc");
  auto message = error_message([&] { vocab.encode("ab\xc3\xa9z"); });
  CHECK(contains(message, "U+00E9"));
  CHECK(contains(message, "character 2"));
  CHECK(contains(message, "byte offset 2"));
  CHECK(contains(message, "num_oov_indices = 1"));
  message = error_message([&] { vocab.encode("a\xff"); });
  CHECK(contains(message, "U+FFFD"));
  CHECK(contains(message, "invalid UTF-8"));

  // Keras StringLookup's layout: OOV at id 0, the characters from 1.
  const auto with_oov = Vocabulary::from_text("abc", {.num_oov_indices = 1});
  CHECK(with_oov.size() == 4);
  CHECK(with_oov.get_vocabulary() == std::vector<std::string>{"[UNK]", "a", "b", "c"});
  CHECK(ids_of(with_oov.encode("cab\xc3\xa9")) == std::vector<std::int32_t>{3, 1, 2, 0});
  CHECK(with_oov.decode(std::vector<std::int32_t>{3, 0, 1}) == "c[UNK]a");
  const auto custom = Vocabulary::from_text("ab", {.num_oov_indices = 1, .oov_token = "?"});
  CHECK(custom.decode(std::vector<std::int32_t>{0, 2}) == "?b");

  message = error_message([&] { vocab.decode(std::vector<std::int32_t>{0, 1, 3}); });
  CHECK(contains(message, "id 3 at index 2"));
  CHECK(contains(message, "0 to 2"));
  message = error_message([&] { vocab.decode(Tensor::from_vector<std::int64_t>({std::int64_t{1} << 40}, {1})); });
  CHECK(contains(message, "1099511627776"));
  message = error_message([&] { vocab.decode(Tensor::from_vector<float>({1.0f}, {1})); });
  CHECK(contains(message, "int32 or int64"));
  message = error_message([&] { Vocabulary::from_text("a", {.num_oov_indices = 2}); });
  CHECK(contains(message, "num_oov_indices is 2"));
}

TEST_CASE("from_characters keeps the given order and refuses duplicates, surrogates and values past U+10FFFF") {
  const auto vocab = Vocabulary::from_characters(U"zay");
  CHECK(ids_of(vocab.encode("yaz")) == std::vector<std::int32_t>{2, 1, 0});
  auto message = error_message([&] { Vocabulary::from_characters(U"abca"); });
  CHECK(contains(message, "U+0061"));
  CHECK(contains(message, "characters 0 and 3"));
  message = error_message([&] { Vocabulary::from_characters(std::u32string{'a', 0xD800}); });
  CHECK(contains(message, "character 1 is U+D800"));
  message = error_message([&] { Vocabulary::from_characters(std::u32string{0x110000}); });
  CHECK(contains(message, "U+110000"));
  // Every scalar value, astral ones included, encodes and decodes.
  const std::u32string wide{0x10FFFF, 0x1F600, 0x00, 0x7F, 0x80, 0xFFFF};
  const auto all = Vocabulary::from_characters(wide);
  std::string text;
  for (const char32_t c : wide) data::detail::append_utf8(text, c);
  CHECK(ids_of(all.encode(text)) == std::vector<std::int32_t>{0, 1, 2, 3, 4, 5});
  CHECK(all.decode(all.encode(text)) == text);
}

TEST_CASE("the byte-level vocabulary: 256 ids, id = byte value") {
  const Vocabulary vocab;  // the default is byte-level
  CHECK(vocab == Vocabulary::bytes());
  CHECK(vocab.kind() == Vocabulary::Kind::kBytes);
  CHECK(vocab.size() == 256);
  const std::string text("a\x00\xff\xc3\xa9", 5);
  CHECK(ids_of(vocab.encode(text)) == std::vector<std::int32_t>{97, 0, 255, 0xC3, 0xA9});
  CHECK(vocab.decode(vocab.encode(text)) == text);
  CHECK(vocab.get_vocabulary().size() == 256);
  CHECK(vocab.get_vocabulary()[65] == "A");
  CHECK(contains(error_message([&] { vocab.decode(std::vector<std::int32_t>{256}); }), "id 256"));
  CHECK(vocab.encode("").shape() == Shape{0});
}

TEST_CASE("a vocabulary saved next to the model loads back equal, and encodes the same ids") {
  TempDir dir;
  const std::string text = "Tab\there, newline\n, quote \" backslash \\ \x01 caf\xc3\xa9 \xf0\x9f\x98\x80 \xff";
  for (const auto& vocab : {Vocabulary::from_text(text), Vocabulary::from_text(text, {.num_oov_indices = 1}),
                            Vocabulary::from_text(text, {.num_oov_indices = 1, .oov_token = "<unk>"}),
                            Vocabulary::from_characters(U"zyx"), Vocabulary::bytes(), Vocabulary::from_text("")}) {
    const auto path = dir.file("vocabulary.json");
    vocab.save(path);
    const auto loaded = Vocabulary::load(path);
    CHECK(loaded == vocab);
    CHECK(loaded.get_vocabulary() == vocab.get_vocabulary());
    if (vocab.kind() == Vocabulary::Kind::kBytes || vocab.num_oov_indices() == 1) {
      CHECK(ids_of(loaded.encode(text)) == ids_of(vocab.encode(text)));
    }
  }
  // The file is JSON a person can read: one token a line, characters as themselves.
  Vocabulary::from_characters(U"a\xe9").save(dir.file("small.json"));
  const auto saved = testing::read_file_bytes(dir.file("small.json"));
  CHECK(contains(saved, "\"format\": \"tandem.vocabulary\""));
  CHECK(contains(saved, "\"a\",\n"));
  CHECK(contains(saved, "\"\xc3\xa9\""));
  CHECK(dir.entries() == std::vector<std::string>{"small.json", "vocabulary.json"});  // no temporaries left
}

TEST_CASE("loading a vocabulary checks everything and names the file and the field") {
  TempDir dir;
  const auto path = dir.file("vocabulary.json");
  CHECK(contains(error_message<NotFound>([&] { Vocabulary::load(path); }), path));
  const auto load_error = [&](const std::string& content) {
    write_bytes(path, content);
    const auto message = error_message<DataLoss>([&] { Vocabulary::load(path); });
    CHECK(contains(message, path));
    return message;
  };
  const std::string head = R"({"format": "tandem.vocabulary", "version": 1, )";
  CHECK(contains(load_error(""), "invalid JSON"));
  CHECK(contains(load_error("[1, 2]"), "object"));
  CHECK(contains(load_error(std::string(100, '[')), "nested deeper"));
  CHECK(contains(load_error(R"({"format": "tandem.weights", "version": 1, "kind": "bytes"})"), "\"format\""));
  CHECK(contains(load_error(R"({"version": 1, "kind": "bytes"})"), "\"format\" is missing"));
  CHECK(contains(load_error(R"({"format": "tandem.vocabulary", "version": 2, "kind": "bytes"})"), "version 1"));
  CHECK(contains(load_error(R"({"format": "tandem.vocabulary", "version": "1", "kind": "bytes"})"), "integer"));
  CHECK(contains(load_error(head + R"("kind": "words"})"), "\"kind\""));
  CHECK(contains(load_error(head + R"("kind": "bytes", "tokens": []})"), "unexpected field \"tokens\""));
  const std::string chars = head + R"("kind": "characters", "num_oov_indices": 0, "oov_token": "[UNK]", )";
  CHECK(contains(load_error(chars + R"("tokens": ["a", "bc"]})"), "tokens[1]"));
  CHECK(contains(load_error(chars + R"("tokens": ["a", ""]})"), "tokens[1]"));
  CHECK(contains(load_error(chars + R"("tokens": ["a", 7]})"), "tokens[1] is 7"));
  CHECK(contains(load_error(chars + R"("tokens": ["a", "b", "a"]})"), "appears twice"));
  CHECK(contains(load_error(chars + R"("tokens": "abc"})"), "not an array"));
  CHECK(contains(load_error(chars + R"("tokens": ["\ud800"]})"), "invalid JSON"));  // a lone surrogate
  CHECK(contains(load_error(chars + "\"tokens\": [\"\xff\"]}"), "invalid JSON"));   // not UTF-8
  CHECK(contains(load_error(chars + R"("tokens": ["a"], "extra": 1})"), "unexpected field \"extra\""));
  CHECK(contains(load_error(head + R"("kind": "characters", "num_oov_indices": 3, "oov_token": "", "tokens": []})"),
                 "0 or 1"));
  CHECK(contains(load_error(head + R"("kind": "characters", "oov_token": "", "tokens": []})"),
                 "\"num_oov_indices\" is missing"));
  // Escaped characters are characters like any other.
  write_bytes(path, chars + R"("tokens": ["\n", "\u00e9", "\ud83d\ude00"]})");
  CHECK(Vocabulary::load(path).characters() == std::u32string{'\n', 0xE9, 0x1F600});
}

TEST_CASE("text_windows: input [length] and next-token target [length], for stride 1 and stride > 1") {
  // tokens 0..9
  std::vector<std::int32_t> values(10);
  std::iota(values.begin(), values.end(), 0);
  const auto tokens = Tensor::from_vector(values, {10});

  const auto windows = data::text_windows(tokens, {.length = 4});
  CHECK(windows.cardinality() == 6);  // starts 0..5: the target of the last ends at token 9
  const auto spec = windows.element_spec();
  REQUIRE(spec.size() == 2);
  CHECK(spec[0].dtype == DType::kI32);
  CHECK(spec[0].shape == Shape{4});
  CHECK(spec[1].shape == Shape{4});
  std::int32_t start = 0;
  for (auto it = windows.iterate(); auto e = it->next(); ++start) {
    CHECK(ids_of((*e)[0]) == std::vector<std::int32_t>{start, start + 1, start + 2, start + 3});
    CHECK(ids_of((*e)[1]) == std::vector<std::int32_t>{start + 1, start + 2, start + 3, start + 4});
    CHECK((*e)[0].buffer() == tokens.buffer());  // views, not copies
  }
  CHECK(start == 6);

  const auto strided = data::text_windows(tokens, {.length = 3, .stride = 3});
  CHECK(strided.cardinality() == 3);  // starts 0, 3, 6 (9 would need tokens 9..12)
  std::vector<std::vector<std::int32_t>> inputs, targets;
  for (auto it = strided.iterate(); auto e = it->next();) {
    inputs.push_back(ids_of((*e)[0]));
    targets.push_back(ids_of((*e)[1]));
  }
  CHECK(inputs == std::vector<std::vector<std::int32_t>>{{0, 1, 2}, {3, 4, 5}, {6, 7, 8}});
  CHECK(targets == std::vector<std::vector<std::int32_t>>{{1, 2, 3}, {4, 5, 6}, {7, 8, 9}});
  CHECK(data::text_windows(tokens, {.length = 2, .stride = 4}).cardinality() == 2);  // 0, 4 (8 needs a token 10)
  CHECK(data::text_windows(tokens, {.length = 9}).cardinality() == 1);
  CHECK(data::text_windows(tokens, {.length = 1, .stride = 100}).cardinality() == 1);

  // Windows of a view (the validation part of a split) start at the view.
  const auto [train, validation] = data::split_tokens(tokens, 0.5);
  auto it = data::text_windows(validation, {.length = 2}).iterate();
  const auto first = it->next();
  REQUIRE(first);
  CHECK(ids_of((*first)[0]) == std::vector<std::int32_t>{5, 6});
  CHECK(ids_of((*first)[1]) == std::vector<std::int32_t>{6, 7});
}

TEST_CASE("text_windows batches and shuffles like any dataset: every window once per epoch, in batches") {
  std::vector<std::int32_t> values(1000);
  for (std::size_t i = 0; i < values.size(); ++i) values[i] = static_cast<std::int32_t>(i * 7 % 1000);
  const auto tokens = Tensor::from_vector(values, {1000});
  const auto windows = data::text_windows(tokens, {.length = 16, .stride = 2});
  const auto n = windows.cardinality();
  CHECK(n == (1000 - 16 - 1) / 2 + 1);
  const auto pipeline = windows.shuffle(n, 42).batch(32, true);
  CHECK(pipeline.cardinality() == n / 32);
  CHECK(pipeline.element_spec()[0].shape == Shape{32, 16});
  std::multiset<std::int32_t> starts;
  for (auto it = pipeline.iterate(); auto batch = it->next();) {
    const auto& x = (*batch)[0];
    const auto& y = (*batch)[1];
    REQUIRE(x.shape() == Shape{32, 16});
    REQUIRE(y.shape() == Shape{32, 16});
    const auto* px = x.data<std::int32_t>();
    const auto* py = y.data<std::int32_t>();
    for (int row = 0; row < 32; ++row) {
      // Find where the window starts in the token array (7 is invertible mod 1000).
      const auto p = std::find(values.begin(), values.end(), px[row * 16]);
      const auto begin = static_cast<std::int32_t>(p - values.begin());
      CHECK(begin % 2 == 0);
      for (int t = 0; t < 16; ++t) {
        CHECK(px[row * 16 + t] == values[static_cast<std::size_t>(begin + t)]);
        CHECK(py[row * 16 + t] == values[static_cast<std::size_t>(begin + t + 1)]);
      }
      starts.insert(begin);
    }
  }
  CHECK(starts.size() == static_cast<std::size_t>(n / 32 * 32));
  CHECK(std::set<std::int32_t>(starts.begin(), starts.end()).size() == starts.size());  // no window twice
  // The same seed gives the same epochs: what DATA auto-sharding relies on (every worker runs the
  // same pipeline and keeps its rows of each global batch).
  auto a = pipeline.iterate(data::IterateOptions{.epoch = 3});
  auto b = pipeline.iterate(data::IterateOptions{.epoch = 3});
  for (auto ea = a->next(), eb = b->next(); ea || eb; ea = a->next(), eb = b->next()) {
    REQUIRE((ea && eb));
    CHECK(ids_of((*ea)[0]) == ids_of((*eb)[0]));
  }
}

TEST_CASE("text_windows shards: the shards together are every window once") {
  std::vector<std::int32_t> values(50);
  std::iota(values.begin(), values.end(), 0);
  const auto windows = data::text_windows(Tensor::from_vector(values, {50}), {.length = 5, .stride = 3});
  const auto n = windows.cardinality();
  std::vector<std::int32_t> starts;
  for (std::int64_t shard = 0; shard < 3; ++shard) {
    const auto part = windows.shard(3, shard);
    CHECK(part.cardinality() == n / 3 + (shard < n % 3 ? 1 : 0));
    for (auto it = part.batch(4).iterate(); auto batch = it->next();) {
      const auto x = ids_of((*batch)[0]);
      for (std::size_t row = 0; row < x.size() / 5; ++row) {
        CHECK(x[row * 5] % 3 == 0);
        CHECK(x[row * 5] / 3 % 3 == shard);  // window k goes to shard k % 3
        starts.push_back(x[row * 5]);
      }
    }
  }
  std::sort(starts.begin(), starts.end());
  std::vector<std::int32_t> expected;
  for (std::int32_t k = 0; k < n; ++k) expected.push_back(3 * k);
  CHECK(starts == expected);
}

TEST_CASE("text_windows refuses what makes no windows, naming the problem") {
  const auto tokens = Tensor::from_vector<std::int32_t>({1, 2, 3, 4}, {4});
  CHECK(contains(error_message([&] { data::text_windows(tokens, {.length = 4}); }),
                 "4 tokens make no window of length 4"));
  CHECK(contains(error_message([&] { data::text_windows(tokens, {}); }), "length is 0"));
  CHECK(contains(error_message([&] { data::text_windows(tokens, {.length = 2, .stride = 0}); }), "stride is 0"));
  CHECK(contains(error_message([&] {
                   data::text_windows(Tensor::from_vector<std::int64_t>({1, 2, 3}, {3}), {.length = 1});
                 }),
                 "expected int32 of rank 1"));
  CHECK(contains(error_message([&] {
                   data::text_windows(Tensor::from_vector<std::int32_t>({1, 2, 3, 4}, {2, 2}), {.length = 1});
                 }),
                 "expected int32 of rank 1"));
  CHECK(contains(error_message([&] { data::text_windows(Tensor(), {.length = 1}); }), "undefined"));
}

TEST_CASE("split_tokens: the first int(fraction * n) tokens and the rest, as views") {
  // The GPT peer's numbers: 1618757 characters of the Jargon File split 90/10.
  const auto tokens = Tensor::zeros({1618757}, DType::kI32);
  const auto [train, validation] = data::split_tokens(tokens, 0.9);
  CHECK(train.shape() == Shape{1456881});
  CHECK(validation.shape() == Shape{161876});
  CHECK(validation.buffer() == tokens.buffer());
  CHECK(validation.byte_offset() == 1456881 * sizeof(std::int32_t));
  const auto small = Tensor::from_vector<std::int32_t>({0, 1, 2, 3, 4, 5, 6, 7, 8, 9}, {10});
  CHECK(ids_of(data::split_tokens(small, 0.7).second) == std::vector<std::int32_t>{7, 8, 9});
  CHECK(data::split_tokens(small, 1.0).second.shape() == Shape{0});
  CHECK(data::split_tokens(small, 0.0).first.shape() == Shape{0});
  CHECK(contains(error_message([&] { data::split_tokens(small, 1.5); }), "train_fraction is 1.5"));
}
