"""`dspark serve -tp 2`: the options, and a served two-rank engine answering as one rank does."""

from __future__ import annotations

import httpx

from dspark import LLM, SamplingParams
from dspark.cli import build_parser
from dspark.server.cli import build_configs, resolve_options
from dspark.server.engine_process import engine_factory
from tests.server.conftest import MODEL, engine_config, is_running, start_server

PROMPTS = ["a b c", "d e f g", "h"]


def test_the_size_flows_from_flag_or_file_to_every_command(tmp_path):
    path = tmp_path / "serve.yaml"
    path.write_text("model: m\ntensor-parallel-size: 2\n")
    from_file = resolve_options(build_parser().parse_args(["serve", "--config", str(path)]))
    engine, _ = build_configs(from_file)
    assert engine.tensor_parallel_size == 2 and engine_factory(engine).starts_processes
    flag = resolve_options(build_parser().parse_args(["serve", "m", "-tp", "4"]))
    assert build_configs(flag)[0].tensor_parallel_size == 4
    one = build_configs(resolve_options(build_parser().parse_args(["serve", "m"])))[0]
    assert one.tensor_parallel_size == 1 and not engine_factory(one).starts_processes
    for argv in (["generate", "hi"], ["profile"], ["bench"]):
        assert build_parser().parse_args([*argv, "-tp", "2"]).tensor_parallel_size == 2
        assert build_parser().parse_args(argv).tensor_parallel_size == 1


def test_a_two_rank_server_answers_as_one_rank(tiny_vocab_dir):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with LLM(str(tiny_vocab_dir), dtype="float32", device="cpu", num_kv_pages=64) as llm:
        expected = [o.outputs[0].text for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    live = start_server(engine_config(tiny_vocab_dir, tensor_parallel_size=2))
    try:
        engine_pid = live.state.engine_loop.process.pid
        texts = []
        for prompt in PROMPTS:
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0,
                    "ignore_eos": True}  # fmt: skip
            response = httpx.post(f"{live.url}/v1/completions", json=body, timeout=60)
            assert response.status_code == 200, response.text
            texts.append(response.json()["choices"][0]["text"])
        assert texts == expected
    finally:
        live.stop()
    assert not is_running(engine_pid)
