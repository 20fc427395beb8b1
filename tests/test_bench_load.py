"""`dflash bench --endpoint URL --concurrency N,...` against a batching server, and `--plot`."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from dflash_cli.bench.load import arrival_times
from dflash_cli.bench.plot import charts, write_plot
from dflash_cli.cli.app import create_app
from dflash_cli.errors import DFlashError
from tests.serving import running_server


def test_arrivals_are_all_at_once_or_a_seeded_poisson_process():
    assert arrival_times(4, float("inf"), 0) == [0.0] * 4
    a = arrival_times(200, 10.0, 3)
    assert a == arrival_times(200, 10.0, 3) and a[0] == 0.0
    assert all(x < y for x, y in zip(a, a[1:]))
    assert 0.07 < a[-1] / 199 < 0.13  # mean gap 1/rate


def test_load_levels_against_a_batching_server_with_plot(qwen3_engine, tmp_path):
    recipe, cache = str(qwen3_engine.recipe.source), str(qwen3_engine.compile_dir.parents[2])
    with running_server(qwen3_engine, max_batch=4) as (url, app):
        assert app.state.scheduler.slots == 4
        data = tmp_path / "short.jsonl"  # the tiny pair's context holds 128 positions
        prompts = ["def f(x):", "import os", "a b a b", "class A:", "x = [1, 2", "for i in"]
        data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
        args = ["bench", "--endpoint", url, "--concurrency", "1,3", "--dataset", str(data)]
        args += ["--max-new-tokens", "8", "-r", recipe, "--cache-dir", cache]
        args += ["--output", str(tmp_path / "load.json"), "--plot", str(tmp_path / "load.html")]
        res = CliRunner().invoke(create_app(), args)
        metrics = app.state.metrics.batch_stats
    assert res.exit_code == 0, res.output
    doc = json.loads((tmp_path / "load.json").read_text())
    assert [x["max_concurrency"] for x in doc["load"]] == [1, 3]
    assert all(x["completed"] == 6 and x["failed"] == 0 and x["output_throughput"] > 0 for x in doc["load"])
    assert doc["lossless"] == {"checked": True, "mismatches": []}
    assert {"median_tpot_ms", "p99_ttft_ms", "median_e2el_ms"} <= set(doc["load"][1])
    page = (tmp_path / "load.html").read_text()
    assert page.count("<svg") == 2 and "Throughput against load" in page
    assert metrics.largest >= 2  # three clients shared calls


def test_plot_draws_acceptance_and_per_prompt_speedups(tmp_path):
    doc = {
        "dflash": {"per_position_acceptance": [0.9, 0.7, 0.4], "decode_speedup_per_sample": {"a": 1.5, "b": 2.5}},
        "lookup": {"per_position_acceptance": [0.5, 0.2, 0.1]},
    }
    titles = [c[0] for c in charts(doc)]
    assert titles == ["Per-position acceptance", "Per-prompt decode speedup over plain"]
    write_plot(doc, tmp_path / "bench.html")
    page = (tmp_path / "bench.html").read_text()
    assert "dflash (median 2.00x)" in page and page.count("<circle") == 3 + 3 + 2
    with pytest.raises(DFlashError, match="nothing to plot"):
        write_plot({"baseline": {}}, tmp_path / "empty.html")
    with pytest.raises(DFlashError, match="unknown picture format"):
        write_plot(doc, tmp_path / "bench.svgz")


def test_png_without_matplotlib_says_how_to_get_it(tmp_path):
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        with pytest.raises(DFlashError, match=r"dflash-toolchain\[plot\]"):
            write_plot({"dflash": {"per_position_acceptance": [0.5]}}, tmp_path / "x.png")
    else:
        write_plot({"dflash": {"per_position_acceptance": [0.5]}}, tmp_path / "x.png")
        assert (tmp_path / "x.png").read_bytes()[:4] == b"\x89PNG"


def test_a_load_level_where_every_request_failed_is_an_error(qwen3_engine, tmp_path):
    with running_server(qwen3_engine, max_batch=2) as (url, _):
        data = tmp_path / "long.jsonl"
        data.write_text(json.dumps({"prompt": "word " * 400}) + "\n")  # longer than the build's context
        args = ["bench", "--endpoint", url, "--concurrency", "2", "--dataset", str(data), "--max-new-tokens", "4"]
        res = CliRunner().invoke(create_app(), args)
    assert res.exit_code != 0
    assert "every request failed" in res.output and "exceeds" in res.output
