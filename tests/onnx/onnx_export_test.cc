// Model::export_model (Keras 3's model.export(path, format="onnx")): models of every exportable
// layer — an MLP with Dropout, a CNN with BatchNormalization and both poolings, a transformer block
// (Embedding, causal MultiHeadAttention, Add, LayerNormalization, a gelu Dense), a mixed_bfloat16
// MLP — trained a few steps and exported; the files parse, pass ONNX's checker (again, from disk),
// declare a dynamic batch dimension and hold every weight once. An op without an ONNX form, a
// tensor-parallel model, another format and a model not built are refused, naming what.
//
// With TANDEM_ONNX_EXPORT_OUT=DIR each model is also written there with an input batch and its
// predict output (NAME.onnx, NAME.input.bin, NAME.expected.bin, NAME.json with shapes and dtypes):
// onnx_runtime_check.sh then runs the files with ONNX Runtime and compares within 1e-5 (all but
// the bfloat16 model, which ONNX Runtime's CPU kernels cannot run).
#include <doctest/doctest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <set>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <onnx/checker.h>
#include <onnx/onnx_pb.h>

#include "common/error_message.h"
#include "common/temp_dir.h"
#include "tandem/keras_like/distribution.h"
#include "tandem/keras_like/keras.h"
#include "keras/parallel_fit_mlp.h"
#include "tandem/ops/ops.h"

using namespace tandem;
using namespace tandem::keras;
namespace fs = std::filesystem;

namespace {

// Normal floats, or (ids > 0) int32 ids below `ids`.
Tensor random_tensor(const Shape& shape, std::uint32_t seed, std::int64_t ids = 0) {
  std::mt19937 rng(seed);
  const auto n = static_cast<std::size_t>(shape.num_elements());
  if (ids > 0) {
    std::uniform_int_distribution<std::int32_t> pick(0, static_cast<std::int32_t>(ids - 1));
    std::vector<std::int32_t> v(n);
    for (auto& x : v) x = pick(rng);
    return Tensor::from_vector(v, shape);
  }
  std::normal_distribution<float> normal(0.0F, 1.0F);
  std::vector<float> v(n);
  for (auto& x : v) x = normal(rng);
  return Tensor::from_vector(v, shape).to(devices::default_cpu_device());
}

struct Case {
  std::string name;
  Model model;
  Shape input;  // one example's
  DType input_dtype = DType::kF32;
  std::int64_t ids = 0;  // > 0: integer ids below this
};

Model mlp() {
  return Sequential({Input({28, 28}), Flatten(), Dense(64, "relu"), Dropout(0.2), Dense(10, "softmax")}, "mlp");
}

Model cnn() {
  return Sequential({Input({28, 28, 1}), Conv2D(8, {3, 3}, "relu", {.padding = "same"}), MaxPooling2D(),
                     Conv2D(16, {3, 3}, {.strides = {2, 2}}), BatchNormalization(), Activation("relu"),
                     AveragePooling2D({2, 2}, {.padding = "same"}), Flatten(), Dense(10)},
                    "cnn");
}

Model transformer() {
  auto ids = Input({12}, DType::kI32, "ids");
  auto x = Embedding(40, 16)(ids);
  MultiHeadAttention mha(2, 8);
  auto a = mha({x, x}, {.use_causal_mask = true});
  auto h = LayerNormalization()(Add()({x, a[0]}));
  h = Dense(32, "gelu")(h);
  h = Dense(16)(h);
  auto y = Dense(5)(Flatten()(h));
  return Model({ids}, {y}, "transformer");
}

// Trains `c` three steps (so that BatchNormalization's statistics and every weight have moved).
void train(Case& c) {
  std::vector<std::int64_t> dims{64};
  for (const auto d : c.input.dims()) dims.push_back(d);
  const Tensor x = random_tensor(Shape(dims), 1, c.ids);
  const Shape out = c.model.outputs()[0].shape();
  std::vector<std::int32_t> labels(64);
  for (std::size_t i = 0; i < labels.size(); ++i) labels[i] = static_cast<std::int32_t>(i % out[1]);
  c.model.compile("adam", SparseCategoricalCrossentropy{.from_logits = c.name != "mlp"});
  c.model.fit(x, Tensor::from_vector(labels, Shape{64}), {.batch_size = 16, .epochs = 1, .verbose = 0});
}

std::vector<Case> cases() {
  std::vector<Case> out;
  out.push_back({"mlp", mlp(), Shape{28, 28}});
  out.push_back({"cnn", cnn(), Shape{28, 28, 1}});
  out.push_back({"transformer", transformer(), Shape{12}, DType::kI32, 40});
  {
    mixed_precision::set_global_policy("mixed_bfloat16");
    Model m = mlp();
    mixed_precision::set_global_policy("float32");
    out.push_back({"mlp_bfloat16", m, Shape{28, 28}});
  }
  return out;
}

onnx::ModelProto read_model(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  onnx::ModelProto model;
  REQUIRE(model.ParseFromIstream(&in));
  return model;
}

void write_bytes(const std::string& path, const Tensor& t) {
  const Tensor host = t.to(devices::default_cpu_device());
  std::ofstream(path, std::ios::binary)
      .write(static_cast<const char*>(host.raw_data()), static_cast<std::streamsize>(host.nbytes()));
}

std::string shape_json(const Shape& s) {
  std::string out = "[";
  for (int d = 0; d < s.rank(); ++d) out += fmt::format("{}{}", d ? ", " : "", s[d]);
  return out + "]";
}

}  // namespace

TEST_CASE("export_model writes ONNX that ONNX's checker accepts, with a dynamic batch and every weight once") {
  testing::TempDir dir;
  const char* out_env = std::getenv("TANDEM_ONNX_EXPORT_OUT");
  for (auto& c : cases()) {
    CAPTURE(c.name);
    train(c);
    const std::string path = out_env ? fmt::format("{}/{}.onnx", out_env, c.name) : dir.file(c.name + ".onnx");
    c.model.export_model(path);
    CHECK_NOTHROW(onnx::checker::check_model(path));
    const auto proto = read_model(path);
    CHECK(proto.opset_import(0).version() == 17);
    REQUIRE(proto.graph().input_size() == 1);
    REQUIRE(proto.graph().output_size() == 1);
    const auto& input = proto.graph().input(0).type().tensor_type();
    CHECK(input.shape().dim(0).dim_param() == "batch");
    CHECK(input.elem_type() == (c.input_dtype == DType::kI32 ? onnx::TensorProto::INT32 : onnx::TensorProto::FLOAT));
    CHECK(proto.graph().output(0).type().tensor_type().elem_type() == onnx::TensorProto::FLOAT);
    // Every weight the inference graph reads, once, under its Keras path.
    std::set<std::string> initializers;
    for (const auto& t : proto.graph().initializer()) initializers.insert(t.name());
    for (const auto& w : c.model.weights()) {
      if (w->name().find("moving_") != std::string::npos || w->name().find("kernel") != std::string::npos) {
        CHECK_MESSAGE(initializers.count(w->name()) == 1, w->name());
      }
    }
    // Causal attention's half products (BatchMatMul's triangles) as Trilu: on the scores and on
    // the probabilities before they meet V.
    int trilu = 0;
    for (const auto& node : proto.graph().node()) trilu += node.op_type() == "Trilu" ? 1 : 0;
    CHECK(trilu == (c.name == "transformer" ? 2 : 0));
    // ONNX Runtime's CPU kernels take no bfloat16 (Relu, MatMul): that model is checked, not run.
    if (out_env && c.name != "mlp_bfloat16") {
      std::vector<std::int64_t> dims{5};
      for (const auto d : c.input.dims()) dims.push_back(d);
      const Tensor x = random_tensor(Shape(dims), 7, c.ids);
      const Tensor y = c.model.predict(x, {.batch_size = 5});
      write_bytes(fmt::format("{}/{}.input.bin", out_env, c.name), x);
      write_bytes(fmt::format("{}/{}.expected.bin", out_env, c.name), y);
      std::ofstream(fmt::format("{}/{}.json", out_env, c.name))
          << fmt::format(R"({{"input_shape": {}, "input_dtype": "{}", "output_shape": {}}})", shape_json(x.shape()),
                         c.input_dtype == DType::kI32 ? "int32" : "float32", shape_json(y.shape()));
    }
  }
}

namespace {

// A layer whose op has no ONNX form here.
class OnesImpl : public LayerImpl {
 public:
  OnesImpl() : LayerImpl("Ones", "ones") {}
  std::vector<graph::Output> call(CallContext& /*ctx*/, const std::vector<graph::Output>& inputs) override {
    return {ops::ones_like(inputs[0])};
  }
};

}  // namespace

TEST_CASE("export_model refuses what it cannot write, naming it, and writes nothing") {
  testing::TempDir dir;
  const std::string path = dir.file("refused.onnx");
  {
    Model model = Sequential({Input({4}), Dense(3), Layer(std::make_shared<OnesImpl>())}, "odd");
    const auto message = testing::error_message<Unimplemented>([&] { model.export_model(path); });
    CHECK(message.find("OnesLike") != std::string::npos);
    CHECK(message.find("ones") != std::string::npos);  // the layer, in the node's name
    CHECK(message.find("has no ONNX form") != std::string::npos);
  }
  {
    Model model = mlp();
    CHECK(testing::error_message<InvalidArgument>([&] { model.export_model(path, {.format = "tf_saved_model"}); }) ==
          "model \"mlp\": export format \"tf_saved_model\"; tandem exports \"onnx\"");
  }
  {
    Model model = Sequential({Dense(3)}, "unbuilt");
    CHECK(testing::error_message<FailedPrecondition>([&] { model.export_model(path); }).find("not built") !=
          std::string::npos);
  }
  {
    // Tensor-parallel layers would export their collectives: refused, with the way out.
    namespace kd = tandem::keras::distribution;
    using namespace tandem::testing::parallel_fit;
    kd::ModelParallel mp(pair_layouts(kd::DeviceMesh({1, 2}, {"batch", "model"}, {"CPU:0", "CPU:1"})));
    Model model = model_under(mp);
    {
      auto scope = mp.scope();
      model.compile("adam", "mse");
    }
    const auto message = testing::error_message<Unimplemented>([&] { model.export_model(path); });
    CHECK(message.find("Dense \"fc1\" runs tensor-parallel") != std::string::npos);
    CHECK(message.find("OneDeviceStrategy") != std::string::npos);
  }
  CHECK(!fs::exists(path));
}
