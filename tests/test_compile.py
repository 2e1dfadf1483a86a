"""The trainer at GPU speed, tested on CPU: compiled blocks, the fused loss, fused AdamW's choice, padded vocabulary.

Inductor compiles on CPU too (the machines have gcc), so these run the real compiled path; the compiled kernels
are shared by every test through TESSERA_COMPILE_CACHE_DIR (tests/conftest.py), so only the suite's first
compiled launch of each shape pays the tens of seconds a CPU compile costs.

Tolerance of "compiled trains like eager": 1e-5 relative on each step's loss. Inductor fuses RMSNorm, SwiGLU and
the softmax's reductions and so sums fp32 values in another order than eager, which moves the last bits of a
float32 (about 1e-7 relative per op); over these 10 steps the largest difference seen is 4.8e-7. A real
difference (a wrong mask, a missed residual, the loss over the wrong positions) is 1e-2 or more from step one.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from tests.test_train import SEQ, STEP, _job, _launch, _ok
from trainers.config import ModelConfig, StageConfig
from trainers.exit_codes import ExitCode

pytestmark = pytest.mark.slow
WARM = [StageConfig(name="warm", tokens=10 * STEP, mixture={"a": 1.0})]  # 10 steps, checkpoints at 4 and 8


# ---------------------------------------------------------------- fast, in-process


def test_the_fused_loss_is_transformers_loss_with_its_gradients(monkeypatch):
    """trainers/lm_loss.py against LlamaForCausalLM's own loss: the same value and gradients (fp32, 1e-6
    relative), chunked over tokens, with ignored targets, and the model's own forward in eval mode."""
    import trainers.lm_loss as lm_loss
    from trainers.model import build_model

    model = build_model(ModelConfig(), 300, SEQ, 0, seed=3)
    monkeypatch.setattr(lm_loss, "CHUNK_BYTES", 4 * 384 * 40)  # 40 tokens a chunk: 4 chunks of a 4 x 31 batch
    ids = torch.randint(0, 300, (4, SEQ))
    labels = ids.clone()
    labels[1, 5] = -100

    reference = model(input_ids=ids, labels=labels).loss
    reference.backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    lm_loss.use_fused_loss(model)
    out = model(input_ids=ids, labels=labels)
    assert out.logits is None  # training never materialises them
    assert math.isclose(out.loss.item(), reference.item(), rel_tol=1e-6)
    out.loss.backward()
    for name, param in model.named_parameters():
        assert torch.allclose(param.grad, expected[name], rtol=1e-5, atol=1e-7), name
    model.eval()
    assert model(input_ids=ids).logits.shape == (4, SEQ, 384)  # eval keeps the logits (300 padded to 384)


def test_compile_setting_and_the_cache_key(monkeypatch):
    """`auto` compiles on CUDA only; the cache folder's key changes with the code, torch and the device."""
    import trainers.compile as compile_lib

    assert compile_lib.wanted("auto", on_gpu=True) and not compile_lib.wanted("auto", on_gpu=False)
    assert compile_lib.wanted(True, on_gpu=False) and not compile_lib.wanted(False, on_gpu=True)
    key = compile_lib.cache_key()
    assert key == compile_lib.cache_key()
    monkeypatch.setattr(compile_lib, "_code_digest", lambda: "another trainer")
    assert compile_lib.cache_key() != key
    monkeypatch.undo()
    monkeypatch.setattr(torch, "__version__", "9.9.9")
    assert compile_lib.cache_key() != key
    monkeypatch.undo()
    monkeypatch.setattr(compile_lib, "_device_id", lambda: "cuda:NVIDIA H200:sm90:cuda12.8")
    assert compile_lib.cache_key() != key


def test_a_microbatch_size_compiles_once_and_never_again(monkeypatch):
    """Static shapes: each microbatch size (and eval's no-grad pass) is one graph for every block, and going back
    to a size already seen compiles nothing, however often (what `device_microbatch_size: auto` does)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from trainers.compile import compile_blocks
    from trainers.model import build_model

    torch._dynamo.reset()
    counters.clear()
    model = build_model(ModelConfig(n_layers=3), 64, SEQ, 0, seed=1)
    assert compile_blocks(model, backend="aot_eager") == 3

    def step(batch: int) -> None:
        ids = torch.randint(0, 64, (batch, SEQ))
        model(input_ids=ids, labels=ids).loss.backward()

    graphs = lambda: counters["stats"]["unique_graphs"]  # noqa: E731
    step(8)
    assert graphs() == 1  # one graph for the three blocks
    for size, total in ((4, 2), (8, 2), (4, 2), (2, 3), (8, 3), (2, 3), (4, 3)):
        step(size)
        assert graphs() == total, size
    with torch.no_grad():
        model(input_ids=torch.randint(0, 64, (8, SEQ)))
    assert graphs() == 4
    torch._dynamo.reset()


def _failing_backend(gm, example_inputs):
    """A torch.compile backend that cannot compile, as inductor fails on a GPU Triton does not support."""
    raise RuntimeError("Found NVIDIA GH-42 which is too old to be supported by the triton GPU compiler")


def test_a_failure_to_compile_trains_eager_under_auto_and_is_one_fatal_line_under_true(caplog):
    """The compile guard (trainers/compile.Guard) with a backend that raises, through compile_blocks' and
    use_fused_loss' own seam: `auto` warns once, tags the run through `on_fallback`, keeps the heartbeat's phase,
    and trains with the loss and gradients of the eager model; `true` is one fatal line and nothing trained."""
    import logging

    import torch._dynamo

    import trainers.lm_loss as lm_loss
    from trainers.compile import Guard, compile_blocks, watch
    from trainers.exit_codes import FatalError
    from trainers.model import build_model

    ids = torch.randint(0, 64, (4, SEQ))
    eager = build_model(ModelConfig(n_layers=2), 64, SEQ, 0, seed=1)
    lm_loss.use_fused_loss(eager)
    reference = eager(input_ids=ids, labels=ids).loss
    reference.backward()

    torch._dynamo.reset()
    watch()
    caplog.set_level(logging.WARNING, logger="tessera.compile")
    tagged: list[str] = []
    guard = Guard(fatal=False)
    guard.on_fallback = tagged.append
    model = build_model(ModelConfig(n_layers=2), 64, SEQ, 0, seed=1)
    assert compile_blocks(model, _failing_backend, guard) == 2
    lm_loss.use_fused_loss(model, guard)
    for _ in range(2):  # the second step goes straight to eager: one warning, one tag
        model.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
    assert torch.equal(loss, reference)
    for (name, ours), theirs in zip(model.named_parameters(), eager.parameters(), strict=True):
        assert torch.equal(ours.grad, theirs.grad), name
    assert guard.fallback is not None and "too old to be supported by the triton GPU compiler" in guard.fallback
    assert tagged == [guard.fallback] and "\n" not in guard.fallback
    warned = [r.getMessage() for r in caplog.records if r.name == "tessera.compile"]
    assert warned == [f"train.compile is auto and compiling failed, so this launch trains eager: {guard.fallback}"]
    assert watch()._started is None  # the compile phase ended with the failed compile

    torch._dynamo.reset()
    strict = Guard(fatal=True)
    model = build_model(ModelConfig(n_layers=2), 64, SEQ, 0, seed=1)
    compile_blocks(model, _failing_backend, strict)
    with pytest.raises(FatalError) as refused:
        model(input_ids=ids, labels=ids)
    line = str(refused.value)
    assert line.startswith("train.compile is true and compiling failed: BackendCompilerFailed: ") and "\n" not in line
    assert "too old to be supported" in line and strict.fallback is None
    assert not [p for p in model.parameters() if p.grad is not None]
    torch._dynamo.reset()


# ---------------------------------------------------------------- real launches


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    from tests.support.training import two_sources

    return two_sources(tmp_path_factory.mktemp("data"), SEQ)


def _stage0(root: Path, sources, fault: str | None = None, **kw):
    root.mkdir(parents=True, exist_ok=True)
    job, path = _job(root, sources, stages=WARM, **kw)
    env = {"TESSERA_HEARTBEAT_DIR": str(root / "beats")}
    return job, _launch(path, 0, root / "samples.jsonl", fault=fault, env=env)


def _losses(root: Path) -> dict[int, float]:
    from trainers.faults import read_sample_log

    return {t: r["loss"] for t, r in read_sample_log(root / "samples.jsonl").items()}


def _final(job) -> Path:
    from trainers.format.checkpoints import list_complete

    return Path(list_complete(job.save_folder)[-1].path)


def _weights(path: Path) -> dict:
    from trainers.format.safe_load import load

    state = load(path)["state"]
    return {**state["model"], **{f"opt.{k}": v for k, v in _flat(state["optimizers"]).items()}}


def _flat(tree, prefix: str = "") -> dict:
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in _flat(sub, f"{prefix}{key}.").items()}
    return {prefix: tree} if isinstance(tree, torch.Tensor) else {}


@pytest.fixture(scope="module")
def eager(tmp_path_factory, sources):
    job, proc = _stage0(tmp_path_factory.mktemp("eager"), sources)
    _ok(proc)
    return job


@pytest.fixture(scope="module")
def compiled(tmp_path_factory, sources):
    root = tmp_path_factory.mktemp("compiled")
    job, proc = _stage0(root, sources, compile=True)
    _ok(proc)
    return job, root, proc


def test_compiled_training_matches_eager_and_compiling_is_its_own_phase(eager, compiled):
    """The tiny model compiled trains as it does eager (losses within 1e-5, see above); the heartbeat's `compile`
    phase holds the compile, and the goodput ledger counts it apart from startup and productive steps."""
    from tasks.training.goodput import _launch_buckets
    from trainers import time_records

    job, root, proc = compiled
    mine, theirs = _losses(root), _losses(Path(eager.save_folder).parent)
    assert list(mine) == list(theirs) == [STEP * k for k in range(1, 11)]
    for tokens in mine:
        assert math.isclose(mine[tokens], theirs[tokens], rel_tol=1e-5), tokens
    assert "compiling 2 decoder blocks (inductor)" in proc.stderr
    assert "first step: compiled for" in proc.stderr

    records = time_records.read(job.save_folder, job.run_name)
    assert records and records[-1]["final"]
    phases = records[-1]["phases"]
    assert phases["compile"] > 0 and phases["step"] > 0
    eager_phases = time_records.read(eager.save_folder, eager.run_name)[-1]["phases"]
    assert eager_phases["compile"] == 0
    launch = {"started": records[-1]["process_start"], "ended": records[-1]["at"], "kind": "ok"}
    buckets = _launch_buckets(launch, records)
    assert buckets["compile"] == phases["compile"]
    assert buckets["productive"] == pytest.approx(phases["data"] + phases["step"])


def test_a_compiled_stage_killed_mid_stage_resumes_bitwise_with_its_kernels_cached(tmp_path, sources, compiled):
    """kill -9 after step 6 (checkpoint at 4), relaunch: the final checkpoint (weights and AdamW's moments) is bit
    for bit the uninterrupted compiled run's, and the relaunch loaded its graphs from the cache."""
    reference, _, _ = compiled
    job, proc = _stage0(tmp_path / "run", sources, fault=f"step:{6 * STEP}", compile=True)
    assert proc.returncode == -9, proc.stderr[-3000:]
    job, proc = _stage0(tmp_path / "run", sources, compile=True)
    _ok(proc)
    assert f"resume at {4 * STEP} tokens" in proc.stderr
    line = next(x for x in proc.stderr.splitlines() if "first step: compiled for" in x)
    hits, graphs = (int(n) for n in line.split("from the cache: ")[1].split(" graphs")[0].split(" of "))
    assert graphs > 0 and hits == graphs, line
    mine, theirs = _weights(_final(job)), _weights(_final(reference))
    assert mine.keys() == theirs.keys() and any("exp_avg_sq" in k for k in mine)
    different = [k for k in mine if not torch.equal(mine[k], theirs[k])]
    assert not different, different[:5]


def test_a_run_begun_without_padding_keeps_its_rows_and_another_padding_is_refused(tmp_path, sources):
    """A run whose checkpoints have exactly the tokenizer's 500 rows (written before padding, or with
    vocab_multiple 1) resumes under the default padding with its 500 rows, bit for bit as if never interrupted;
    a recipe whose padding gives other rows (600) is refused in one line naming both."""
    from trainers.format.export import embedding_rows

    common = {"vocab_size": 500, "val_streams": {}, "val_batches": 0}
    unpadded = ModelConfig(vocab_multiple=1)
    reference, proc = _stage0(tmp_path / "ref", sources, model=unpadded, **common)
    _ok(proc)
    job, proc = _stage0(tmp_path / "run", sources, fault=f"step:{6 * STEP}", model=unpadded, **common)
    assert proc.returncode == -9
    job, proc = _stage0(tmp_path / "run", sources, **common)  # the default: 128, i.e. 512 rows for a new run
    _ok(proc)
    assert "run tiny began without vocabulary padding: it keeps its 500 rows" in proc.stderr
    assert embedding_rows(_final(job)) == 500
    mine, theirs = _weights(_final(job)), _weights(_final(reference))
    assert all(torch.equal(mine[k], theirs[k]) for k in theirs)

    fresh, proc = _stage0(tmp_path / "new", sources, fault=f"step:{6 * STEP}", **common)
    assert proc.returncode == -9
    assert embedding_rows(_final(fresh)) == 512

    _, proc = _stage0(tmp_path / "new", sources, model=ModelConfig(vocab_multiple=200), **common)
    assert proc.returncode == ExitCode.FATAL
    lines = [x for x in proc.stderr.splitlines() if "vocabulary rows" in x]
    assert len(lines) == 1 and "Traceback" not in proc.stderr
    assert (
        "the checkpoint has 512 vocabulary rows but the recipe builds 600 (the tokenizer's 500 ids padded" in lines[0]
    )


def test_init_from_a_model_without_padding_pads_it_and_refuses_another_vocabulary(tmp_path):
    """Continued pretraining from a version registered before padding: the same 500 ids, so its rows are copied
    and the 12 padding rows start at zero; a source of another vocabulary is refused naming both shapes."""
    from trainers.exit_codes import FatalError
    from trainers.model import build_model, load_weights_from

    build_model(ModelConfig(vocab_multiple=1), 500, SEQ, 0, seed=1).save_pretrained(tmp_path / "old")
    model = load_weights_from(build_model(ModelConfig(), 500, SEQ, 0, seed=2), str(tmp_path / "old"), vocab_size=500)
    source = build_model(ModelConfig(vocab_multiple=1), 500, SEQ, 0, seed=1)
    embed = model.get_input_embeddings().weight
    assert embed.shape[0] == 512 and torch.equal(embed[:500], source.get_input_embeddings().weight)
    assert not embed[500:].any()
    with pytest.raises(FatalError, match=r"has 500 vocabulary rows but the recipe builds 640 \(its tokenizer's 600"):
        load_weights_from(build_model(ModelConfig(), 600, SEQ, 0, seed=2), str(tmp_path / "old"), vocab_size=600)


def test_the_gauntlet_never_scores_or_emits_a_padded_id(tmp_path):
    """A padded head's extra rows made the most likely tokens: generation and scoring still see only the
    tokenizer's ids, the export suppresses them for every later loader, and a head smaller than its tokenizer is
    refused in one line."""
    from transformers import PreTrainedTokenizerFast

    from evaluation.runner import tokenizer_rows_only, vocabulary_mismatch
    from tests.support.test_tokenizer import PATH
    from trainers.format.export import never_emit_padding
    from trainers.model import build_model

    tok = PreTrainedTokenizerFast(tokenizer_file=str(PATH), eos_token="<|endoftext|>", pad_token="<|padding|>")
    model = build_model(ModelConfig(vocab_multiple=100), len(tok), SEQ, 0, seed=1).eval()

    def padded_rows_dominate(_module, _args, logits):  # as an untrained head's padding could
        return torch.cat([logits[..., : len(tok)], logits[..., len(tok) :] + 1000.0], dim=-1)

    model.get_output_embeddings().register_forward_hook(padded_rows_dominate)
    ids = torch.tensor([tok.encode("Once upon a time")])
    assert model.generate(ids, max_new_tokens=3, do_sample=False)[0, -1] >= len(tok)  # as it would, unmasked
    with tokenizer_rows_only(model, tok):
        out = model.generate(ids, max_new_tokens=3, do_sample=False)
        assert model(input_ids=ids).logits.shape[-1] == len(tok)
    assert (out < len(tok)).all()
    never_emit_padding(model, tok)
    model.save_pretrained(tmp_path / "hf")
    saved = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    assert saved["suppress_tokens"] == list(range(len(tok), 4100))
    assert (model.generate(ids, max_new_tokens=3, do_sample=False) < len(tok)).all()
    small = build_model(ModelConfig(), 100, SEQ, 0, seed=1)
    assert vocabulary_mismatch(small, tok) == f"the model has 128 vocabulary rows but its tokenizer has {len(tok)} ids"
