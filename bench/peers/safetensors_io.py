"""Safetensors files by hand, for the peer scripts (their virtual environments need no safetensors
package): float32 tensors only, the files tandem's Model::save_weights writes and load_weights reads."""
import json, struct

import numpy as np


def write_safetensors(path, tensors):
    """(name, array) pairs as safetensors, each stored as little-endian float32 in its array's shape."""
    header, blobs, offset = {}, [], 0
    for name, value in tensors:
        data = np.ascontiguousarray(value, "<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(np.shape(value)), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def read_safetensors(path):
    """{name: float32 array in its stored shape}; a tensor of another dtype is an error naming it."""
    with open(path, "rb") as f:
        size = struct.unpack("<Q", f.read(8))[0]
        header, data = json.loads(f.read(size)), f.read()
    tensors = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        assert t["dtype"] == "F32", (path, name, t["dtype"])
        begin, end = t["data_offsets"]
        tensors[name] = np.frombuffer(data[begin:end], "<f4").reshape(t["shape"])
    return tensors
