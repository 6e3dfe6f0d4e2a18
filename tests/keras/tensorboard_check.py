"""Reads a run written by tensorboard_fit_writer with the real tensorboard package and compares it
with fit's History: every epoch's scalar equals History's value (as float32), histograms and the
graph are there, and every record's framing checks out with tensorboard's own masked CRC-32C.

Usage: tensorboard_check.py <log_dir> <history.json>; exit status 0 when everything matches.
"""
import glob
import json
import os
import struct
import sys

from tensorboard.backend.event_processing import event_accumulator
from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c


def f32(value):
    return struct.unpack("<f", struct.pack("<f", value))[0]


def check_framing(path):
    """Counts the records of a file, checking both CRCs of each with tensorboard's masked_crc32c."""
    data = open(path, "rb").read()
    at, records = 0, 0
    while at < len(data):
        header = data[at:at + 8]
        (length,) = struct.unpack("<Q", header)
        (header_crc,) = struct.unpack("<I", data[at + 8:at + 12])
        body = data[at + 12:at + 12 + length]
        (body_crc,) = struct.unpack("<I", data[at + 12 + length:at + 16 + length])
        assert header_crc == masked_crc32c(header), f"{path}: record {records}: bad length CRC"
        assert body_crc == masked_crc32c(body), f"{path}: record {records}: bad data CRC"
        at += 16 + length
        records += 1
    assert at == len(data), f"{path}: {len(data) - at} trailing bytes"
    return records


def load(log_dir, run):
    files = glob.glob(os.path.join(log_dir, run, "events.out.tfevents.*.v2"))
    assert len(files) == 1, f"{run}: expected one event file, found {files}"
    print(f"{run}: {os.path.basename(files[0])}: {check_framing(files[0])} records, CRCs verified")
    accumulator = event_accumulator.EventAccumulator(
        os.path.join(log_dir, run), size_guidance={event_accumulator.SCALARS: 0, event_accumulator.HISTOGRAMS: 0})
    accumulator.Reload()
    return accumulator


def main(log_dir, history_path):
    history = json.load(open(history_path))
    runs = {"train": load(log_dir, "train"), "validation": load(log_dir, "validation")}
    for run, accumulator in runs.items():
        tags = accumulator.Tags()
        print(f"{run}: scalars {sorted(tags['scalars'])}; histograms {sorted(tags['histograms'])}; "
              f"graph {tags['graph']}")
    failures = []
    compared = 0
    for name, values in sorted(history.items()):
        run, tag = ("validation", "epoch_" + name[4:]) if name.startswith("val_") else ("train", "epoch_" + name)
        events = runs[run].Scalars(tag)
        got = [(e.step, e.value) for e in events]
        expected = [(epoch, f32(v)) for epoch, v in enumerate(values)]
        print(f"{run}/{tag}: {[v for _, v in got]}  History {name}: {values}")
        if got != expected:
            failures.append(f"{run}/{tag}: read {got}, History gives {expected}")
        compared += len(values)
    learning_rate = [e.value for e in runs["train"].Scalars("epoch_learning_rate")]
    if learning_rate != [f32(0.05)] * 3:
        failures.append(f"train/epoch_learning_rate: {learning_rate}")
    histograms = runs["train"].Histograms("hidden/kernel/histogram")
    if [h.step for h in histograms] != [0, 1, 2] or histograms[-1].histogram_value.num != 12:
        failures.append(f"train/hidden/kernel/histogram: {histograms}")
    graph = runs["train"].Graph()
    nodes = [(n.name, n.op, list(n.input)) for n in graph.node]
    print(f"graph: {nodes}")
    if [n[0] for n in nodes][1:] != ["hidden", "out"] or nodes[2][2] != ["hidden"]:
        failures.append(f"graph: {nodes}")
    if failures:
        print("MISMATCH:\n  " + "\n  ".join(failures))
        return 1
    print(f"ok: {compared} epoch scalars equal History's values; histograms and graph read by tensorboard")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
