"""The scripts that redraw docs/performance.md's plots and FLOP tables, run as the doc runs them, on docs/data/
(scripts/results_tables.py: tests/test_protocol.py)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "docs" / "data"
pytestmark = pytest.mark.slow  # each run starts a Python process with torch and transformers


def run(script: str, *args: str, python: str = sys.executable) -> subprocess.CompletedProcess:
    """``scripts/script`` run with ``args``: Python scripts by this interpreter, shell scripts by bash (their
    Python calls use ``python``, this interpreter by default, through ``$PYTHON``)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", MPLBACKEND="Agg", PYTHON=python)
    runner = "bash" if script.endswith(".sh") else sys.executable
    return subprocess.run([runner, str(ROOT / "scripts" / script), *args], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=600)


def test_bench_plots_merges_the_memory_run(tmp_path):
    done = run("bench_plots.py", str(DATA / "cpu_bench_1k8k.json"), "--memory-from",
               str(DATA / "cpu_bench_1k8k_fresh_memory.json"), "--out", str(tmp_path / "bench.png"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "bench.png").stat().st_size > 0
    short = {"rows": [r for r in json.loads((DATA / "cpu_bench_1k8k.json").read_text())["rows"] if r["context"] < 8192]}
    (tmp_path / "short.json").write_text(json.dumps(short))
    done = run("bench_plots.py", str(DATA / "cpu_bench_1k8k.json"), "--memory-from", str(tmp_path / "short.json"),
               "--out", str(tmp_path / "other.png"))
    assert done.returncode != 0 and "has no row for (context, method) (8192" in done.stderr


def test_bench_plots_joins_runs_at_different_lengths(tmp_path):
    rows = json.loads((DATA / "cpu_bench_1k8k.json").read_text())["rows"]
    (tmp_path / "short.json").write_text(json.dumps({"rows": [r for r in rows if r["context"] < 8192]}))
    (tmp_path / "long.json").write_text(json.dumps({"rows": [r for r in rows if r["context"] == 8192]}))
    done = run("bench_plots.py", str(tmp_path / "short.json"), str(tmp_path / "long.json"), "--out",
               str(tmp_path / "joined.png"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "joined.png").stat().st_size > 0
    done = run("bench_plots.py", str(tmp_path / "short.json"), str(DATA / "cpu_bench_1k8k.json"), "--out",
               str(tmp_path / "twice.png"))
    assert done.returncode != 0 and "is in more than one of" in done.stderr
    assert not (tmp_path / "twice.png").exists()


def test_flop_budget_prints_the_floor_and_the_measured_rows(tmp_path):
    done = run("flop_budget.py", "--context-lengths", "32768", "--bench", str(DATA / "gpu_llama.json"), "--plot",
               str(tmp_path / "floor.png"))
    assert done.returncode == 0, done.stderr[-3000:]
    llama = done.stdout.split("qwen2.5-7b target")[0]
    floor = [line.split("|")[7].strip() for line in llama.splitlines() if line.startswith("| 32768 |")]
    assert floor and 1.0 < float(floor[0]) < 2.0  # ProxyKV adds work, less than a second prefill's
    measured = [line for line in done.stdout.splitlines() if line.startswith("| 32768 | 1.76 |")]
    assert measured  # the bench file's ProxyKV row at 32k, against its floor
    assert (tmp_path / "floor.png").stat().st_size > 0


def test_flop_budget_counts_the_mapper_the_bench_ran(tmp_path):
    """A bench run with ``--mapper-config stride=2048`` (half the encoder windows) is held against its own floor."""
    sbs = json.loads((DATA / "gpu_h200_llama_32k_sbs.json").read_text())
    paper = dict(sbs, env=dict(sbs["env"], mapper_config=[]), rows=[dict(r, flops=None) for r in sbs["rows"]])
    sbs["rows"] = [dict(r, flops=None) for r in sbs["rows"]]  # counted by the script, not read from the rows
    floors = []
    for name, data in (("sbs", sbs), ("paper", paper)):
        (tmp_path / f"{name}.json").write_text(json.dumps(data))
        done = run("flop_budget.py", "--context-lengths", "32768", "--bench", str(tmp_path / f"{name}.json"),
                   "--bench-statistics-passes", "1")
        assert done.returncode == 0, done.stderr[-3000:]
        rows = done.stdout.split("FLOP floor")[1].splitlines()
        floors.append(float(next(line for line in rows if line.startswith("| 32768 |")).split("|")[3]))
    assert floors[0] < floors[1]  # the side-by-side windows' mapper costs less than the paper's overlapping ones


def test_bench_cpu_attention_prints_one_row_per_length():
    done = run("bench_cpu_attention.py", "--lengths", "96", "160", "--repeats", "1", "--chunk-size", "32")
    assert done.returncode == 0, done.stderr
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [r.split(" | ")[0] for r in rows] == ["| 96", "| 160"]
    assert all(r.count("x |") == 3 for r in rows)  # three variants against sdpa


def test_bench_cpu_mapper_prints_one_row_per_length():
    done = run("bench_cpu_mapper.py", "--lengths", "96", "160", "--repeats", "1")
    assert done.returncode == 0, done.stderr
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [r.split(" | ")[0] for r in rows] == ["| 96", "| 160"]
    assert all(r.count("x) |") == 2 for r in rows)  # two bfloat16 variants against float32
    cells = [re.fullmatch(r"([\d.]+) \(([\d.]+)\)", r.rstrip(" |").split(" | ")[-1]) for r in rows]
    overlaps = [float(o) for cell in cells for o in cell.groups()]
    assert len(overlaps) == 4 and all(0.5 < o <= 1.0 for o in overlaps), overlaps  # bfloat16 moves few kept tokens


@pytest.mark.parametrize("script", ["bench_kernel_tiles.py", "bench_gpu_mapper.py", "bench_attention_lse.py"])
def test_gpu_scripts_parse_their_arguments(script):
    """The GPU-only scripts import and parse their arguments without a GPU (they run on one: gpu_benchmarks.sh)."""
    done = run(script, "--help")
    assert done.returncode == 0 and "usage:" in done.stdout, done.stderr[-3000:]
