"""The engine process's output sender on the host: what posting and sending one step costs.

    python bench/sender_cost.py --outputs 190 --steps 2000

Posts a step of --outputs wire outputs (three tokens each, as `wire.encode_outputs` gives
them) to an OutputSender over a real pipe, waits until it is sent, and repeats: the median
post_step() time (the engine's step loop pays it) and the sender thread's mean time a message
(pickle and write: the loop pays it too, in the interpreter lock). 190 outputs: a served
step at 256 streams (about 190 requests running a step).
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import threading
import time

from dspark.server.output_sender import OutputSender


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--outputs", type=int, default=190)
    parser.add_argument("--steps", type=int, default=2000)
    args = parser.parse_args()
    reader, writer = multiprocessing.Pipe(duplex=False)

    def drain() -> None:
        while True:
            try:
                reader.recv_bytes()
            except EOFError:
                return

    threading.Thread(target=drain, daemon=True).start()
    sender = OutputSender(writer, on_closed_exit=None)
    outputs = [(f"req-{i}", "", [1000 + i, 2000 + i, 3000], None, None)
               for i in range(args.outputs)]  # fmt: skip
    stats = (args.outputs, 2, 100, 5000, 100000, 0, None)
    posts = []
    for _ in range(args.steps):
        start = time.perf_counter()
        sender.post_step(list(outputs), stats)
        posts.append(time.perf_counter() - start)
        sender.drain()
    sent = sender.times.take()
    print(f"{args.outputs} outputs a step, {args.steps} steps: post_step median "
          f"{statistics.median(posts) * 1e6:.1f} us; sender "
          f"{sent.seconds['message'] / sent.counts['message'] * 1e6:.1f} us a message")  # fmt: skip


if __name__ == "__main__":
    main()
