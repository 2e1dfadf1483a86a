"""The Mosaic YAMLs load unchanged; bad input fails with one line naming file+line or task+field."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from evaluation.config import EvalConfig
from evaluation.errors import GauntletError
from evaluation.prompts import validate_records
from evaluation.runner import run_gauntlet
from evaluation.sources import read_jsonl
from evaluation.spec import TaskSpec, load_gauntlet, load_tasks, parse_gauntlet, parse_tasks

ROOT = Path(__file__).resolve().parents[1]
YAML_DIRS = [ROOT.parent / "shared" / "data" / "eval_gauntlet" / "yamls", ROOT / "data" / "gauntlet" / "yamls"]
REAL_YAMLS = sorted({p.name: p for d in YAML_DIRS if d.is_dir() for p in d.glob("*.yaml")}.values())


@pytest.mark.parametrize("path", REAL_YAMLS, ids=lambda p: p.name)
def test_reference_yamls_load_unchanged(path):
    if path.name.startswith("eval_gauntlet"):
        spec = load_gauntlet(str(path))
        assert spec.categories and all(c.benchmarks for c in spec.categories)
    else:
        tasks = load_tasks(str(path))
        assert tasks and all(t.dataset_uri.startswith("eval/local_data/") for t in tasks)


def test_real_task_files_parse_including_u0085(tmp_path):
    # the project ships a byte-for-byte copy of the gauntlet's task files (data/SOURCES.md)
    path = ROOT / "data" / "gauntlet" / "eval" / "local_data" / "world_knowledge" / "triviaqa_sm_sub.jsonl"
    records = read_jsonl(str(path))
    assert len(records) == 3000  # str.splitlines() would have broken the U+0085 record in two
    assert any("\u0085" in json.dumps(r, ensure_ascii=False) for _, r in records)


def test_malformed_jsonl_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"context": "a", "continuation": "b"}\n\n{"context": "c", "continuation": \n')
    with pytest.raises(GauntletError) as err:
        read_jsonl(str(path))
    assert f"{path}:3: malformed JSON" in str(err.value) and "\n" not in str(err.value)


def test_wrong_field_names_the_task_and_field():
    task = TaskSpec(label="copa", dataset_uri="x.jsonl", num_fewshot=[0], icl_task_type="multiple_choice")
    with pytest.raises(GauntletError, match=r"task 'copa': x.jsonl:2: missing field 'query'"):
        validate_records(task, "x.jsonl", [(1, {"query": "q", "choices": ["a"], "gold": 0}), (2, {"question": "q"})])
    with pytest.raises(GauntletError, match=r"task 'copa': x.jsonl:1: field 'gold' is 3"):
        validate_records(task, "x.jsonl", [(1, {"query": "q", "choices": ["a", "b"], "gold": 3})])


def test_yaml_errors_name_the_task_and_field():
    with pytest.raises(GauntletError) as err:
        parse_tasks({"icl_tasks": [{"label": "x", "dataset_uri": "a", "num_fewshot": [0], "icl_task_type": "essay"}]})
    assert "'essay'" in str(err.value) and "language_modeling" in str(err.value) and "schema" in str(err.value)
    with pytest.raises(GauntletError, match=r"task 'x': field 'num_fewshots'"):
        parse_tasks(
            {
                "icl_tasks": [
                    {
                        "label": "x",
                        "dataset_uri": "a",
                        "num_fewshots": [0],
                        "num_fewshot": [0],
                        "icl_task_type": "schema",
                    }
                ]
            }
        )
    with pytest.raises(GauntletError, match="rescale_accuracy requires subtract_random_baseline"):
        parse_gauntlet({"eval_gauntlet": {"subtract_random_baseline": False, "categories": []}})


def _tiny_tasks(tmp_path: Path) -> Path:
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "lm.jsonl").write_text('{"context": "a", "continuation": "b"}\n')
    tasks = tmp_path / "tasks.yaml"
    tasks.write_text(
        "icl_tasks:\n"
        "- {label: lm, dataset_uri: data/lm.jsonl, num_fewshot: [0], icl_task_type: language_modeling}\n"
        "- {label: gone, dataset_uri: data/gone.jsonl, num_fewshot: [0], icl_task_type: language_modeling}\n"
        "- {label: code, dataset_uri: data/lm.jsonl, num_fewshot: [0], icl_task_type: code_evaluation}\n"
    )
    return tasks


def test_missing_task_file_is_skipped_with_a_warning_or_fails_under_strict(tmp_path, caplog):
    from tests.support.gauntlet import bigram_model, word_tokenizer

    tok = word_tokenizer(["a", "b"])
    model = bigram_model(tok, {"a": "b"})
    cfg = EvalConfig(every=1, tasks=str(_tiny_tasks(tmp_path)), data_root=str(tmp_path))
    with caplog.at_level(logging.WARNING):
        report = run_gauntlet(model, tok, cfg, max_seq_len=16)
    assert [t.key for t in report.tasks] == ["lm/0-shot"] and report.tasks[0].accuracy == 1.0
    assert report.skipped["gone"] == "task file missing" and "code_evaluation" in report.skipped["code"]
    assert "gone" in caplog.text and "gone.jsonl" in caplog.text
    with pytest.raises(GauntletError, match=r"strict: 1 task file\(s\) missing: gone"):
        run_gauntlet(model, tok, cfg.model_copy(update={"strict": True}), max_seq_len=16)


def test_has_categories_scores_each_category_then_averages(tmp_path):
    from tests.support.gauntlet import bigram_model, word_tokenizer

    tok = word_tokenizer(["x", "y", "z"])
    model = bigram_model(tok, {"x": "y"})  # "x" -> "y" is right, "x" -> "z" is wrong
    rows = [("a", "y"), ("a", "z"), ("a", "z"), ("b", "y")]  # category a: 1/3, category b: 1/1
    (tmp_path / "cat.jsonl").write_text(
        "\n".join(json.dumps({"context": "x", "continuation": c, "category": k}) for k, c in rows) + "\n"
    )
    (tmp_path / "tasks.yaml").write_text(
        "icl_tasks:\n- {label: cat, dataset_uri: cat.jsonl, num_fewshot: [0], icl_task_type: language_modeling,"
        " has_categories: true}\n"
    )
    report = run_gauntlet(
        model, tok, EvalConfig(every=1, tasks=str(tmp_path / "tasks.yaml"), data_root=str(tmp_path)), 16
    )
    (result,) = report.tasks
    assert result.categories == {"a": pytest.approx(1 / 3), "b": 1.0}
    assert result.accuracy == pytest.approx((1 / 3 + 1) / 2)  # mean of categories, not of examples
    assert report.metrics()["icl/cat/0-shot/a"] == pytest.approx(1 / 3)
    assert report.average == pytest.approx(2 / 3)  # no gauntlet: mean task score


@pytest.fixture()
def s3_bucket(moto_s3):
    moto_s3.create_bucket(Bucket="evals")
    return moto_s3


def test_task_files_and_yamls_resolve_under_an_s3_root(s3_bucket, tmp_path):
    from tests.support.gauntlet import bigram_model, word_tokenizer

    tok = word_tokenizer(["a", "b"])
    s3_bucket.put_object(Bucket="evals", Key="g/eval/lm.jsonl", Body=b'{"context": "a", "continuation": "b"}\n')
    s3_bucket.put_object(
        Bucket="evals",
        Key="g/tasks.yaml",
        Body=b"icl_tasks:\n- {label: lm, dataset_uri: eval/lm.jsonl, num_fewshot: [0], "
        b"icl_task_type: language_modeling}\n"
        b"- {label: gone, dataset_uri: eval/gone.jsonl, num_fewshot: [0], icl_task_type: language_modeling}\n",
    )
    cfg = EvalConfig(every=1, tasks="s3://evals/g/tasks.yaml", data_root="s3://evals/g")
    report = run_gauntlet(bigram_model(tok, {"a": "b"}), tok, cfg, 16)
    assert [(t.key, t.accuracy) for t in report.tasks] == [("lm/0-shot", 1.0)]
    assert report.skipped == {"gone": "task file missing"}


def test_scoring_device_follows_eval_device_and_names_the_field_when_there_is_no_gpu():
    import torch

    from evaluation.runner import scoring_device

    cfg = dict(every=1, tasks="t.yaml")
    assert scoring_device(EvalConfig(**cfg, device="cpu")).type == "cpu"
    assert scoring_device(EvalConfig(**cfg)).type == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(GauntletError, match=r"^eval.device: cuda, but this machine has no CUDA device"):
            scoring_device(EvalConfig(**cfg, device="cuda"))
    with pytest.raises(ValueError, match="device"):
        EvalConfig(**cfg, device="tpu")
