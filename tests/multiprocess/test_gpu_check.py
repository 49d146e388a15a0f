"""`dspark-ds gpu-check`: every part on the CPU (what CI can run of it), its PASS / FAIL lines,
summary and exit codes. (On a GPU node: `dspark-ds gpu-check`, see docs/performance.md.)"""

from __future__ import annotations

import json

import pytest
import torch

from dspark_ds.cli import main as cli_main
from dspark_ds.perf import gpu_check

from helpers.dist import check, python


@pytest.mark.slow
def test_every_part_passes_on_cpu(tmp_path):
    from helpers.vllm_serving import require_vllm

    require_vllm()
    argv = ["-m", "dspark_ds.cli", "gpu-check", "--device", "cpu", "--output_dir", str(tmp_path)]
    argv += ["--bench_repeats", "1", "--num_prompts", "2"]
    proc = check(python(argv, timeout_s=600))
    lines = proc.stdout.splitlines()
    status = {line.split()[1]: line.split()[0] for line in lines if line[:4] in ("PASS", "FAIL")}
    # vllm: the export through vLLM's config validation and loader (tools/install.sh's vLLM)
    assert status == {
        "bench": "PASS",
        "train": "PASS",
        "export": "PASS",
        "decode": "PASS",
        "vllm": "PASS",
    }, proc.stdout[-3000:]
    assert "gpu-check: 5/5 parts passed" in lines[-1]
    vllm = next(line for line in lines if line.startswith("PASS  vllm"))
    assert "Qwen3DSparkForCausalLM took all" in vllm and "needs a GPU (V2 runner)" in vllm
    train = next(line for line in lines if line.startswith("PASS  train"))
    assert "ZeRO-3 fp32, optimizer AdamW, 20 steps" in train, train
    assert "2/2 prompts equal to greedy generate on cpu" in proc.stdout
    [work] = list(tmp_path.glob("gpu_check_*"))
    bench = json.loads((work / "bench.json").read_text())
    assert [r["variant"] for r in bench] == ["blockwise/chunked", "dense/reference"]


def test_the_train_part_reads_the_optimizer_from_the_trainers_status_line():
    """On a GPU the train part passes only with DeepSpeed's FusedAdam, read from the trainer's
    first status line, which starts with the time and the rank like every status line."""
    from dspark_ds import logs

    line = "[train] dspark: ZeRO-3, loss recompute, optimizer FusedAdam, world size 8"
    stdout = (
        "DeepSpeed info\n" + logs.format_lines(line, 0) + logs.format_lines("[train] step 1", 0)
    )
    assert gpu_check.trainer_optimizer(stdout) == "FusedAdam"
    assert gpu_check.trainer_optimizer(line) == "FusedAdam"
    assert gpu_check.trainer_optimizer("no status line\n") == "?"


def test_a_failed_part_fails_the_check_and_skips_what_depends_on_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(
        gpu_check, "part_bench", lambda cfg, work: gpu_check.PartResult("bench", True, "ok")
    )

    def broken_train(cfg, work, target):
        raise RuntimeError("NCCL error")

    monkeypatch.setattr(gpu_check, "part_train", broken_train)
    cfg = gpu_check.GpuCheckConfig(device="cpu", output_dir=str(tmp_path))
    with pytest.raises(SystemExit) as exc:
        gpu_check.run_gpu_check(cfg)
    assert exc.value.code == 1
    out = capsys.readouterr().out
    assert "PASS  bench" in out and "FAIL  train" in out and "RuntimeError: NCCL error" in out
    assert "FAIL  export" in out and "skipped: train failed" in out
    # where vLLM is importable its part comes last, skipped once the export failed
    from dspark_ds.serve.check import vllm_python

    if vllm_python() is None:
        assert "no vllm part" in out and "gpu-check: 1/4 parts passed" in out
    else:
        assert "FAIL  vllm" in out and "skipped: export failed" in out
        assert "gpu-check: 1/5 parts passed" in out
    monkeypatch.setattr("dspark_ds.serve.check.vllm_python", lambda explicit=None: None)
    with pytest.raises(SystemExit):
        gpu_check.run_gpu_check(
            gpu_check.GpuCheckConfig(device="cpu", output_dir=str(tmp_path / "b"))
        )
    out = capsys.readouterr().out
    assert "vLLM is not importable here: no vllm part" in out
    assert "gpu-check: 1/4 parts passed" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_cuda_without_a_gpu_exits_2(tmp_path, capsys):
    assert cli_main(["gpu-check", "--output_dir", str(tmp_path)]) == 2
    assert "device: cuda, but torch sees no GPU" in capsys.readouterr().err
    assert cli_main(["gpu-check", "--device", "tpu"]) == 2
    assert "device: cuda or cpu" in capsys.readouterr().err
