"""Every task type against hand-computed answers, on a bigram model whose logits we wrote.

The model (tests.support.gauntlet.bigram_model) puts logit S=5 on one chosen next word after
some words and 0 everywhere else, so with V words a preferred token costs
log(e^S + V - 1) - S nats and any other costs log(e^S + V - 1); after a word with no
preference every token costs log V.
"""

from __future__ import annotations

import math

import pytest
import torch

from evaluation.batching import collate_rows
from evaluation.generation import generation_correct, normalize_answer
from evaluation.prompts import prepare_split, validate_records
from evaluation.runner import score_split
from evaluation.scoring import score_rows
from evaluation.spec import TaskSpec
from tests.support.gauntlet import bigram_model, bigram_nll, word_tokenizer

WORDS = "the sky is blue green grass today verdant".split()
S = 5.0


@pytest.fixture(scope="module")
def tok():
    return word_tokenizer(WORDS)


@pytest.fixture(scope="module")
def model(tok):
    return bigram_model(tok, {"is": "blue", "blue": "sky", "sky": "<eos>"}, strength=S)


def _score(model, tok, kind, rows, **task_fields):
    task = TaskSpec(label="t", dataset_uri="t.jsonl", num_fewshot=[0], icl_task_type=kind, **task_fields)
    records = validate_records(task, "t.jsonl", list(enumerate(rows, start=1)))
    split = prepare_split(task, "t.jsonl", records, tok, 0, 64, 1234)
    hits, _ = score_split(model, tok, task, split, batch_size=4)
    assert len(hits) == len(split)
    return sum(hits) / len(hits), split


def test_language_modeling_needs_every_continuation_token_greedy(model, tok):
    rows = [
        {"context": "the sky is", "continuation": "blue"},  # is->blue: hit
        {"context": "grass is", "continuation": "green"},  # is->blue, not green: miss
        {"context": "the sky is", "continuation": "blue sky"},  # is->blue, blue->sky: hit
        {"context": "the sky is", "continuation": "blue today"},  # blue->sky, not today: miss
    ]
    acc, _ = _score(model, tok, "language_modeling", rows)
    assert acc == 0.5


def test_multiple_choice_uses_mean_not_sum_of_token_losses(model, tok):
    rows = [
        # "blue today" costs (p + n)/2 per token, "green" costs n: mean picks 0, a sum would pick 1.
        {"query": "the sky is", "choices": ["blue today", "green"], "gold": 0},
        {"query": "grass is", "choices": ["green", "blue"], "gold": 0},  # picks blue: miss
        # After "sky" the only preference is <eos>: both choices cost the same; ties go to the first.
        {"query": "the sky", "choices": ["green", "today"], "gold": 1},
    ]
    acc, split = _score(model, tok, "multiple_choice", rows)
    assert acc == pytest.approx(1 / 3)

    V = len(tok.get_vocab())
    p, n = bigram_nll(V, S, True), bigram_nll(V, S, False)
    item = split.choice_items[0]
    ids, mask = collate_rows(item.rows, tok.pad_token_id)
    mean_ce, _ = score_rows(model, ids, mask, torch.tensor([len(r) for r in item.rows]), torch.tensor(item.cont_lens))
    assert mean_ce.tolist() == pytest.approx([(p + n) / 2, n], rel=1e-5)
    assert p + n > n  # the sum would have preferred choice 1


def test_schema_scores_the_shared_continuation_after_each_context(model, tok):
    V = len(tok.get_vocab())
    rows = [
        {"context_options": ["the sky is", "grass"], "continuation": "blue", "gold": 0},  # p vs log V
        # "green" after "grass" costs log V; after "is" it costs n > log V.
        {"context_options": ["grass", "the sky is"], "continuation": "green", "gold": 0},
        {"context_options": ["the sky is", "grass is"], "continuation": "today", "gold": 1},  # tie -> 0: miss
    ]
    acc, split = _score(model, tok, "schema", rows)
    assert acc == pytest.approx(2 / 3)
    assert bigram_nll(V, S, False) > math.log(V)
    # Zero-shot schema contexts carry no continuation delimiter (reference behaviour).
    assert split.choice_items[0].rows[0] == tok("the sky is blue")["input_ids"]


def test_generation_greedy_answer_matches_any_alias(model, tok):
    rows = [
        {"context": "the sky is", "answer": "blue"},  # generates "blue sky": starts with "blue"
        {"context": "grass is", "answer": "green", "aliases": ["verdant"]},  # generates "blue sky": miss
        {"context": "the sky is", "answer": "today", "aliases": ["Blue!"]},  # alias normalizes to "blue"
    ]
    acc, split = _score(model, tok, "generation_task_with_answers", rows)
    assert acc == pytest.approx(2 / 3)
    assert split.max_new_tokens == 1  # longest answer: one token
    acc, split = _score(model, tok, "generation_task_with_answers", rows, generation_kwargs={"max_new_tokens": 3})
    assert acc == pytest.approx(2 / 3)


def test_generation_stop_strings_cut_the_answer(model, tok):
    rows = [{"context": "the sky is", "answer": "blue sky", "aliases": []}]
    acc, _ = _score(model, tok, "generation_task_with_answers", rows)
    assert acc == 1.0  # max_new_tokens = 2 -> "blue sky"
    acc, _ = _score(model, tok, "generation_task_with_answers", rows, early_stopping_criteria=["sky"])
    assert acc == 0.0  # cut to "blue "


def test_generation_metric_follows_reference_rules():
    # normalization: case, punctuation, articles, whitespace, underscores
    assert normalize_answer("The  Eiffel_Tower!") == "eiffel tower"
    assert generation_correct(" Paris, France\n\nQuestion: x", ["paris"], ["\n\n"], "", True)
    assert not generation_correct(" Lyon", ["paris"], [], "", True)
    # chain of thought: the answer is what follows the last delimiter, before any stop string
    out = " 3 + 4 = 7. The answer is 7\n\nQuestion: next"
    assert generation_correct(out, ["7"], ["\n\n", "Question:"], "The answer is ", False)
    assert not generation_correct(out, ["3"], ["\n\n", "Question:"], "The answer is ", False)
    # without normalization only surrounding whitespace is forgiven
    assert not generation_correct(" Paris", ["paris"], [], "", False)
    assert generation_correct(" Paris ", [" Paris"], [], "", False)


def test_shared_prefix_pass_equals_full_rows_on_a_real_llama():
    """Multiple choice and few-shot schema run each shared prefix once (KV cache); scores must not move."""
    import transformers

    from evaluation.scoring import score_rows_shared

    words = "alpha beta gamma delta eps zeta eta theta iota kappa".split()
    tok = word_tokenizer(words)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=len(tok),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=64,
        )
    ).eval()
    g = torch.Generator().manual_seed(1)

    def phrase(n):
        return " ".join(words[int(i)] for i in torch.randint(0, len(words), (n,), generator=g))

    mc = TaskSpec(label="mc", dataset_uri="x", num_fewshot=[2], icl_task_type="multiple_choice")
    sc = TaskSpec(label="sc", dataset_uri="x", num_fewshot=[2], icl_task_type="schema")
    mc_rows = [
        {"query": phrase(3 + i % 4), "choices": [phrase(1 + j) for j in range(3)], "gold": i % 3} for i in range(9)
    ]
    sc_rows = [
        {"context_options": [phrase(2 + i % 3), phrase(4)], "continuation": phrase(2), "gold": i % 2} for i in range(9)
    ]
    one_token = [{"query": phrase(4), "choices": [phrase(1) for _ in range(4)], "gold": 0} for _ in range(5)]
    for task, rows in ((mc, mc_rows), (sc, sc_rows), (mc, one_token)):
        recs = validate_records(task, "x", list(enumerate(rows, 1)))
        items = prepare_split(task, "x", recs, tok, 2, 64, 7).choice_items
        assert all(it.prefix > 0 for it in items)
        flat = [r for it in items for r in it.rows]
        ids, mask = collate_rows(flat, tok.pad_token_id)
        lengths = torch.tensor([len(r) for r in flat])
        cont = torch.tensor([c for it in items for c in it.cont_lens])
        full_ce, full_hit = score_rows(model, ids, mask, lengths, cont)
        shared_ce, shared_hit = score_rows_shared(model, items, tok.pad_token_id, torch.device("cpu"))
        assert torch.allclose(full_ce, shared_ce, atol=1e-5)
        assert torch.equal(full_hit, shared_hit)


def test_scores_equal_full_logits_and_each_shared_state_is_projected_once():
    """The gauntlet projects one hidden state per distinct token prefix; scores must equal full-logits log_softmax."""
    import transformers

    from evaluation.prompts import ChoiceItem
    from evaluation.scoring import score_rows_shared

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=40,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=64,
        )
    ).eval()
    # Choices 0 and 1 share their first continuation token, so both of their tokens are predicted
    # from states they share with another row: 2 distinct states for 5 tokens in each item.
    items = [
        ChoiceItem([[*ctx, 9, 10], [*ctx, 9, 11], [*ctx, 12]], [2, 2, 1], gold=0, prefix=len(ctx))
        for ctx in ([5, 6, 7, 8], [13, 14, 15, 16, 17, 18])
    ]
    rows = [r for it in items for r in it.rows]
    ids, mask = collate_rows(rows, pad_id=0)
    lengths = torch.tensor([len(r) for r in rows])
    cont = torch.tensor([c for it in items for c in it.cont_lens])

    with torch.inference_mode():
        logp = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits, dim=-1)
    ref_ce, ref_hit = [], []
    for r, c in zip(rows, cont.tolist()):
        k = len(r)
        picked = logp[rows.index(r), k - c - 1 : k - 1]  # positions predicting the continuation
        target = torch.tensor(r[k - c :])
        ref_ce.append(-picked[torch.arange(c), target].mean())
        ref_hit.append(bool((picked.argmax(-1) == target).all()))

    projected = []
    hook = model.lm_head.register_forward_hook(lambda _m, args, _out: projected.append(args[0].shape[-2]))
    try:
        for score in (
            lambda: score_rows(model, ids, mask, lengths, cont),
            lambda: score_rows_shared(model, items, 0, torch.device("cpu")),
        ):
            scored = score()
            assert torch.allclose(scored[0], torch.stack(ref_ce), rtol=0, atol=1e-6)
            assert scored[1].tolist() == ref_hit
            assert sum(projected) == 2 * len(items)
            projected.clear()
        ce, hits = score_rows(model, ids, mask, lengths, cont, greedy=False)  # multiple choice needs no argmax
        assert hits is None and torch.allclose(ce, torch.stack(ref_ce), rtol=0, atol=1e-6)
    finally:
        hook.remove()
