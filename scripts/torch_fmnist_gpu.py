"""The PyTorch eager peer (bench/peers/torch_fmnist.py) on a CUDA GPU, for scripts/gpu_check.sh.

usage: python3 scripts/torch_fmnist_gpu.py --model mlp|wide|cnn [--precision float32|bf16]
                                           [--epochs 1] [--batch 128] [--data DIR]
Prints the peer's line: model, samples/s (training, data already on the GPU), test accuracy.

The peer is a copy of a shared program that must stay as everybody runs it, so this file does
not change it: it imports the peer's models and data reader and repeats its training loop (same
Adam settings, same batches) with the tensors on the GPU. bf16 runs the forward pass under
torch.autocast, PyTorch's counterpart of Keras' mixed_bfloat16 (variables stay float32).
"""
import argparse, importlib.util, os, time
import numpy as np
import torch, torch.nn.functional as F

PEER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench", "peers", "torch_fmnist.py")


def load_peer():
    spec = importlib.util.spec_from_file_location("torch_fmnist", PEER)
    peer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peer)
    return peer


def main():
    peer = load_peer()
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="mlp", choices=["mlp", "wide", "cnn"])
    p.add_argument("--precision", default="float32", choices=["float32", "bf16"])
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--data", default=peer.D, help="folder with the Fashion-MNIST idx .gz files")
    a = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("torch_fmnist_gpu: torch sees no CUDA device")
    dev = torch.device("cuda")
    torch.manual_seed(0)
    xtr = torch.from_numpy(peer.idx(f"{a.data}/train-images-idx3-ubyte.gz").astype(np.float32) / 255.0).to(dev)
    ytr = torch.from_numpy(peer.idx(f"{a.data}/train-labels-idx1-ubyte.gz")).to(dev)
    xte = torch.from_numpy(peer.idx(f"{a.data}/t10k-images-idx3-ubyte.gz").astype(np.float32) / 255.0).to(dev)
    yte = torch.from_numpy(peer.idx(f"{a.data}/t10k-labels-idx1-ubyte.gz")).to(dev)
    model = peer.build(a.model).to(dev)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-7)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=a.precision == "bf16")
    n = xtr.shape[0]
    torch.cuda.synchronize()
    t0 = time.perf_counter(); seen = 0
    for ep in range(a.epochs):
        perm = torch.randperm(n, device=dev)
        for s in range(0, n - a.batch + 1, a.batch):
            idxs = perm[s: s + a.batch]
            xb, yb = xtr[idxs], ytr[idxs]
            opt.zero_grad(set_to_none=True)
            with autocast:
                logits = model(xb)
            loss = F.cross_entropy(logits.float(), yb)   # the loss in float32, as Keras does
            loss.backward(); opt.step(); seen += a.batch
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    with torch.no_grad(), autocast:
        acc = (model(xte).argmax(1) == yte).float().mean().item()
    print(f"torch {torch.__version__} device={torch.cuda.get_device_name()} model={a.model} "
          f"precision={a.precision} batch={a.batch} samples_per_s={seen/dt:.0f} test_acc={acc:.4f} "
          f"loss={loss.item():.4f}")


if __name__ == "__main__":
    main()
