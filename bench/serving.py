"""The served path's time: where served streams spend theirs, and what the engine process's
output sender costs its step loop.

    DSPARK_REQUEST_TRACE=trace dspark serve ... &
    dspark bench serve --save-requests --out served.json ...
    python bench/serving.py phases served.json trace [--first-wave C]
    python bench/serving.py sender-cost --outputs 190 --steps 2000

phases       the load generator's per-request records joined with the server's per-request
             trace by response id. One clock for all three processes (the monotonic clock; the
             client's perf_counter is the same clock on Linux). Each phase's median, mean and
             90th percentile, in ms:

             client -> app                  the client sent it; the server's app was called
             client: start -> sent          the client's part: a connection, the request written
             sent -> app                    the server's part: accepting, parsing, its event loop
             app -> engine                  ... the engine added it (validation, tokenization, pipe)
             engine: added -> first token   the engine's own time to first token
             app -> acked                   the engine's acknowledgement reached the handler
             first token -> chunk           the first chunk with content was handed to the server
             chunk -> client                ... and read by the client
             engine: run                    first token -> finished, in the engine
             finished -> last chunk         the stream's end was handed to the server
             last chunk -> client           ... and read by the client

sender-cost  posts a step of --outputs wire outputs (three tokens each, as
             `wire.encode_outputs` gives them) to an OutputSender over a real pipe, waits until
             it is sent, and repeats: the median post_step() time (the engine's step loop pays
             it) and the sender thread's mean time a message (pickle and write: the loop pays it
             too, in the interpreter lock). 190 outputs: a served step at 256 streams (about 190
             requests running a step).
"""

from __future__ import annotations

import argparse
import glob
import json
import multiprocessing
import statistics
import threading
import time

# ---- phases --------------------------------------------------------------------------------

PHASES = (
    ("client -> app", lambda c, t: t["asgi"] - c["start"]),
    ("client: start -> sent", lambda c, t: c["sent"] - c["start"]),
    ("sent -> app", lambda c, t: t["asgi"] - c["sent"]),
    ("app -> engine", lambda c, t: t["added"] - t["asgi"]),
    ("engine: added -> first token", lambda c, t: t["first_token"] - t["added"]),
    ("app -> acked", lambda c, t: t["acked"] - t["asgi"]),
    ("first token -> chunk", lambda c, t: t["first_chunk"] - t["first_token"]),
    ("chunk -> client", lambda c, t: c["start"] + c["ttft"] - t["first_chunk"]),
    ("engine: run", lambda c, t: t["finished"] - t["first_token"]),
    ("finished -> last chunk", lambda c, t: t["last_chunk"] - t["finished"]),
    ("last chunk -> client", lambda c, t: c["start"] + c["e2e"] - t["last_chunk"]),
    ("client TTFT", lambda c, t: c["ttft"]),
)


def joined_requests(client_json: str, trace_prefix: str, level: int) -> list[tuple[dict, dict]]:
    """(client record, server trace) of each request both saw, in the order they were sent."""
    requests = json.load(open(client_json))["levels"][level]["requests"]
    traces = {}
    for path in glob.glob(f"{trace_prefix}.*"):
        for line in open(path):
            record = json.loads(line)
            traces[record["id"]] = record
    joined = [(c, traces[c["id"]]) for c in requests if c["ok"] and c["id"] in traces]
    return sorted(joined, key=lambda pair: pair[0]["start"])


def _value(phase, client: dict, trace: dict) -> float | None:
    """A phase's seconds, None where a record lacks a stamp (files of older versions)."""
    try:
        return phase(client, trace)
    except (KeyError, TypeError):
        return None


def phases(joined: list[tuple[dict, dict]]) -> list[tuple]:
    """[(phase, median, mean, p90) in ms] over these requests."""
    rows = []
    for name, phase in PHASES:
        values = sorted(1e3 * v for c, t in joined if (v := _value(phase, c, t)) is not None)
        if values:
            p90 = values[min(len(values) - 1, 9 * len(values) // 10)]
            rows.append((name, statistics.median(values), statistics.mean(values), p90))
    return rows


def print_phases(args: argparse.Namespace) -> None:
    joined = joined_requests(args.client_json, args.trace_prefix, args.level)
    print(f"{len(joined)} requests joined")
    groups = {"all": joined}
    if args.first_wave:
        groups = {f"first {args.first_wave}": joined[: args.first_wave],
                  "later": joined[args.first_wave :]}  # fmt: skip
    for group, members in groups.items():
        if len(groups) > 1:
            print(f"{group} ({len(members)} requests)")
        print(f"{'phase':<30}{'median':>9}{'mean':>9}{'p90':>9}  (ms)")
        for name, median, mean, p90 in phases(members):
            print(f"{name:<30}{median:>9.1f}{mean:>9.1f}{p90:>9.1f}")


# ---- sender cost ---------------------------------------------------------------------------


def sender_cost(args: argparse.Namespace) -> None:
    from dspark.server.output_sender import OutputSender

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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("phases", help="served streams' time, phase by phase")
    p.add_argument("client_json", help="dspark bench serve --save-requests --out")
    p.add_argument("trace_prefix", help="the server's DSPARK_REQUEST_TRACE")
    p.add_argument("--level", type=int, default=0, help="which level of the client JSON")
    p.add_argument(
        "--first-wave", type=int, default=0,
        help="C: the phases of the first C requests sent (sent together, on new connections, "
        "into an idle server) apart from the rest's",
    )  # fmt: skip
    p.set_defaults(func=print_phases)
    s = sub.add_parser("sender-cost", help="posting and sending one step's outputs")
    s.add_argument("--outputs", type=int, default=190)
    s.add_argument("--steps", type=int, default=2000)
    s.set_defaults(func=sender_cost)
    args = parser.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
