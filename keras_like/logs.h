// tandem/keras_like/logs.h — metric values by name, in the order they were first set (Keras's
// `logs` dict: loss, accuracy, val_loss, val_accuracy).
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace tandem::keras {

class Logs {
 public:
  void set(std::string_view key, double value);
  std::optional<double> get(std::string_view key) const;
  // Throws NotFound listing the keys present.
  double at(std::string_view key) const;
  bool contains(std::string_view key) const { return get(key).has_value(); }
  void erase(std::string_view key);
  bool empty() const { return items_.empty(); }
  std::size_t size() const { return items_.size(); }
  auto begin() const { return items_.begin(); }
  auto end() const { return items_.end(); }
  // "loss: 0.5000 - accuracy: 0.8200" (Keras's progress-bar formatting).
  std::string to_string() const;

 private:
  std::vector<std::pair<std::string, double>> items_;
};

}  // namespace tandem::keras
