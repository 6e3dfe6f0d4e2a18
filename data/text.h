// tandem/data/text.h — text files into token ids, and datasets of next-token windows for
// language models (the character-level GPT sample):
//
//   const std::string text = data::read_text_file("/usr/share/doc/jargon-text/jargon.txt.gz");
//   const auto vocab = data::Vocabulary::from_text(text);    // the sorted characters of the text
//   vocab.save("gpt/vocabulary.json");                       // next to the model's weights
//   const auto [train, validation] = data::split_tokens(vocab.encode(text), 0.9);
//   auto batches = data::text_windows(train, {.length = 128}).shuffle(train_windows).batch(32);
//
// Called by programs on any thread. read_text_file, Vocabulary::save and Vocabulary::load block on
// the file system; nothing else blocks. Errors are tandem's typed errors naming the file, the
// character or the id involved (each function says which).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "tandem/data/dataset.h"
#include "tandem/graph/tensor.h"

namespace tandem::data {

// Debian's jargon-text package: the Jargon File, 1.7 MB of English (the GPT sample's data).
inline constexpr const char* kDebianJargonFile = "/usr/share/doc/jargon-text/jargon.txt.gz";

// The bytes of a text file, plain or gzip-compressed (decided by the gzip magic bytes 1f 8b at its
// start, not by its name), decompressed. NotFound for a missing file; DataLoss naming the file for
// a corrupt gzip stream (bad header, bad data, wrong checksum) or one cut short.
std::string read_text_file(const std::string& path);

struct VocabularyOptions {
  // Keras StringLookup's num_oov_indices, 0 or 1. 0 (here the default, unlike StringLookup's 1):
  // encoding a character the vocabulary lacks raises InvalidArgument naming it and its position,
  // which is what a vocabulary built from the very text it encodes wants (ids then equal the
  // positions in the sorted characters, as in a Python sorted(set(text)) vocabulary). 1: such
  // characters encode as id 0, the vocabulary's characters start at id 1, and id 0 decodes to
  // oov_token (StringLookup's layout).
  int num_oov_indices = 0;
  std::string oov_token = "[UNK]";
};

// Token ids of text: byte-level (id = byte value, 256 ids), or characters (Unicode code points)
// with ids in the order given. A value type: cheap to copy, safe to share between threads.
class Vocabulary {
 public:
  enum class Kind { kBytes, kCharacters };

  // The byte-level vocabulary.
  Vocabulary();
  static Vocabulary bytes();
  // The sorted set of the characters of text, decoded from UTF-8 with every invalid sequence
  // replaced by U+FFFD exactly as Python's bytes.decode("utf-8", errors="replace") does
  // (data/detail/utf8.h), so ids match those of Python's sorted(set(text)).
  static Vocabulary from_text(std::string_view text, VocabularyOptions options = {});
  // The given characters, in this order (Keras's StringLookup(vocabulary=...)). InvalidArgument
  // for a duplicate, a surrogate or a value past U+10FFFF, naming it and its index; or for
  // options other than num_oov_indices 0 or 1.
  static Vocabulary from_characters(std::u32string characters, VocabularyOptions options = {});

  Kind kind() const { return kind_; }
  // Every id, the OOV id included (Keras's vocabulary_size()).
  std::int64_t size() const;
  int num_oov_indices() const { return options_.num_oov_indices; }
  // The characters in id order after the OOV id (empty for bytes).
  const std::u32string& characters() const { return characters_; }
  // Every token as UTF-8 text in id order (Keras's get_vocabulary()): the OOV token first when
  // there is one; for bytes, one byte each (bytes from 0x80 up are not UTF-8 on their own).
  std::vector<std::string> get_vocabulary() const;

  // int32 [n]: one id per character (per byte for bytes). InvalidArgument for a character the
  // vocabulary lacks (without an OOV id), naming it (U+XXXX), its character index and byte offset.
  Tensor encode(std::string_view text) const;
  // The text of ids (int32 or int64, any shape, read in order): UTF-8 for characters, the bytes
  // themselves for bytes. InvalidArgument for an id outside [0, size()), naming it and its index.
  std::string decode(std::span<const std::int32_t> ids) const;
  std::string decode(const Tensor& ids) const;

  // Writes a small JSON file ({"format": "tandem.vocabulary", "version": 1, "kind", ...,
  // "tokens": [one string per character]}) atomically; Unavailable naming the file when it
  // cannot be written.
  void save(const std::string& path) const;
  // Reads what save wrote, checking everything: NotFound for a missing file; DataLoss naming the
  // file and the field for anything else wrong (not JSON, another format or version, a token that
  // is not one character, a duplicate, a field missing or extra, a file over 64 MiB).
  static Vocabulary load(const std::string& path);

  friend bool operator==(const Vocabulary& a, const Vocabulary& b) {
    return a.kind_ == b.kind_ && a.characters_ == b.characters_ &&
           a.options_.num_oov_indices == b.options_.num_oov_indices && a.options_.oov_token == b.options_.oov_token;
  }

 private:
  std::int32_t id_of(char32_t c) const;  // -1 when absent

  Kind kind_ = Kind::kBytes;
  VocabularyOptions options_;
  std::u32string characters_;
  std::vector<std::int32_t> ascii_ids_;                    // [128], -1 when absent
  std::vector<std::pair<char32_t, std::int32_t>> sorted_;  // (character, id) by character
};

// Windows over a token array for next-token prediction.
struct WindowOptions {
  std::int64_t length = 0;  // tokens per input (and per target); at least 1
  std::int64_t stride = 1;  // tokens between the starts of consecutive windows; at least 1
};

// A dataset of (input int32 [length], target int32 [length]) pairs: window k holds tokens
// [k * stride, k * stride + length) as input and the next token of each position,
// [k * stride + 1, k * stride + length + 1), as target; every window whose target fits,
// (n - length - 1) / stride + 1 of them for n tokens. tokens: a host int32 [n] tensor, which the
// dataset shares (no copy). The windows are views into it, made as they are read: shuffle, take,
// skip, shard and repeat move window numbers, and batch copies each window straight from the
// tokens, so .shuffle(cardinality) of 1.5 million windows costs 8 bytes per window. Sharded by
// MultiWorkerMirroredStrategy like any dataset that reads no files (DATA auto-sharding).
// InvalidArgument naming the problem for another dtype or rank, a length or stride below 1, or
// fewer than length + 1 tokens.
Dataset text_windows(const Tensor& tokens, const WindowOptions& options);

// tokens[:n] and tokens[n:] with n = int(train_fraction * len(tokens)) as Python computes it (the
// GPT peer's 90/10 split); views, no copy. tokens: a host tensor of rank >= 1, split along its
// first dimension. InvalidArgument for a fraction outside [0, 1].
std::pair<Tensor, Tensor> split_tokens(const Tensor& tokens, double train_fraction);

}  // namespace tandem::data
