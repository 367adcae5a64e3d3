"""`dspark generate` streams text for a prompt."""

from __future__ import annotations

import re

from dspark.cli import main


def test_generate_streams_text(tiny_llama_dir, capsys):
    rc = main(
        [
            "generate",
            "Hello",
            "--model",
            str(tiny_llama_dir),
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--max-tokens",
            "5",
            "--kv-cache-memory-gb",
            "0.01",
        ]
    )
    out = capsys.readouterr()
    m = re.search(r"\[(\d+) tokens, finish_reason=(stop|length)\]", out.err)
    assert rc == 0 and m is not None
    n, reason = int(m.group(1)), m.group(2)
    assert n == 5 if reason == "length" else 1 <= n <= 5
    assert out.out.endswith("\n")


def test_generate_reports_bad_input(tiny_llama_dir, capsys):
    rc = main(
        [
            "generate",
            "Hello",
            "--model",
            str(tiny_llama_dir),
            "--device",
            "cpu",
            "--temperature",
            "-1",
        ]
    )
    assert rc == 2 and "temperature must be >= 0, got -1.0" in capsys.readouterr().err
    rc = main(["generate", "Hello", "--model", "/does/not/exist"])
    assert rc == 2 and "/does/not/exist" in capsys.readouterr().err
