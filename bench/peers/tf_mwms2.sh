#!/bin/bash
# Two-process tf.distribute.MultiWorkerMirroredStrategy on 127.0.0.1 (TF_CONFIG set for each
# worker): the Keras 3 peer of tandem's MultiWorkerMirroredStrategy and of torch_ddp2.sh. Each
# worker has 1 intra-op thread (as the DDP peer and tandem's workers); global batch --batch.
# usage: tf_mwms2.sh MODEL [PORT] [more tf_fmnist.py flags, e.g. --epochs 1 --warmup-steps 20 --seed 0]
m=${1:-mlp}; port=${2:-23456}; here=$(dirname "$0"); shift 2 2>/dev/null || shift $#
py=${PYTHON:-$HOME/peers-venv/bin/python}
cluster="{\"cluster\": {\"worker\": [\"127.0.0.1:$port\", \"127.0.0.1:$((port + 1))\"]}"
TF_CONFIG="$cluster, \"task\": {\"type\": \"worker\", \"index\": 1}}" \
  "$py" "$here/tf_fmnist.py" --model "$m" --strategy multiworker --threads 1 "$@" >/dev/null 2>&1 &
TF_CONFIG="$cluster, \"task\": {\"type\": \"worker\", \"index\": 0}}" \
  "$py" "$here/tf_fmnist.py" --model "$m" --strategy multiworker --threads 1 "$@"
rc=$?
wait
exit $rc
