"""benchmarks/gpu_checks.py, the GPU proof in one run, run here as `--dry-run` (tiny sizes on the CPU, the
CUDA-only peers skipped with one line each), so the script cannot rot between the rare runs on a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
from gpu_checks import STEPS  # noqa: E402


def _run(tmp_path: Path, *arguments: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
    out = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")]))
    env.pop("GPU_CHECKS_STEP", None)
    done = subprocess.run([sys.executable, "benchmarks/gpu_checks.py", *arguments, "--dry-run", "--out", str(out),
                           "--site", str(tmp_path / "site")], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=900)
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    return done, records


@pytest.mark.slow
def test_dry_run_runs_every_step_and_writes_each_ones_figures(tmp_path: Path) -> None:
    done, records = _run(tmp_path, "all")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    steps = [r for r in records if r["kind"] == "step"]
    assert [r["step"] for r in steps] == [step.name for step in STEPS]  # one record per step, in order
    assert all(r["status"] == "ok" and r["exit_code"] == 0 for r in steps), steps
    kinds: dict[str, set[str]] = {}
    for record in records:
        kinds.setdefault(record["step"], set()).add(record["kind"])
    assert "env" in kinds["env"]
    assert {"loss", "loss_tile", "loss_tile_choice", "loss_profile", "loss_multi_positive", "skipped"} <= kinds["loss"]
    assert "towers" in kinds["towers-siglip2-base"] and "towers" in kinds["towers-base"]
    assert kinds["towers-ViT-B-16"] & {"towers", "skipped"}  # measured, or one line: create_model does not know it
    assert {"window", "window_ratio"} <= kinds["window"]
    assert "objective" in kinds["objectives"]
    assert "skipped" in kinds["tests"] or "passed" in steps[1]["last_line"] or "skipped" in steps[1]["last_line"]
    # the loss step: ours and OpenCLIP side by side, each peer either measured or skipped with its reason
    loss = [r for r in records if r["step"] == "loss" and r["kind"] == "loss"]
    assert {r["impl"] for r in loss} >= {"ours", "ours, fp32 features", "OpenCLIP ClipLoss", "OpenCLIP SigLipLoss"}
    assert all(r["status"] == "ok" and r["seconds"] > 0 for r in loss)
    checked = [r for r in loss if "loss_rel_diff" in r]  # the first size: every implementation against ours, fp32
    assert checked and all(r["loss_rel_diff"] < 2e-2 and r["grad_rel_diff"] < 2e-2 for r in checked)
    skipped = {r["what"].split(" (")[0]: r["reason"] for r in records if r["step"] == "loss" and r["kind"] == "skipped"}
    for peer in ("siglip-kernel", "Inf-CL", "memeff", "siglip-kernel SigLIP+"):
        assert "needs CUDA" in skipped[peer] or "not installed" in skipped[peer], skipped
    objectives = {r["objective"]: r for r in records if r["kind"] == "objective"}
    assert set(objectives) >= {"plain window", "LiT (--lock-image)", "distillation (--distill-model)",
                               "multi-positive (--multi-positive, 2 captions per image)"}
    windows = {r["pairs"]: r for r in records if r["kind"] == "window"}
    assert set(windows) == {512, 128} and all(r["status"] == "ok" for r in windows.values())
    markdown = (tmp_path / "out" / "results.md").read_text()
    assert "## summary" in markdown and "| loss |" in markdown
    # three files and nothing else: a GPU machine that hands back only a few files returns them all
    assert sorted(path.name for path in (tmp_path / "out").iterdir()) == ["results.jsonl", "results.md", "steps.log"]


@pytest.mark.slow
def test_a_step_past_its_limit_is_stopped_and_the_next_one_runs(tmp_path: Path) -> None:
    done, records = _run(tmp_path, "loss", "objectives", "--limit", "loss=0.5")
    steps = {r["step"]: r for r in records if r["kind"] == "step"}
    assert steps["loss"]["status"] == "timeout" and steps["objectives"]["status"] == "ok", steps
    assert done.returncode == 1  # not every step ok
    assert any(r["kind"] == "objective" for r in records)
