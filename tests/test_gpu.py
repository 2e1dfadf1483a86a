"""What only a CUDA device can show: a stage trained in bf16 on the GPU (compiled, as `train.compile: auto` does
there), killed and resumed from its cached kernels, and the gauntlet scored there. Deselected by default
(`-m 'not gpu'` in pyproject); run with `pytest -m gpu` on a GPU machine."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

ROOT = Path(__file__).resolve().parents[1]
SEQ, BATCH = 32, 8
STEP = SEQ * BATCH


def _stage_job(root: Path, src: str):
    from tests.support.training import tiny_job, write_job
    from trainers.config import StageConfig

    root.mkdir(parents=True, exist_ok=True)
    stages = [StageConfig(name="s0", tokens=12 * STEP, mixture={"src": 1.0})]
    job = tiny_job(root, {"src": src}, stages, seq_len=SEQ, global_batch_size=BATCH, checkpoint_every_tokens=4 * STEP)
    return job, write_job(job, root / "job.json")


def test_a_bf16_stage_on_cuda_killed_mid_stage_resumes_on_the_same_samples(tmp_path):
    from tests.support.training import model_tensors, run_stage, write_mds
    from trainers.faults import read_sample_log
    from trainers.format.checkpoints import list_complete
    from trainers.progress import parse_preflight

    src = str(write_mds(tmp_path / "src", 12 * BATCH, SEQ, 512, seed=1))
    ref_job, ref_path = _stage_job(tmp_path / "ref", src)
    whole = run_stage(ref_path, 0, env={"TESSERA_SAMPLE_LOG": str(tmp_path / "ref.jsonl")})
    assert whole.returncode == 0, whole.stderr[-3000:]
    # the preflight's probe ran on the GPU (bf16 4096^2 matmuls): tens of TFLOP/s at the least, not a CPU's tens of G
    preflight = next(s for s in map(parse_preflight, whole.stdout.splitlines()) if s is not None)
    assert min(r["matmul_gflops"] for r in preflight["ranks"]) > 20_000, preflight
    assert "compiling 2 decoder blocks (inductor)" in whole.stderr  # train.compile: auto compiles on CUDA

    job, path = _stage_job(tmp_path / "cut", src)
    log = tmp_path / "cut.jsonl"
    killed = run_stage(path, 0, env={"TESSERA_SAMPLE_LOG": str(log), "TESSERA_FAULT": f"step:{6 * STEP}"})
    assert killed.returncode == -9, killed.stderr[-3000:]
    resumed = run_stage(path, 0, env={"TESSERA_SAMPLE_LOG": str(log)})
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    first = next(x for x in resumed.stderr.splitlines() if "first step: compiled for" in x)
    assert " 0 of " not in first.split("from the cache: ")[1], first  # the relaunch loaded its kernels

    # Streaming's position came back from the checkpoint: step for step the same samples as the whole run
    ref, cut = read_sample_log(tmp_path / "ref.jsonl"), read_sample_log(log)
    assert list(cut) == list(ref) == [STEP * i for i in range(1, 13)]
    assert all(cut[t]["samples"] == ref[t]["samples"] for t in ref)
    # bf16 autocast on a GPU is not bitwise reproducible across launches; the losses agree to bf16's precision
    assert all(math.isclose(cut[t]["loss"], ref[t]["loss"], rel_tol=2e-2) for t in ref)
    a = model_tensors(list_complete(ref_job.save_folder)[-1].path)
    b = model_tensors(list_complete(job.save_folder)[-1].path)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k].float(), b[k].float(), rtol=0.05, atol=2e-3), k


def test_the_gauntlet_scores_on_cuda_what_it_scores_on_cpu(tmp_path):
    import transformers

    from evaluation.config import EvalConfig
    from evaluation.runner import run_gauntlet, scoring_device
    from tests.support.gauntlet import cut_demo_tasks
    from tests.support.training import write_hf_tokenizer

    root = cut_demo_tasks(ROOT / "data" / "gauntlet" / "eval" / "local_data", tmp_path / "g", records=24)
    tok = transformers.AutoTokenizer.from_pretrained(write_hf_tokenizer(tmp_path / "tok"))
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4
    )
    model = transformers.LlamaForCausalLM(config).eval()
    cfg = dict(
        every=1,
        tasks=str(ROOT / "configs" / "gauntlet" / "tiny_tasks.yaml"),
        gauntlet=str(ROOT / "configs" / "gauntlet" / "tiny_gauntlet.yaml"),
        data_root=str(root),
    )
    on_cpu = run_gauntlet(model, tok, EvalConfig(**cfg, device="cpu"), 256)
    assert scoring_device(EvalConfig(**cfg)).type == "cuda"  # auto takes the GPU
    on_gpu = run_gauntlet(model, tok, EvalConfig(**cfg), 256)
    assert next(model.parameters()).device.type == "cuda"
    cpu, gpu = on_cpu.metrics(), on_gpu.metrics()
    assert cpu.keys() == gpu.keys() and len(cpu) >= 3
    for k in cpu:  # fp32 on both; a near-tie between two choices may flip, one example in 24 at most
        assert abs(cpu[k] - gpu[k]) <= 1 / 24 + 1e-9, (k, cpu[k], gpu[k])
