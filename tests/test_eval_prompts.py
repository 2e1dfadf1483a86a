"""Prompt strings and tokens as llm-foundry builds them; few-shot sampling; truncation."""

from __future__ import annotations

import random

from evaluation.prompts import Record, fewshot_indices, prepare_split, prompt_texts, validate_records
from evaluation.spec import TaskSpec
from tests.support.gauntlet import word_tokenizer


def _task(kind: str, **kw) -> TaskSpec:
    return TaskSpec(label="t", dataset_uri="t.jsonl", num_fewshot=[0], icl_task_type=kind, **kw)


def _records(task: TaskSpec, rows: list[dict]) -> list[Record]:
    return validate_records(task, "t.jsonl", list(enumerate(rows, start=1)))


def test_fewshot_sampling_is_seeded_and_never_picks_the_example_itself():
    for idx in range(10):
        for n in (1, 3, 9):
            picked = fewshot_indices(10, n, idx, random.Random(idx))
            assert idx not in picked and len(picked) == n
    # asking for more shots than other examples exist gives all the others
    assert fewshot_indices(4, 10, 2, random.Random(0)) == {0, 1, 3}
    runs = [[sorted(fewshot_indices(50, 5, i, rng)) for i in range(50)] for rng in (random.Random(7), random.Random(7))]
    assert runs[0] == runs[1]
    assert runs[0] != [sorted(fewshot_indices(50, 5, i, random.Random(8))) for i in range(50)]


def test_fewshot_prompts_are_deterministic_per_seed():
    task = _task("language_modeling")
    recs = _records(task, [{"context": f"c{i}", "continuation": f"a{i}"} for i in range(20)])
    a = prompt_texts(task, recs, 3, seed=1234, prefix_space=True)
    assert a == prompt_texts(task, recs, 3, seed=1234, prefix_space=True)
    assert a != prompt_texts(task, recs, 3, seed=99, prefix_space=True)
    for i, p in enumerate(a):
        shots = p.preamble.split("\n")
        assert len(shots) == 3 and f"c{i} a{i}" not in shots


def test_language_modeling_prompt_format():
    task = _task("language_modeling", prompt_string="Finish:", question_prelimiter="Q: ", continuation_delimiter=" => ")
    recs = _records(task, [{"context": " alpha ", "continuation": "one"}, {"context": "beta", "continuation": "two"}])
    p = prompt_texts(task, recs, 1, seed=0, prefix_space=True)
    # strings are stripped; the preamble keeps the answer without a leading space; the test
    # context is rstripped and its continuation gets the BPE leading space.
    assert p[0].preamble == "Finish:\nQ: beta => two"
    assert p[0].contexts == ("\nQ: alpha =>",)
    assert p[0].continuations == (" one",)
    assert prompt_texts(task, recs, 0, 0, prefix_space=False)[1].continuations == ("two",)


def test_multiple_choice_prompt_format():
    task = _task("multiple_choice", continuation_delimiter="\nAnswer: ")
    rows = [{"query": "Q1?", "choices": ["x", "y"], "gold": 1}, {"query": "Q2?", "choices": ["u", "v"], "gold": 0}]
    p = prompt_texts(task, _records(task, rows), 1, seed=0, prefix_space=True)
    assert p[0].preamble == "Q2?\nAnswer: u"
    assert p[0].contexts == ("\nQ1?\nAnswer:", "\nQ1?\nAnswer:")
    assert p[0].continuations == (" x", " y")


def test_schema_prompt_format():
    task = _task("schema", continuation_delimiter=" | ")
    rows = [
        {"context_options": ["A one", "A two"], "continuation": "end a", "gold": 0},
        {"context_options": ["B one", "B two"], "continuation": "end b", "gold": 1},
    ]
    recs = _records(task, rows)
    p = prompt_texts(task, recs, 1, seed=0, prefix_space=True)
    assert p[0].preamble == "B two | end b"
    # after a preamble each option ends with the rstripped continuation delimiter
    assert p[0].contexts == ("\nA one |", "\nA two |")
    assert p[0].continuations == (" end a", " end a")
    assert prompt_texts(task, recs, 0, 0, prefix_space=True)[0].contexts == ("A one", "A two")


def test_generation_prompt_with_chain_of_thought():
    task = _task(
        "generation_task_with_answers",
        question_prelimiter="Question: ",
        continuation_delimiter="\n\nA:",
        cot_delimiter=" The answer is ",
    )
    rows = [
        {"context": "1+1?", "chain_of_thought": "one plus one", "answer": "2"},
        {"context": "2+2?", "chain_of_thought": "two plus two", "answer": "4"},
    ]
    p = prompt_texts(task, _records(task, rows), 1, seed=0, prefix_space=True)
    assert p[0].preamble == "Question: 2+2?\n\nA:two plus two The answer is 4"
    assert p[0].contexts == ("\nQuestion: 1+1?\n\nA:",)


def test_contexts_are_left_truncated_to_max_seq_len():
    words = [f"w{i}" for i in range(30)]
    tok = word_tokenizer([*words, "end"])
    task = _task("language_modeling")
    recs = _records(task, [{"context": " ".join(words), "continuation": "end"}])
    split = prepare_split(task, "t.jsonl", recs, tok, 0, max_seq_len=8, seed=0)
    row = split.choice_items[0].rows[0]
    assert tok.convert_ids_to_tokens(row) == [*words[-7:], "end"]


def test_token_ids_concatenate_preamble_and_context_not_strings():
    tok = word_tokenizer(["a", "b", "c", "d"])
    task = _task("multiple_choice")
    recs = _records(task, [{"query": "a", "choices": ["b"], "gold": 0}, {"query": "c", "choices": ["d"], "gold": 0}])
    split = prepare_split(task, "t.jsonl", recs, tok, 1, max_seq_len=32, seed=0)
    assert tok.convert_ids_to_tokens(split.choice_items[0].rows[0]) == ["c", "d", "a", "b"]
    assert split.choice_items[0].cont_lens == [1]
