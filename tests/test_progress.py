"""Progress per task and parameter: throttled ticks, the view's accounting, Dask's event
channel from workers to the client, and what the CLI prints (bars, JSON lines, nothing)."""

from __future__ import annotations

import io
import json
import math
import time
from pathlib import Path
from typing import Any

import pytest

import zckpt
import zckpt.run.progress as progress
from zckpt.cli.main import main as cli_main
from zckpt.core.errors import UsageError
from zckpt.formats.strategy import StrategyMap, encode_strategy, make_layout
from zckpt.jobs.export_job import ExportOptions
from zckpt.jobs.generate import write_model
from zckpt.jobs.generate_model import TensorDef
from zckpt.jobs.ingest import IngestOptions
from zckpt.run.progress import BARS, JSON, OFF, DaskTopic, Ticker, View, mode_of
from zckpt.write import group_writer


def _lines(stream: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_ticker_sends_at_most_once_per_interval_and_the_rest_at_close() -> None:
    sent: list[tuple[str, int]] = []
    t = Ticker(lambda p, n: sent.append((p, n)), interval=3600)
    for i in range(5):
        t.add(f"p{i}", 10)
    assert sent == []
    t.close()
    assert sent == [("p4", 50)]
    sent.clear()
    every = Ticker(lambda p, n: sent.append((p, n)), interval=0)
    every.add("a", 1)
    every.add("b", 2)
    every.close()
    assert sent == [("a", 1), ("b", 2)]
    Ticker(None).add("quiet", 1)  # no report: nothing to call


def test_view_counts_each_byte_once_whatever_order_ticks_arrive_in() -> None:
    out = io.StringIO()
    view = View(JSON, "export", [("rank 0", 100), ("rank 1", 50)], stream=out)
    view.tick(0, "w", 30)
    view.tick(1, "b", 70)  # more than the task's size: clipped
    view.finish(1)
    view.tick(1, "late", 10)  # after the task returned: ignored
    view.tick(7, "x", 5)  # no such task: ignored
    view.finish(0)
    view.close()
    lines = _lines(out)
    assert [(x["task"], x["param"], x["task_bytes_done"], x["task_done"]) for x in lines] == [
        ("rank 0", "w", 30, False), ("rank 1", "b", 50, False), ("rank 1", "b", 50, True), ("rank 0", "w", 100, True)]
    assert [x["bytes_done"] for x in lines] == [30, 80, 80, 150] and lines[-1]["bytes_total"] == 150
    assert all(x["event"] == "progress" and x["phase"] == "export" for x in lines)


def test_view_draws_a_bar_per_task_in_progress() -> None:
    pytest.importorskip("tqdm")
    out = io.StringIO()
    view = View(BARS, "ingest", [("rank 0", 1 << 20), ("rank 1", 1 << 20)], stream=out)
    view.tick(0, "layer0.weight", 1 << 19)
    bar = view.tasks[0].bar
    assert bar is not None and view.tasks[1].bar is None
    assert (bar.n, bar.postfix) == (0.5, "layer0.weight")  # bars count MiB, as the summaries do
    view.finish(0)
    assert view.tasks[0].bar is None and bar.n == 1.0
    view.close()
    assert "ingest" in out.getvalue() and "rank 0" in out.getvalue()
    assert "MiB" in out.getvalue() and "MB/s" not in out.getvalue()


def test_progress_modes() -> None:
    assert mode_of(True) == BARS and mode_of(False) == OFF and mode_of("json") == JSON
    with pytest.raises(UsageError, match="progress must be one of"):
        mode_of("loud")


def _job(tmp_path: Path) -> tuple[Path, Path]:
    tensors = [TensorDef(f"layer{i}.weight", (16, 8), "Float32", make_layout((2,), [[0], []])) for i in range(6)]
    write_model(tmp_path / "src", tensors, device_num=2, scalars=False)
    dst = tmp_path / "dst.ckpt"
    dst.write_bytes(encode_strategy(StrategyMap(layouts={
        t.name: {0: make_layout((4,), [[], [0]])} for t in tensors})))
    return tmp_path / "src", dst


def _progress_lines(err: str) -> list[dict[str, Any]]:
    return [d for d in (json.loads(line) for line in err.splitlines() if line.startswith("{"))
            if d.get("event") == "progress"]


def test_cli_json_progress_names_parameters_and_ends_complete(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(progress, "TICK_SECONDS", 0.0)
    src, dst = _job(tmp_path)
    store = tmp_path / "s.zarr"
    ingest = ["ingest", str(src), "--strategy", str(src / "strategy.ckpt"), "--store", str(store), "--json"]
    assert cli_main(ingest) == 0
    captured = capsys.readouterr()
    json.loads(captured.out)  # the report stays one JSON document on stdout
    ing = _progress_lines(captured.err)
    assert {x["phase"] for x in ing} == {"ingest"}
    assert {x["task"] for x in ing} == {"rank 0", "rank 1"}
    assert {x["param"] for x in ing} >= {f"layer{i}.weight" for i in range(6)}
    assert ing[-1]["bytes_done"] == ing[-1]["bytes_total"] == 6 * 16 * 8 * 4
    monkeypatch.setattr(group_writer, "GAIN", math.inf)  # one task per file
    monkeypatch.setattr(group_writer, "SMALL_PIECE", 0)
    assert cli_main(["export", str(store), "--strategy", str(dst), "--out", str(tmp_path / "o"), "--json"]) == 0
    exp = _progress_lines(capsys.readouterr().err)
    assert {x["task"] for x in exp} == {f"rank {r} checkpoint_{r}.ckpt" for r in range(4)}
    assert sum(1 for x in exp if x["task_done"]) == 4
    assert exp[-1]["bytes_done"] == exp[-1]["bytes_total"] == 6 * 16 * 8 * 4
    monkeypatch.setattr(group_writer, "GAIN", 0.0)  # source-major: one task for the group of files
    assert cli_main(["export", str(store), "--strategy", str(dst), "--out", str(tmp_path / "g"), "--json"]) == 0
    grouped = _progress_lines(capsys.readouterr().err)
    assert {x["task"] for x in grouped} == {"ranks 0-3"}
    assert sum(1 for x in grouped if x["task_done"]) == 1
    assert {x["param"] for x in grouped} >= {f"layer{i}.weight" for i in range(6)}
    assert grouped[-1]["bytes_done"] == grouped[-1]["bytes_total"] == 6 * 16 * 8 * 4
    assert cli_main(["export", str(store), "--strategy", str(dst), "--out", str(tmp_path / "q"), "--json",
                     "--quiet"]) == 0
    assert _progress_lines(capsys.readouterr().err) == []


def test_ticks_travel_from_a_dask_worker_to_the_client() -> None:
    distributed = pytest.importorskip("distributed")
    view = View(JSON, "export", [("rank 0", 100)], stream=io.StringIO())
    with distributed.LocalCluster(n_workers=1, threads_per_worker=1, processes=False,
                                  dashboard_address=None) as cluster, distributed.Client(cluster) as client:
        client.subscribe_topic("zckpt-test", view.on_event)

        def task(report: DaskTopic) -> int:
            report("layer0.weight", 40)
            return 1

        assert client.submit(task, DaskTopic("zckpt-test", 0)).result() == 1
        deadline = time.monotonic() + 30
        while view.tasks[0].done < 40 and time.monotonic() < deadline:
            time.sleep(0.05)
        client.unsubscribe_topic("zckpt-test")
    assert (view.tasks[0].done, view.tasks[0].param) == (40, "layer0.weight")


def test_progress_on_a_local_cluster_accounts_for_every_task(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("distributed")
    monkeypatch.setattr(progress, "TICK_SECONDS", 0.0)
    views: list[View] = []
    real = progress.View

    def spy(*args: Any, **kw: Any) -> View:
        views.append(real(*args, **{**kw, "stream": io.StringIO()}))
        return views[-1]

    monkeypatch.setattr("zckpt.run.engines.View", spy)
    src, dst = _job(tmp_path)
    zckpt.ingest(str(src), tmp_path / "s.zarr", str(src / "strategy.ckpt"),
                 IngestOptions(workers=2, progress="json"))
    zckpt.export(tmp_path / "s.zarr", tmp_path / "o", str(dst), options=ExportOptions(workers=2, progress="json"))
    assert [v.phase for v in views] == ["ingest", "export"]
    for v in views:
        assert all(t.finished and t.done == t.total for t in v.tasks) and v.done == v.total == 6 * 16 * 8 * 4
