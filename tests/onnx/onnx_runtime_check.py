"""Runs every NAME.onnx in a folder with ONNX Runtime on NAME.input.bin and compares the output
with NAME.expected.bin (tandem's predict) within 1e-5 (absolute, plus 1e-5 relative)."""
import json
import pathlib
import sys

import numpy as np
import onnxruntime as ort

folder = pathlib.Path(sys.argv[1])
failed = False
names = sorted(p.stem for p in folder.glob("*.onnx"))
if not names:
    sys.exit(f"onnx_runtime_check: no models in {folder}")
print(f"onnxruntime {ort.__version__}")
for name in names:
    if not (folder / f"{name}.json").exists():
        print(f"{name}: checked by ONNX's checker only (no input written)")
        continue
    meta = json.loads((folder / f"{name}.json").read_text())
    x = np.fromfile(folder / f"{name}.input.bin", dtype=meta["input_dtype"]).reshape(meta["input_shape"])
    want = np.fromfile(folder / f"{name}.expected.bin", dtype=np.float32).reshape(meta["output_shape"])
    session = ort.InferenceSession(str(folder / f"{name}.onnx"), providers=["CPUExecutionProvider"])
    got = session.run(None, {session.get_inputs()[0].name: x})[0]
    worst = float(np.max(np.abs(got - want) / (1.0 + np.abs(want))))
    ok = got.shape == want.shape and np.allclose(got, want, rtol=1e-5, atol=1e-5)
    print(f"{name}: {'ok' if ok else 'DIFFERS'}: output {list(got.shape)}, largest |ort - predict| / (1 + |predict|)"
          f" = {worst:.2e}")
    failed |= not ok
sys.exit(1 if failed else 0)
