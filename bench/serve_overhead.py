"""What the HTTP server costs, measured on the CPU: served tokens/s over offline tokens/s.

    python bench/serve_overhead.py --levels 1,16,64,256 --output-len 256 --out serve_cpu.json

For each level C, three arms decode the same prompts (GSM8K, Vicuna, Alpaca) greedily to
--output-len tokens (ignore_eos):

    offline        `dspark bench`: C requests in one generate call (outputs only at the end)
    engine stream  the engine alone as the server drives it: C requests at once, outputs
                   "delta" (a DeltaOutput per running request per step, text decoded token
                   by token), no HTTP
    served         `dspark serve` loaded by `dspark bench serve`: C streamed chat requests in
                   flight, 4 C in all

served / offline is the loss issue 7 bounds (at most 10%); served / engine stream is the HTTP
server's own share of it, the rest is the engine's cost of streaming outputs. Beside them, the
CPU used per output token by the server's event-loop thread, its other threads, the engine
process (all its threads) and the load generator, so a saturated client is seen as such.

The model is built once under --model-dir: a 1-layer, 32-wide Llama over a 1,024-word
vocabulary (the prompts' most common words, whitespace-split, so every prompt encodes), with a
plain chat template. A 49k-token vocabulary would spend the CPU step in the LM head; this one
lets the CPU engine decode tens of thousands of tokens/s, so the server has to keep up with an
output rate like the GPU's.

--attention batched (the default) stands in for the GPU's attention kernel: the torch
reference loops over requests on the host (some 15 small ops per request per layer, ~0.1 ms),
which would make the CPU engine's host cost per token ten times the GPU's and hide the server's
share; the stand-in attends to every decode row in one padded SDPA (prefill rows still go
through the reference). Every arm runs it, in child processes of this script (`--child`), so the
ratio compares like with like; the server's engine process, spawned, imports this script as
`__mp_main__` with the server's arguments and installs it there too (at the end of the file).
--attention reference keeps the reference.

--client-ceiling measures the load generator alone against a stub server that answers every
request with pre-rendered chunks at once: the most events/s the client can take.

On a small shared VM the tokens/s of consecutive runs drift (1.5x between two offline runs of
the same level is common while other jobs run); the CPU per token is steadier. Compare two
versions by alternating them, several rounds, on an idle machine.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import math
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SOURCES = "gsm8k,vicuna,alpaca"  # short prompts: every one fits max_model_len with its output
VOCAB_SIZE = 1024
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
MAX_MODEL_LEN = 1024
NUM_KV_PAGES = 8192  # 256 requests of up to ~500 tokens in 16-token pages
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


# ---- the model ------------------------------------------------------------------------------


def build_model(directory: Path) -> Path:
    """A 1-layer word-level Llama whose vocabulary covers the benchmark prompts' common words."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    sys.path.insert(0, str(REPO))
    from dspark.benchmarks.prompts import default_prompts_dir, load_prompts
    from tests.tiny_models import save_random_model

    if (directory / "config.json").exists():
        return directory
    conversations = load_prompts(default_prompts_dir(), tuple(SOURCES.split(",")), 0, "all")
    counts = collections.Counter(w for c in conversations for m in c for w in m["content"].split())
    special = ["<unk>", "<eos>", "user:", "assistant:", "system:"]
    words = special + [w for w, _ in counts.most_common(VOCAB_SIZE - len(special))]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", eos_token="<eos>"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    config = LlamaConfig(
        vocab_size=len(words), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048,
        tie_word_embeddings=True, bos_token_id=None, eos_token_id=1, initializer_range=0.2,
    )  # fmt: skip
    save_random_model(directory, config)
    tokenizer.save_pretrained(directory)
    return directory


# ---- the attention stand-in (child processes only) ------------------------------------------


def batched_decode_attention(q, kv_cache, attn, scale):
    """paged_attention_ref with every one-token (decode) row in one padded SDPA.

    decode rows d (q_len 1): keys 0 .. seq_lens[d] - 1 of pages block_table[d, :P], padded to
    P pages and masked past each row's length; other rows go through the reference.
    """
    import torch
    import torch.nn.functional as F

    from dspark.kernels.paged_attention_ref import paged_attention_ref

    cu = attn.cu_num_tokens_cpu
    decode = [r for r in range(attn.num_reqs) if cu[r + 1] - cu[r] == 1]
    if len(decode) < 2 or not attn.causal:
        return paged_attention_ref(q, kv_cache, attn, scale)
    if len(decode) < attn.num_reqs:
        return _mixed(q, kv_cache, attn, scale, decode)
    page_size, num_kv_heads, head_dim = kv_cache.shape[2:]
    num_pages = -(-max(attn.seq_lens_cpu) // page_size)
    pages = attn.block_table[:, :num_pages].long()  # [D, P]
    k = kv_cache[0][pages].reshape(len(decode), -1, num_kv_heads, head_dim).transpose(1, 2)
    v = kv_cache[1][pages].reshape(len(decode), -1, num_kv_heads, head_dim).transpose(1, 2)
    positions = torch.arange(k.shape[2])[None, :]  # [1, S]
    mask = positions < attn.seq_lens.long()[:, None]  # [D, S]
    o = F.scaled_dot_product_attention(
        q.unsqueeze(2), k, v, attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=True
    )  # [D, nh, 1, hd]
    return o.squeeze(2)


def _mixed(q, kv_cache, attn, scale, decode):
    """Decode rows batched, the rest (prefill chunks) one by one through the reference."""
    import torch

    from dspark.kernels.paged_attention_ref import paged_attention_ref
    from dspark.layers.attention_metadata import AttentionMetadata

    out = torch.empty_like(q)
    cu = attn.cu_num_tokens_cpu
    is_decode = set(decode)
    for rows in (decode, [r for r in range(attn.num_reqs) if r not in is_decode]):
        if not rows:
            continue
        tokens = [t for r in rows for t in range(cu[r], cu[r + 1])]
        q_lens = [cu[r + 1] - cu[r] for r in rows]
        sub = AttentionMetadata(
            cu_num_tokens=torch.tensor([0, *_cumsum(q_lens)], dtype=torch.int32),
            seq_lens=attn.seq_lens[rows],
            slot_mapping=attn.slot_mapping[tokens],
            block_table=attn.block_table[rows],
            cu_num_tokens_cpu=(0, *_cumsum(q_lens)),
            seq_lens_cpu=tuple(attn.seq_lens_cpu[r] for r in rows),
            causal=attn.causal,
        )
        attend = batched_decode_attention if rows is decode else paged_attention_ref
        out[tokens] = attend(q[tokens], kv_cache, sub, scale)
    return out


def _cumsum(values: list[int]) -> list[int]:
    total, sums = 0, []
    for v in values:
        total += v
        sums.append(total)
    return sums


def child_settings(attention: str) -> None:
    """One torch thread, and the attention stand-in when asked for."""
    import torch

    torch.set_num_threads(1)  # two threads on a small VM are slower than one
    if attention == "batched":
        import dspark.layers.attention as attention_module

        attention_module.paged_attention_ref = batched_decode_attention


def run_child(attention: str, argv: list[str]) -> int:
    """`dspark ARGV` in this process (or, for ARGV `engine-stream ...`, engine_stream), with
    child_settings."""
    child_settings(attention)
    if argv[0] == "engine-stream":
        levels = [int(c) for c in argv[2].split(",")]
        engine_stream(Path(argv[1]), levels, int(argv[3]), argv[4], int(argv[5]))
        return 0
    from dspark.cli import main

    return main(argv)


def engine_stream(
    model: Path, levels: list[int], output_len: int, out: str, stream_interval: int
) -> None:
    """The engine alone, no HTTP, as the server drives it: outputs "delta" (a DeltaOutput
    per running request per step, incremental detokenization), C requests added at once as
    in the offline bench, the same prompts; output tokens/s per level."""
    from dspark.benchmarks.offline_prompts import cycle, truncate
    from dspark.benchmarks.prompts import default_prompts_dir, load_prompts
    from dspark.config import EngineConfig
    from dspark.engine.engine import LLMEngine
    from dspark.sampling_params import SamplingParams

    config = EngineConfig(model=str(model), dtype="float32", device="cpu",
                          max_model_len=MAX_MODEL_LEN, num_kv_pages=NUM_KV_PAGES,
                          stream_interval=stream_interval)  # fmt: skip
    engine = LLMEngine(config)
    conversations = load_prompts(default_prompts_dir(), tuple(SOURCES.split(",")), 0, "eval")
    prompts = [truncate(engine.tokenizer.apply_chat_template(c), 512)
               for c in cycle(conversations, max(levels))]  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True,
                            output_kind="delta")  # fmt: skip
    rates = {}
    for c in [4, *levels]:  # the first level warms up
        for i, ids in enumerate(prompts[:c]):
            engine.add_request(f"{c}-{i}", ids, params)
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        rates[c] = c * output_len / (time.perf_counter() - start)
    Path(out).write_text(json.dumps(rates))


def child_command(args: argparse.Namespace, argv: list[str]) -> list[str]:
    script = str(Path(__file__).resolve())
    return [sys.executable, script, "--child", "--attention", args.attention, "--", *argv]


def child_env() -> dict[str, str]:
    return os.environ | {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


# ---- the two arms ---------------------------------------------------------------------------


def run_offline(args: argparse.Namespace, model: Path, out: Path) -> dict[int, float]:
    argv = ["bench", "--model", str(model), "--dtype", "float32", "--device", "cpu",
            "--concurrency", args.levels, "--output-len", str(args.output_len),
            "--max-model-len", str(MAX_MODEL_LEN), "--sources", SOURCES, "--no-plot",
            "--repeats", str(args.repeats), "--out", str(out)]  # fmt: skip
    subprocess.run(child_command(args, argv), env=child_env(), check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    levels = json.loads(out.read_text())["dspark"]["levels"]
    return {lv["concurrency"]: lv["output_tokens_per_s"] for lv in levels}


def run_engine_stream(args: argparse.Namespace, model: Path, out: Path) -> dict[int, float]:
    argv = ["engine-stream", str(model), args.levels, str(args.output_len), str(out),
            str(args.stream_interval)]  # fmt: skip
    subprocess.run(child_command(args, argv), env=child_env(), check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    return {int(c): rate for c, rate in json.loads(out.read_text()).items()}


def thread_cpu_s(pid: int) -> tuple[float, float]:
    """(main thread, all other threads) CPU seconds of a process, from /proc."""
    main_s = other_s = 0.0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        seconds = (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime, stime
        if int(task.name) == pid:
            main_s += seconds
        else:
            other_s += seconds
    return main_s, other_s


def children_cpu_s(pid: int) -> float:
    """CPU seconds of a process's child processes (the server's engine process), from /proc."""
    total = 0.0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            children = (task / "children").read_text().split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        for child in children:
            try:
                fields = Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()
            except (FileNotFoundError, ProcessLookupError):
                continue
            total += (int(fields[11]) + int(fields[12])) / CLOCK_TICKS
    return total


def start_server(args: argparse.Namespace, model: Path, port: int) -> subprocess.Popen:
    argv = ["serve", str(model), "--dtype", "float32", "--device", "cpu", "--port", str(port),
            "--max-model-len", str(MAX_MODEL_LEN), "--num-kv-pages", str(NUM_KV_PAGES),
            "--disable-access-log", "--stream-interval", str(args.stream_interval),
            *shlex.split(args.server_args)]  # fmt: skip
    log = open(args.work_dir / "server.log", "w")  # noqa: SIM115 - open while the server runs
    process = subprocess.Popen(child_command(args, argv), env=child_env(), stdout=log,
                               stderr=subprocess.STDOUT)  # fmt: skip
    from dspark.benchmarks.serve_bench import wait_healthy

    wait_healthy(f"http://127.0.0.1:{port}", process)
    return process


def run_client(args: argparse.Namespace, url: str, c: int, out: Path) -> tuple[dict, float]:
    """One `dspark bench serve` level, in this process; (its summary, the client's CPU s)."""
    from dspark.benchmarks.serve_bench import run_bench
    from dspark.cli import build_parser

    argv = ["bench", "serve", "--base-url", url, "--concurrency", str(c),
            "--num-prompts", str(max(8, 4 * c)), "--output-len", str(args.output_len),
            "--sources", SOURCES, "--no-plot", "--out", str(out),
            *shlex.split(args.client_args)]  # fmt: skip
    start = time.process_time()
    results = asyncio.run(run_bench(build_parser().parse_args(argv), url))
    out.write_text(json.dumps(results, indent=1))
    level = results["levels"][0]  # (a bench without client_cpu_s: the whole run's CPU)
    return level["summary"], level.get("client_cpu_s", time.process_time() - start)


def run_served(args: argparse.Namespace, model: Path) -> dict[int, dict]:
    from dspark.benchmarks.serve_bench import free_port

    port = free_port()
    server = start_server(args, model, port)
    url = f"http://127.0.0.1:{port}"
    results = {}
    try:
        run_client(args, url, 4, args.work_dir / "warmup.json")
        for c in (int(v) for v in args.levels.split(",")):
            loop_0, other_0 = thread_cpu_s(server.pid)
            engine_0 = children_cpu_s(server.pid)
            summary, client_s = run_client(args, url, c, args.work_dir / f"served_c{c}.json")
            loop_1, other_1 = thread_cpu_s(server.pid)
            engine_1 = children_cpu_s(server.pid)
            tokens = summary["output_tokens"]
            results[c] = {
                "summary": summary,
                "us_per_token": {
                    "server_loop": 1e6 * (loop_1 - loop_0) / tokens,
                    "server_other": 1e6 * (other_1 - other_0) / tokens,
                    "engine_process": 1e6 * (engine_1 - engine_0) / tokens,
                    "client": 1e6 * client_s / tokens,
                },
            }
    finally:
        server.terminate()
        server.wait(timeout=60)
    return results


def format_table(offline: dict, streaming: dict, served: dict) -> str:
    """tok/s of the three arms, served / offline, served / engine streaming, latencies, and
    the CPU each thread used per output token (loop: the server's event loop; other: the
    server's other threads; engine: the engine process)."""
    head = f"{'C':>5} {'offline':>8} {'eng.str':>8} {'served':>8} {'/off':>5} {'/str':>5}"
    head += f" {'TTFT ms':>8} {'TPOT ms':>8} {'ITL ms':>7}  {'us/token: loop':>14}"
    head += f" {'other':>7} {'engine':>7} {'client':>7}"
    lines = [head]
    for c, level in served.items():
        s, cpu = level["summary"], level["us_per_token"]
        rate = s["output_tokens_per_s"]
        row = f"{c:>5} {offline[c]:>8.0f} {streaming[c]:>8.0f} {rate:>8.0f}"
        row += f" {rate / offline[c]:>5.2f} {rate / streaming[c]:>5.2f}"
        row += f" {s['ttft_ms']['median']:>8.1f} {s['tpot_ms']['median']:>8.2f}"
        row += f" {s['itl_ms']['median'] or math.nan:>7.2f}  {cpu['server_loop']:>14.1f}"
        row += f" {cpu['server_other']:>7.1f} {cpu.get('engine_process', 0.0):>7.1f}"
        row += f" {cpu['client']:>7.1f}"
        lines.append(row)
    return "\n".join(lines)


# ---- the client's own ceiling ---------------------------------------------------------------


async def _stub_server(num_tokens: int) -> asyncio.Server:
    """HTTP/1.1 keep-alive server answering every POST with num_tokens chat chunks + usage."""
    piece = 'data: {"id":"x","object":"chat.completion.chunk","created":0,"model":"m",'
    choice = '"choices":[{"index":0,"delta":{"content":" word"},"logprobs":null,'
    chunk = piece + choice + '"finish_reason":null,"stop_reason":null}],"usage":null}\n\n'
    final = piece + choice + '"finish_reason":"length","stop_reason":null}],"usage":null}\n\n'
    usage = {"prompt_tokens": 1, "completion_tokens": num_tokens, "total_tokens": num_tokens + 1}
    last = piece + '"choices":[],"usage":' + json.dumps(usage) + "}\n\ndata: [DONE]\n\n"
    body = [chunk.encode()] * (num_tokens - 1) + [final.encode(), last.encode()]
    head = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n")  # fmt: skip

    models = b'{"object": "list", "data": [{"id": "m", "object": "model"}]}'

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                request = await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError:
                return
            lines = request.lower().split(b"\r\n")
            length = [int(v.split(b":")[1]) for v in lines if v.startswith(b"content-length")]
            await reader.readexactly(length[0] if length else 0)
            if not lines[0].startswith(b"post"):  # /v1/models, /metrics
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s"
                             % (len(models), models))  # fmt: skip
                continue
            writer.write(head)
            for data in body:
                writer.write(b"%x\r\n%s\r\n" % (len(data), data))
                await writer.drain()
            writer.write(b"0\r\n\r\n")

    return await asyncio.start_server(answer, "127.0.0.1", 0)


def client_ceiling(args: argparse.Namespace) -> None:
    """The load generator against the stub: output events/s it parses, and its CPU."""
    port_file = args.work_dir / "stub_port"
    port_file.unlink(missing_ok=True)
    stub = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import sys; sys.path.insert(0, {str(REPO)!r}); "
            "from bench.serve_overhead import _stub_main; _stub_main()",
            str(args.output_len),
            str(port_file),
        ]  # fmt: skip
    )
    try:
        while not port_file.exists():
            time.sleep(0.05)
        url = f"http://127.0.0.1:{port_file.read_text()}"
        print(f"{'C':>5} {'events/s':>9} {'client us/event':>16}")
        for c in (int(v) for v in args.levels.split(",")):
            summary, client_s = run_client(args, url, c, args.work_dir / f"ceiling_c{c}.json")
            print(f"{c:>5} {summary['output_tokens_per_s']:>9.0f} "
                  f"{1e6 * client_s / summary['output_tokens']:>16.1f}")  # fmt: skip
    finally:
        stub.terminate()
        stub.wait()


def _stub_main() -> None:
    num_tokens, port_file = int(sys.argv[1]), Path(sys.argv[2])

    async def run() -> None:
        server = await _stub_server(num_tokens)
        port_file.write_text(str(server.sockets[0].getsockname()[1]))
        await server.serve_forever()

    asyncio.run(run())


# ---- main -----------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--levels", default="1,16,64,256")
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=1, help="offline runs per level")
    parser.add_argument("--attention", default="batched", choices=("batched", "reference"))
    parser.add_argument("--model-dir", type=Path, default=Path("/tmp/dspark_serve_overhead"))
    parser.add_argument("--work-dir", type=Path, default=None, help="default: --model-dir/run")
    parser.add_argument(
        "--stream-interval",
        type=int,
        default=1,
        help="the engine-stream arm's and the server's stream_interval",
    )
    parser.add_argument("--server-args", default="", help="extra `dspark serve` arguments")
    parser.add_argument("--client-args", default="", help="extra `dspark bench serve` arguments")
    parser.add_argument("--client-ceiling", action="store_true")
    parser.add_argument("--out", type=Path, default=None, help="a JSON of every figure")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args, rest = parser.parse_known_args()
    if args.child:
        sys.exit(run_child(args.attention, [a for a in rest if a != "--"]))
    args.work_dir = args.work_dir or args.model_dir / "run"
    args.work_dir.mkdir(parents=True, exist_ok=True)
    if args.client_ceiling:
        client_ceiling(args)
        return
    model = build_model(args.model_dir / "model")
    offline = run_offline(args, model, args.work_dir / "offline.json")
    streaming = run_engine_stream(args, model, args.work_dir / "engine_stream.json")
    served = run_served(args, model)
    print(format_table(offline, streaming, served))
    if args.out is not None:
        results = {"offline": offline, "engine_stream": streaming, "served": served}
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__mp_main__" and "--child" in sys.argv:  # the server's engine process
    child_settings(sys.argv[sys.argv.index("--attention") + 1])

if __name__ == "__main__":
    main()
