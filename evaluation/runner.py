"""run_gauntlet: the task list and gauntlet YAMLs, a model and a tokenizer in; a GauntletReport out."""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import torch

from evaluation.aggregate import aggregate, benchmark_score
from evaluation.batching import Throughput, pad_id_of
from evaluation.config import EvalConfig
from evaluation.errors import GauntletError
from evaluation.generation import generate_items, generation_correct
from evaluation.progress import EvalProgress
from evaluation.prompts import PreparedSplit, Record, prepare_split, validate_records
from evaluation.report import GauntletReport, TaskResult
from evaluation.scoring import score_choice_items
from evaluation.sources import exists, read_jsonl, resolve
from evaluation.spec import GauntletSpec, TaskSpec, load_gauntlet, load_tasks

log = logging.getLogger(__name__)


def _partitions(task: TaskSpec, records: list[Record]) -> dict[str | None, list[Record]]:
    """llm-foundry scores each `category` as its own dataset (own few-shot pool and seed), sorted by name."""
    if not task.has_categories:
        return {None: records}
    groups: dict[str, list[Record]] = defaultdict(list)
    for r in records:
        groups[r.data["category"]].append(r)
    return {k: groups[k] for k in sorted(groups)}


def score_split(
    model: Any,
    tokenizer: Any,
    task: TaskSpec,
    split: PreparedSplit,
    batch_size: int,
    on_batch: Callable[[int], None] | None = None,
) -> tuple[list[bool], Throughput]:
    """Whether the model got each example of the split right, in the split's order."""
    pad = pad_id_of(tokenizer)
    if split.kind == "generation_task_with_answers":
        outputs, stats = generate_items(
            model,
            tokenizer,
            split.generation_items,
            batch_size,
            pad,
            split.max_new_tokens,
            task.early_stopping_criteria,
            on_batch,
        )
        hits = [
            generation_correct(o, it.answers, task.early_stopping_criteria, task.cot_delimiter, task.do_normalization)
            for o, it in zip(outputs, split.generation_items)
        ]
    else:
        hits, stats = score_choice_items(model, split.choice_items, batch_size, pad, split.kind, on_batch=on_batch)
    return [bool(h) for h in hits], stats


def _find_files(tasks: list[TaskSpec], cfg: EvalConfig) -> tuple[dict[str, str], dict[str, str]]:
    """Task label -> resolved uri for tasks to run; label -> reason for tasks skipped."""
    found, skipped, missing = {}, {}, []
    for t in tasks:
        if t.icl_task_type == "code_evaluation":
            skipped[t.label] = "code_evaluation is not supported: it needs sandboxed code execution"
            continue
        uri = resolve(cfg.data_root, t.dataset_uri)
        if exists(uri):
            found[t.label] = uri
        else:
            missing.append(f"{t.label} ({uri})")
            skipped[t.label] = "task file missing"
    if missing:
        msg = f"{len(missing)} task file(s) missing: {', '.join(missing)}"
        if cfg.strict:
            raise GauntletError(f"strict: {msg}")
        log.warning(msg + "; skipped")
    for label, why in skipped.items():
        if why.startswith("code_evaluation"):
            log.warning("task '%s' skipped: %s", label, why)
    return found, skipped


def scoring_device(cfg: EvalConfig) -> torch.device:
    """The device `cfg.device` names; `auto` takes the GPU when there is one, since the gauntlet is forward
    passes only and a CPU takes hours over what a GPU scores in minutes."""
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise GauntletError("eval.device: cuda, but this machine has no CUDA device (use auto or cpu)")
    use_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    return torch.device("cuda") if use_cuda else torch.device("cpu")


def run_gauntlet(model: Any, tokenizer: Any, cfg: EvalConfig, max_seq_len: int) -> GauntletReport:
    """Score a transformers causal LM on `cfg.tasks`, aggregated by `cfg.gauntlet` when given.

    The model is moved (in place, as nn.Module.to does) to the device `cfg.device` names."""
    tasks = load_tasks(cfg.tasks)
    spec: GauntletSpec | None = load_gauntlet(cfg.gauntlet) if cfg.gauntlet else None
    model = model.to(scoring_device(cfg))
    with tokenizer_rows_only(model, tokenizer):
        return run_tasks(model, tokenizer, tasks, spec, cfg, max_seq_len)


def vocabulary_mismatch(model: Any, tokenizer: Any) -> str | None:
    """Why `model` cannot be scored with `tokenizer`'s ids, or None: its head must have a row for every id."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None or not hasattr(head, "weight"):
        return None
    rows, ids = int(head.weight.shape[0]), len(tokenizer)
    if rows < ids:
        return f"the model has {rows} vocabulary rows but its tokenizer has {ids} ids"
    return None


@contextmanager
def tokenizer_rows_only(model: Any, tokenizer: Any) -> Iterator[None]:
    """While scoring, the head's output keeps only the tokenizer's ids: a model whose vocabulary is padded
    (ModelConfig.vocab_rows) can never score or emit a padded id, since no logit of one exists. Every
    forward goes through the head, the scored positions' and `generate`'s alike."""
    why = vocabulary_mismatch(model, tokenizer)
    if why is not None:
        raise GauntletError(why)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    ids = len(tokenizer)
    if head is None or int(head.weight.shape[0]) == ids:
        yield
        return
    handle = head.register_forward_hook(lambda _module, _args, logits: logits[..., :ids])
    try:
        yield
    finally:
        handle.remove()


def run_tasks(
    model: Any, tokenizer: Any, tasks: list[TaskSpec], spec: GauntletSpec | None, cfg: EvalConfig, max_seq_len: int
) -> GauntletReport:
    seq_len = cfg.max_seq_len or max_seq_len
    found, skipped = _find_files(tasks, cfg)
    # Read and check every file before scoring anything: a bad line fails in seconds, not after an hour.
    loaded: dict[str, list[Record]] = {}
    for task in tasks:
        if task.label in found:
            loaded[task.label] = validate_records(task, found[task.label], read_jsonl(found[task.label]))
            if not loaded[task.label]:
                skipped[task.label] = "task file has no records"
                del loaded[task.label]
    was_training = getattr(model, "training", False)
    model.eval()
    results: list[TaskResult] = []
    total = Throughput()
    progress = EvalProgress(sum(len(loaded[t.label]) * len(t.num_fewshot) for t in tasks if t.label in loaded))
    try:
        for task in tasks:
            if task.label not in loaded:
                continue
            progress.start_task(task.label)
            uri = found[task.label]
            parts = _partitions(task, loaded[task.label])
            for n in task.num_fewshot:
                per_cat: dict[str, float] = {}
                hits: dict[str, str] = {}
                accs, count = [], 0
                for cat, recs in parts.items():
                    split = prepare_split(
                        task,
                        uri,
                        recs,
                        tokenizer,
                        n,
                        task.max_seq_len or seq_len,
                        cfg.seed if task.fewshot_random_seed is None else task.fewshot_random_seed,
                        cat,
                    )
                    correct, stats = score_split(
                        model, tokenizer, task, split, task.batch_size or cfg.batch_size, progress.advance
                    )
                    acc = sum(correct) / len(correct) if correct else 0.0
                    # every example's outcome, so two models scored on the same examples can be compared
                    # example by example (evaluation/noise.py)
                    hits[cat or ""] = "".join("1" if c else "0" for c in correct)
                    total.add(stats)
                    accs.append(acc)
                    count += len(split)
                    if cat is not None:
                        per_cat[cat] = acc
                # The reference's benchmark score of a categorized task is the plain mean over categories.
                results.append(
                    TaskResult(task.label, n, task.icl_task_type, sum(accs) / len(accs), count, per_cat, hits=hits)
                )
                log.info("%s/%d-shot: %.4f over %d examples", task.label, n, results[-1].accuracy, count)
    finally:
        progress.close()
        if was_training:
            model.train()

    return assemble_report(results, spec, skipped, total)


def assemble_report(
    results: list[TaskResult],
    spec: GauntletSpec | None,
    skipped: dict[str, str] | None = None,
    total: Throughput | None = None,
) -> GauntletReport:
    """The report of scored tasks: each benchmark's score, and the categories and averages of `spec`."""
    total = total or Throughput()
    report = GauntletReport(
        tasks=results, skipped=skipped or {}, examples=total.examples, tokens=total.tokens, seconds=total.seconds
    )
    if spec is not None:
        scores = aggregate(
            spec,
            {(t.label, t.num_fewshot): t.accuracy for t in results},
            {(t.label, t.num_fewshot): t.examples for t in results},
        )
        baselines = {(b.name, b.num_fewshot): b.random_baseline for c in spec.categories for b in c.benchmarks}
        report.tasks = [
            replace(
                t,
                random_baseline=baselines[k],
                score=benchmark_score(t.accuracy, baselines[k], spec.subtract_random_baseline, spec.rescale_accuracy),
            )
            if (k := (t.label, t.num_fewshot)) in baselines
            else t
            for t in results
        ]
        report.categories, report.averages, report.benchmarks = scores.categories, scores.averages, scores.benchmarks
        report.warnings = scores.warnings
        report.gauntlet = spec.model_dump(mode="json")
    return report
