"""Where served streams spend their time: the load generator's per-request records joined with
the server's per-request trace by response id.

    DSPARK_REQUEST_TRACE=trace dspark serve ... &
    dspark bench serve --save-requests --out served.json ...
    python bench/request_phases.py served.json trace [--first-wave C]

One clock for all three processes (the monotonic clock; the client's perf_counter is the same
clock on Linux). Each phase's median, mean and 90th percentile, in ms:

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
"""

from __future__ import annotations

import argparse
import glob
import json
import statistics

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("client_json", help="dspark bench serve --save-requests --out")
    parser.add_argument("trace_prefix", help="the server's DSPARK_REQUEST_TRACE")
    parser.add_argument("--level", type=int, default=0, help="which level of the client JSON")
    parser.add_argument(
        "--first-wave", type=int, default=0,
        help="C: the phases of the first C requests sent (sent together, on new connections, "
        "into an idle server) apart from the rest's",
    )  # fmt: skip
    args = parser.parse_args()
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


if __name__ == "__main__":
    main()
