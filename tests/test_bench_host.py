"""``tripath bench host``: runs on the CPU (interpreter) and reports each backend's recorded launches and
host times; bad arguments are refused by name."""

import json

import pytest

from tripath.bench import host


def test_the_command_reports_launches_and_host_times(tmp_path, capsys):
    out = tmp_path / "host.json"
    assert host.main_host(["--device", "cpu", "--backends", "unified", "--reps", "1", "--layers", "3",
                           "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())
    assert row["backend"] == "unified" and row["launches"] == 2 and row["refused"] is None  # write + attention
    assert row["layers"] == 3
    assert all(row[k] > 0 for k in ("forward_us", "record_us", "record_unwatched_us", "replay_us",
                                     "layers_forward_us", "layers_replayed_us", "layers_replayed_unwatched_us"))
    printed = capsys.readouterr().out
    assert "| unified | 2 |" in printed and "3 layers, each its forward | replayed | replayed, unwatched" in printed


def test_the_mha_tp8_step_and_bad_arguments(capsys):
    step = host.tp8_mixed_step()
    assert len(step) == 35 and sum(1 for c, q in step if q == 1) == 30 and (1500, 400) in step
    assert all(c == 0 and 300 <= q <= 1200 for c, q in step[31:])
    for argv, message in ((["--layers", "1"], "--layers must be at least 2"),
                          (["--backends", "mla"], "not among three_path, two_path, unified")):
        with pytest.raises(SystemExit):
            host.main_host(["--device", "cpu", *argv])
        assert message in capsys.readouterr().err
