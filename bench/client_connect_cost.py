"""What a burst of new connections costs the load generator, against a bare ASGI app (no
dspark) that answers at once: `dspark bench serve`'s ConnectionPool opens N connections at
once and posts a request on each, as a level's first wave does without pre-connecting.

    python bench/client_connect_cost.py [N]          (N = 256 by default; port 8477)

Prints, in ms after the first request started, the quantiles of when each connection was
open, its request written, and the app called (the app's monotonic clock is the client's
perf_counter on Linux).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from dspark.benchmarks.serve_client import ConnectionPool  # noqa: E402

PORT = 8477


async def app(scope, receive, send):
    """Answers every request with the time it was called."""
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    called = time.monotonic()
    while (await receive()).get("more_body"):
        pass
    body = json.dumps({"t": called}).encode()
    headers = [(b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def one(pool: ConnectionPool, payload: bytes) -> tuple[float, ...]:
    start = time.perf_counter()
    connection = await pool.acquire()
    connected = time.perf_counter()
    connection.post(pool.netloc, "/", payload, {})
    posted = time.perf_counter()
    await connection.wait_status()
    called = json.loads(await connection.read_body())["t"]
    pool.release(connection)
    return start, connected, posted, called


async def burst(n: int) -> None:
    pool = ConnectionPool(f"http://127.0.0.1:{PORT}")
    payload = json.dumps({"messages": [{"role": "user", "content": "hi " * 50}]}).encode()
    times = await asyncio.gather(*(one(pool, payload) for _ in range(n)))
    pool.close()
    t0 = min(t[0] for t in times)
    quantiles = (0, n // 4, n // 2, 3 * n // 4, n - 1)
    names = ("first", "1/4", "1/2", "3/4", "last")
    print(f"{'ms after the first start':<24}" + "".join(f"{q:>8}" for q in names))
    for i, name in enumerate(("started", "connected", "written", "app called")):
        v = sorted(1e3 * (t[i] - t0) for t in times)
        print(f"{name:<24}" + "".join(f"{v[q]:>8.1f}" for q in quantiles))


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 256
    server = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "client_connect_cost:app", "--port", str(PORT),
         "--log-level", "warning", "--app-dir", str(Path(__file__).parent)]
    )  # fmt: skip
    try:
        time.sleep(3)
        for _ in range(2):  # the second burst is the warm one
            asyncio.run(burst(n))
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main()
