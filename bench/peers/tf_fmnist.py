"""Keras 3 / TensorFlow peer for side-by-side runs: Fashion-MNIST training throughput and accuracy on CPU.

usage: python tf_fmnist.py --model mlp|wide|cnn [--epochs 2] [--batch 128] [--strategy one|mirrored|multiworker]
                           [--jit-compile] [--steps-per-execution N]
                           [--threads N] [--cpu-devices 2] [--seed 0] [--validation] [--limit N] [--input tfdata|numpy]
       python tf_fmnist.py --model wide --seed 0 --lockstep DIR [--init-from FILE] [--losses NAME] [--adam-step-float64]

The same models, data and optimiser as torch_fmnist.py and tandem's bench_fit / samples:
  mlp  = Flatten, Dense 128 relu, Dense 10 (the Keras 'basic classification' tutorial model)
  wide = Flatten, Dense 1024 relu, Dense 1024 relu, Dense 10
  cnn  = Reshape 28x28x1, Conv 32 3x3 relu, MaxPool 2, Conv 64 3x3 relu, MaxPool 2, Flatten, Dense 128 relu, Dense 10
compile(optimizer="adam", loss=SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"]) (Adam lr 1e-3, eps 1e-7: Keras defaults).

Strategies:
  one         the default strategy (one CPU device; TF's own intra/inter-op pools, 2 threads each on 2 cores)
  mirrored    tf.distribute.MirroredStrategy over --cpu-devices logical CPU devices (/cpu:0, /cpu:1, ...),
              made with tf.config.set_logical_device_configuration; global batch --batch
  multiworker tf.distribute.MultiWorkerMirroredStrategy; TF_CONFIG must be set (see tf_mwms2.sh); global batch
              --batch, split over the workers

Timing: each epoch is timed by a callback (on_epoch_begin .. on_epoch_end). Epoch 1 contains tf.function tracing
and graph optimisation, so with --epochs >= 2 'samples_per_s' is over the epochs after the first, and
'first_epoch_samples_per_s' is reported beside it. With --warmup-steps N an untimed fit() of N batches runs first
(the train function is traced there and reused by the timed fit()), and 'samples_per_s' is over all timed epochs; the
weights and optimizer variables it changed are then restored, so the timed fit() trains from the initial weights whatever
N is. Training samples per epoch: the full batches
(drop_remainder, as tandem's bench_fit and torch_fmnist.py; with --validation the remainder is kept, as Keras does).
--validation evaluates on the test set after every epoch (what tandem's samples do) and prints val_acc per epoch.
Prints one line (on worker 0 only) with key=value fields.
"""
import argparse, gzip, json, os, struct, sys, time

import numpy as np

from safetensors_io import read_safetensors, write_safetensors

D = "/usr/share/datasets/fashion-mnist"


def idx(path):
    with gzip.open(path, "rb") as f:
        data = f.read()
    magic, n = struct.unpack(">II", data[:8])
    if magic == 2051:
        r, c = struct.unpack(">II", data[8:16])
        return np.frombuffer(data, np.uint8, offset=16).reshape(n, r, c)
    return np.frombuffer(data, np.uint8, offset=8).astype(np.int64)


def build(keras, kind):
    L = keras.layers
    if kind == "mlp":
        return keras.Sequential([keras.Input((28, 28)), L.Flatten(), L.Dense(128, activation="relu"), L.Dense(10)])
    if kind == "wide":
        return keras.Sequential([keras.Input((28, 28)), L.Flatten(), L.Dense(1024, activation="relu"),
                                 L.Dense(1024, activation="relu"), L.Dense(10)])
    if kind == "cnn":
        return keras.Sequential([keras.Input((28, 28)), L.Reshape((28, 28, 1)), L.Conv2D(32, 3, activation="relu"),
                                 L.MaxPooling2D(), L.Conv2D(64, 3, activation="relu"), L.MaxPooling2D(), L.Flatten(),
                                 L.Dense(128, activation="relu"), L.Dense(10)])
    raise SystemExit(f"unknown model {kind!r} (mlp, wide, cnn)")


def patch_keras3_for_multiworker(tf):
    """Keras 3's fit() fails under MultiWorkerMirroredStrategy (keras-team/keras#20585, tensorflow/tensorflow#72388):
    before training, TensorFlowTrainer._maybe_symbolic_build takes one distributed batch and calls
    strategy.reduce("MEAN", batch) on the (x, y) tuple only to learn shapes; CollectiveAllReduceStrategy cannot
    reduce a nested structure ("Attempt to convert a value (PerReplica...) to a Tensor"). The replacement below
    takes the local replica's batch instead: the same shapes, no collective; training itself is untouched."""
    from keras.src.backend.tensorflow import trainer as tf_trainer

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        if self._distribute_strategy is None:
            return
        if iterator is not None:
            for _, _, it in iterator:
                batch = next(it)
                data_batch = tf.nest.map_structure(
                    lambda v: self.distribute_strategy.experimental_local_results(v)[0]
                    if isinstance(v, tf.distribute.DistributedValues) else v, batch)
                break
        with self.distribute_strategy.scope():
            self._symbolic_build(data_batch=data_batch)

    tf_trainer.TensorFlowTrainer._maybe_symbolic_build = _maybe_symbolic_build

    # Second failure: reduce_per_replica() reduces the step's scalar logs (loss, metrics) with
    # strategy.reduce("MEAN", v, axis=0) under multi-worker collectives, which fails on 0-d values
    # ("Invalid reduction dimension 0 for input with 0 dimensions"). Scalars are reduced with axis=None.
    original_reduce = tf_trainer.reduce_per_replica

    def reduce_per_replica(values, strategy, reduction):
        if reduction in ("auto", "mean") and tf_trainer._collective_all_reduce_multi_worker(strategy):
            def _reduce(v):
                rank = v.values[0].shape.rank if isinstance(v, tf.distribute.DistributedValues) else v.shape.rank
                return strategy.reduce("MEAN", v, axis=None if rank == 0 else 0)
            return tf.nest.map_structure(_reduce, values)
        return original_reduce(values, strategy, reduction)

    tf_trainer.reduce_per_replica = reduce_per_replica


def adam_step_in_float64(tf, keras):
    """--adam-step-float64: Keras 3's Adam.update_step (keras/src/optimizers/adam.py, amsgrad left out) with
    alpha = lr * sqrt(1 - beta_2^t) / (1 - beta_1^t) computed in float64. Keras computes it in the variable's
    dtype: in float32, 1 - 0.999^1 is 0.00099998713, so step 1 is 6.4e-6 smaller than the formula's, and later
    steps by about as much. A diagnostic, the reference of bench_fit --lockstep: Keras then computes what tandem does."""
    from keras.src import ops
    from keras.src.optimizers import adam

    def update_step(self, gradient, variable, learning_rate):
        t = tf.cast(self.iterations + 1, tf.float64)
        alpha = tf.cast(learning_rate, tf.float64) * tf.sqrt(1 - tf.pow(tf.constant(self.beta_2, tf.float64), t)) / (
            1 - tf.pow(tf.constant(self.beta_1, tf.float64), t))
        alpha = ops.cast(alpha, variable.dtype)
        gradient = ops.cast(gradient, variable.dtype)
        m = self._momentums[self._get_variable_index(variable)]
        v = self._velocities[self._get_variable_index(variable)]
        self.assign_add(m, ops.multiply(ops.subtract(gradient, m), 1 - self.beta_1))
        self.assign_add(v, ops.multiply(ops.subtract(ops.square(gradient), v), 1 - self.beta_2))
        self.assign_sub(variable, ops.divide(ops.multiply(m, alpha), ops.add(ops.sqrt(v), self.epsilon)))

    adam.Adam.update_step = update_step


def lockstep(a, tf, keras, model, xtr, ytr, xte, yte):
    """--lockstep: one epoch in a recorded order from recorded weights, each step's loss written, so that
    tandem can train the same steps (bench_fit --lockstep) and the two be compared step by step. The
    weights are named "<layer>/<weight>" ("dense_1/kernel"), as tandem's save_weights names them."""
    named = [(f"{layer.name}/{w.name}", w) for layer in model.layers for w in layer.weights]
    if a.init_from:
        # By structure, as tandem's load_weights matches: the layers' names may differ in their numbers
        # ("dense_3" in a program that built another model first), not in their kinds or order.
        start = read_safetensors(a.init_from)
        def kind_and_number(name):
            layer, weight = name.split("/")
            kind, _, number = layer.rpartition("_")
            return (kind, weight, int(number)) if number.isdigit() and kind else (layer, weight, 0)
        def in_order(names):
            return sorted(names, key=kind_and_number)
        theirs = dict(zip(in_order(n for n, _ in named), in_order(start)))
        for name, w in named:
            w.assign(start[theirs[name]])
    else:
        write_safetensors(os.path.join(a.lockstep, "keras_init.safetensors"), [(n, w.numpy()) for n, w in named])
    n = xtr.shape[0]
    order = np.random.RandomState(a.seed).permutation(n).astype(np.int64)
    order.tofile(os.path.join(a.lockstep, "order.i64"))
    losses = []
    for step in range(n // a.batch):
        rows = order[step * a.batch:(step + 1) * a.batch]
        model.reset_metrics()  # the step's own loss, not the running mean
        losses.append(float(model.train_on_batch(xtr[rows], ytr[rows], return_dict=True)["loss"]))
    np.savetxt(os.path.join(a.lockstep, a.losses), losses, fmt="%.9g")
    res = model.evaluate(xte, yte, batch_size=1000, verbose=0, return_dict=True)
    print(f"tf {tf.__version__} keras {keras.__version__} lockstep model={a.model} seed={a.seed} "
          f"init_from={a.init_from or '-'} samples_per_s=0 test_acc={float(res['accuracy']):.4f}", flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="mlp")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--strategy", default="one", choices=["one", "mirrored", "multiworker"])
    p.add_argument("--threads", type=int, default=0, help="intra-op threads (0: TF's default)")
    p.add_argument("--inter-threads", type=int, default=0, help="inter-op threads (0: TF's default)")
    p.add_argument("--cpu-devices", type=int, default=2, help="logical CPU devices for --strategy mirrored")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--validation", action="store_true", help="evaluate on the test set after every epoch")
    p.add_argument("--limit", type=int, default=0, help="train on the first N samples only (smoke tests)")
    p.add_argument("--input", default="tfdata", choices=["tfdata", "numpy"],
                   help="tf.data pipeline (shuffle, batch, prefetch) or numpy arrays handed to fit()")
    p.add_argument("--verbose", type=int, default=0)
    p.add_argument("--warmup-steps", type=int, default=0,
                   help="before the timed fit(), fit one untimed epoch of this many batches (tracing, graph "
                        "optimisation, optimizer slots); every timed epoch is then steady state")
    p.add_argument("--jit-compile", action="store_true", help="compile(jit_compile=True): XLA")
    p.add_argument("--steps-per-execution", type=int, default=1, help="compile(steps_per_execution=N)")
    p.add_argument("--keras", default="3", choices=["3", "2"],
                   help="3: Keras 3 (TF 2.21's default); 2: tf_keras 2.21 via TF_USE_LEGACY_KERAS=1")
    p.add_argument("--lockstep", metavar="DIR",
                   help="instead of timing, one epoch that tandem can repeat step for step (bench_fit --lockstep): "
                        "writes DIR/keras_init.safetensors (the initial weights) and DIR/order.i64 (the training "
                        "order), trains with train_on_batch in that order and writes each step's loss to DIR/LOSSES")
    p.add_argument("--init-from", metavar="FILE", help="with --lockstep: start from these weights (tandem's)")
    p.add_argument("--losses", default="keras_losses.txt", help="with --lockstep: the file name of the losses")
    p.add_argument("--adam-step-float64", action="store_true",
                   help="Adam's step size lr * sqrt(1 - beta_2^t) / (1 - beta_1^t) computed in float64 and then rounded "
                        "(as tandem computes it), not in float32 (Keras 3 on TensorFlow); Keras 3 only")
    a = p.parse_args()

    if a.keras == "2":
        os.environ["TF_USE_LEGACY_KERAS"] = "1"
    import tensorflow as tf
    if a.threads:
        tf.config.threading.set_intra_op_parallelism_threads(a.threads)
    if a.inter_threads:
        tf.config.threading.set_inter_op_parallelism_threads(a.inter_threads)
    rank, workers = 0, 1
    if a.strategy == "mirrored":
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * a.cpu_devices)
        strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(a.cpu_devices)])
    elif a.strategy == "multiworker":
        tf_config = json.loads(os.environ["TF_CONFIG"])
        rank, workers = tf_config["task"]["index"], len(tf_config["cluster"]["worker"])
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
    else:
        strategy = tf.distribute.get_strategy()
    if a.keras == "2":
        import tf_keras as keras
    else:
        import keras
        if os.environ.get("TF_FMNIST_DEBUG"):
            keras.config.disable_traceback_filtering()
        if a.strategy == "multiworker":
            patch_keras3_for_multiworker(tf)
        if a.adam_step_float64:
            adam_step_in_float64(tf, keras)
    keras.utils.set_random_seed(a.seed)

    xtr = idx(f"{D}/train-images-idx3-ubyte.gz").astype(np.float32) / 255.0
    ytr = idx(f"{D}/train-labels-idx1-ubyte.gz")
    xte = idx(f"{D}/t10k-images-idx3-ubyte.gz").astype(np.float32) / 255.0
    yte = idx(f"{D}/t10k-labels-idx1-ubyte.gz")
    if a.limit:
        xtr, ytr = xtr[:a.limit], ytr[:a.limit]
    n = xtr.shape[0]

    with strategy.scope():
        model = build(keras, a.model)
        model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"], jit_compile=a.jit_compile, steps_per_execution=a.steps_per_execution)  # keywords: in Keras 3 the third positional is loss_weights

    if a.lockstep:
        return lockstep(a, tf, keras, model, xtr, ytr, xte, yte)
    drop = not a.validation
    per_epoch = (n // a.batch) * a.batch if drop else n
    if a.input == "tfdata":
        train = (tf.data.Dataset.from_tensor_slices((xtr, ytr)).shuffle(n, seed=a.seed, reshuffle_each_iteration=True)
                 .batch(a.batch, drop_remainder=drop).prefetch(tf.data.AUTOTUNE))
        test = tf.data.Dataset.from_tensor_slices((xte, yte)).batch(1000)
        if a.strategy == "multiworker":
            opts = tf.data.Options()
            opts.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
            train, test = train.with_options(opts), test.with_options(opts)
        fit_args = dict(x=train)
        val = test
    else:
        if drop:
            xtr, ytr = xtr[:per_epoch], ytr[:per_epoch]
        fit_args = dict(x=xtr, y=ytr, batch_size=a.batch, shuffle=True)
        val = (xte, yte)

    class EpochTimer(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.times, self.val_acc, self.acc = [], [], []

        def on_epoch_begin(self, epoch, logs=None):
            self.t0 = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            self.times.append(time.perf_counter() - self.t0)
            logs = logs or {}
            self.acc.append(float(logs.get("accuracy", float("nan"))))
            if "val_accuracy" in logs:
                self.val_acc.append(float(logs["val_accuracy"]))

    if a.warmup_steps:
        # The warm-up fit trains, so the weights and the optimizer's variables (Adam's slots and
        # step count) it changes are put back afterwards: the timed fit() then trains from the
        # initial weights, and as many steps, as the other programs of the comparison.
        with strategy.scope():
            model.optimizer.build(model.trainable_variables)
        start = [(v, v.numpy()) for v in model.weights + model.optimizer.variables]
        wn = a.warmup_steps * a.batch
        if a.input == "tfdata":
            warm = tf.data.Dataset.from_tensor_slices((xtr[:wn], ytr[:wn])).batch(a.batch, drop_remainder=True)
            if a.strategy == "multiworker":
                warm = warm.with_options(opts)
            model.fit(warm, epochs=1, verbose=0, shuffle=False)
        else:
            model.fit(xtr[:wn], ytr[:wn], batch_size=a.batch, epochs=1, verbose=0)
        for v, value in start:
            v.assign(value)

    timer = EpochTimer()
    t0 = time.perf_counter()
    if a.input == "tfdata":
        fit_args["shuffle"] = False  # the dataset shuffles itself (and Keras would warn)
    if a.validation and a.input == "numpy":
        fit_args["validation_batch_size"] = 1000  # as the test set is batched on every other path (and in tandem)
    hist = model.fit(**fit_args, epochs=a.epochs, verbose=a.verbose, callbacks=[timer],
                     validation_data=val if a.validation else None)
    total = time.perf_counter() - t0
    if a.input == "tfdata":
        res = model.evaluate(test, verbose=0, return_dict=True)
    else:
        res = model.evaluate(xte, yte, batch_size=1000, verbose=0, return_dict=True)
    acc = float(res["accuracy"])
    first = per_epoch / timer.times[0]
    if a.warmup_steps:  # every timed epoch is steady state
        steady = per_epoch * len(timer.times) / sum(timer.times)
    else:  # leave out epoch 1 (tracing) when there are more
        steady = per_epoch * (len(timer.times) - 1) / sum(timer.times[1:]) if len(timer.times) > 1 else first
    if rank == 0:
        print(f"tf {tf.__version__} keras {keras.__version__} onednn={os.environ.get('TF_ENABLE_ONEDNN_OPTS', 'default')} model={a.model} strategy={a.strategy} "
              f"replicas={strategy.num_replicas_in_sync} workers={workers} batch={a.batch} epochs={a.epochs} "
              f"threads={a.threads or 'default'} input={a.input} warmup_steps={a.warmup_steps} jit_compile={a.jit_compile} "
              f"steps_per_execution={a.steps_per_execution} samples_per_s={steady:.0f} "
              f"first_epoch_samples_per_s={first:.0f} test_acc={acc:.4f} loss={float(res['loss']):.4f} "
              f"epoch_s={','.join(f'{t:.3f}' for t in timer.times)} "
              f"val_acc={','.join(f'{v:.4f}' for v in timer.val_acc) or '-'} fit_s={total:.2f}", flush=True)


if __name__ == "__main__":
    main()
