#!/usr/bin/env python3
"""Data-parallel training of a small neural network on two machines.

Each machine holds half of the data. Every step each one computes the gradient of a minibatch of
its half; the two send each other their gradients over TCP and both apply the average, so they
hold the same model at every step. Fixed seeds and single-threaded BLAS make a rerun print the
same losses, bit for bit. Nothing here knows about VMs or checkpoints.

    python3 train.py --rank 0 --peer 10.78.0.3    # on the first machine
    python3 train.py --rank 1 --peer 10.78.0.2    # on the second

Rank 0 writes one line per step, `step loss` (the loss as Python's repr: exact), to --out.
"""

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # one thread: the same sums in the same order

import argparse
import socket
import sys
import time

import numpy as np

KEYS = ("w1", "b1", "w2", "b2")


def make_data(n=8192, dim=64, seed=0):
    """A noisy nonlinear function of a hidden direction: something an MLP has to learn."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, dim))
    w = rng.standard_normal((dim, 1)) / np.sqrt(dim)
    y = np.sin(3 * x @ w) + 0.1 * rng.standard_normal((n, 1))
    return x, y


def init_model(dim, hidden, seed=1):
    rng = np.random.default_rng(seed)
    return {"w1": rng.standard_normal((dim, hidden)) * np.sqrt(2 / dim), "b1": np.zeros(hidden),
            "w2": rng.standard_normal((hidden, 1)) / np.sqrt(hidden), "b2": np.zeros(1)}


def loss_and_grads(model, x, y):
    a = np.tanh(x @ model["w1"] + model["b1"])
    err = a @ model["w2"] + model["b2"] - y
    dout = 2 * err / len(x)
    da = dout @ model["w2"].T * (1 - a * a)
    grads = {"w1": x.T @ da, "b1": da.sum(0), "w2": a.T @ dout, "b2": dout.sum(0)}
    return float(np.mean(err * err)), grads


def connect(rank, peer, port, timeout=600):
    """Rank 0 listens, rank 1 dials (again and again until rank 0 is up)."""
    if rank == 0:
        server = socket.create_server(("0.0.0.0", port))
        conn, _ = server.accept()
        server.close()
    else:
        deadline = time.monotonic() + timeout
        while True:
            try:
                conn = socket.create_connection((peer, port), timeout=10)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(1)
        conn.settimeout(None)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return conn


def recv_exactly(conn, size):
    buf = bytearray(size)
    view, got = memoryview(buf), 0
    while got < size:
        n = conn.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("the peer closed the connection")
        got += n
    return bytes(buf)


def all_reduce(conn, rank, vector):
    """The mean of both ranks' vectors, summed in rank order so both get the same bits."""
    conn.sendall(vector.tobytes())
    other = np.frombuffer(recv_exactly(conn, vector.nbytes), dtype=vector.dtype)
    first, second = (vector, other) if rank == 0 else (other, vector)
    return (first + second) / 2


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rank", type=int, choices=(0, 1), required=True)
    p.add_argument("--peer", required=True, help="the other machine's address")
    p.add_argument("--port", type=int, default=29500)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--out", default="losses.txt")
    args = p.parse_args()

    x, y = make_data()
    x, y = x[args.rank::2], y[args.rank::2]  # this machine's half
    model = init_model(x.shape[1], args.hidden)
    velocity = {k: np.zeros_like(v) for k, v in model.items()}
    batches = np.random.default_rng(100 + args.rank)
    conn = connect(args.rank, args.peer, args.port)
    print(f"rank {args.rank}: connected to {args.peer}", flush=True)

    out = open(args.out, "w") if args.rank == 0 else None
    started = time.monotonic()
    for step in range(1, args.steps + 1):
        idx = batches.integers(0, len(x), args.batch)
        loss, grads = loss_and_grads(model, x[idx], y[idx])
        flat = all_reduce(conn, args.rank, np.concatenate([[loss]] + [grads[k].ravel() for k in KEYS]))
        loss, offset = float(flat[0]), 1
        for k in KEYS:
            g = flat[offset:offset + model[k].size].reshape(model[k].shape)
            offset += model[k].size
            velocity[k] = 0.9 * velocity[k] - args.lr * g
            model[k] += velocity[k]
        if out:
            out.write(f"{step} {loss!r}\n")
            out.flush()
        if step % 10 == 0 or step == args.steps:
            rate = step / (time.monotonic() - started)
            print(f"step {step}/{args.steps} loss {loss:.6f} ({rate:.1f} steps/s)", flush=True)
    if out:
        out.close()
    conn.close()
    print(f"done: {args.steps} steps, final loss {loss!r}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
