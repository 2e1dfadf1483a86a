"""The promotion rule on measured scores: real models, scored by the real gauntlet runner on the demo's
gauntlet files (381 examples), decided by the rule with its paired-bootstrap intervals.

The models are bigram language models over whole words (tests/support/gauntlet.py), trained on text:
the champion on stories only, so it knows little of the gauntlet's answers; a challenger trained
briefly on text that also holds the gauntlet's answer patterns is truly better; one whose weights
are perturbed is truly worse; one trained on other stories is the same model within noise.
"""

from __future__ import annotations

import json

import pytest

from tests.conftest import ROOT

GAUNTLET = ROOT / "data" / "gauntlet"
FILES = GAUNTLET / "eval" / "local_data"
STORIES = ROOT / "data" / "corpora" / "tinystories" / "tinystories_val.txt"


def _records(rel: str) -> list[dict]:
    return [json.loads(line) for line in (FILES / rel).read_text().splitlines() if line.strip()]


def _answer_texts() -> list[str]:
    """The gauntlet's contexts with their right answers: the text a model learns the answer patterns from."""
    lambada = [
        f"{r['context']} {r['continuation']}" for r in _records("language_understanding/lambada_openai_small.jsonl")
    ]
    copa = [f"{r['query']} {r['choices'][r['gold']]}" for r in _records("commonsense_reasoning/copa.jsonl")]
    wsc = [
        f"{r['context_options'][r['gold']]} {r['continuation']}"
        for r in _records("language_understanding/winograd_wsc.jsonl")
    ]
    return lambada + copa + wsc


@pytest.fixture(scope="module")
def scored():
    import torch

    from evaluation.config import EvalConfig
    from evaluation.runner import run_gauntlet
    from evaluation.spec import load_gauntlet
    from tests.support.gauntlet import fitted_bigram, word_tokenizer

    stories = STORIES.read_text().split("\n\n")
    words = [w for text in _answer_texts() for w in text.split()]
    # every word of the gauntlet's prompts and wrong answers too, so no choice is an unknown word
    for rec in _records("commonsense_reasoning/copa.jsonl"):
        words += " ".join(rec["choices"]).split()
    for rec in _records("language_understanding/winograd_wsc.jsonl"):
        words += " ".join(rec["context_options"]).split()
    tok = word_tokenizer(words)
    champion = fitted_bigram(tok, stories[:3000])
    better = fitted_bigram(tok, stories[:3000] + _answer_texts())
    other = fitted_bigram(tok, stories[3000:6000])
    worse = fitted_bigram(tok, stories[:3000] + _answer_texts())
    with torch.no_grad():
        worse.table.add_(torch.randn(worse.table.shape, generator=torch.Generator().manual_seed(0)) * 4.0)
    cfg = EvalConfig(
        every=1,
        tasks=str(ROOT / "configs" / "gauntlet" / "tiny_tasks.yaml"),
        gauntlet=str(ROOT / "configs" / "gauntlet" / "tiny_gauntlet.yaml"),
        data_root=str(GAUNTLET),
        strict=True,
    )
    reports = {
        name: run_gauntlet(model, tok, cfg, 512)
        for name, model in (("champion", champion), ("better", better), ("other", other), ("worse", worse))
    }
    return reports, load_gauntlet(cfg.gauntlet)


def _decide(scored, champion: str, challenger: str):
    from tasks.registry.promote_config import PromoteConfig
    from tasks.registry.promote_rule import decide

    reports, spec = scored
    return decide(reports[champion], reports[challenger], PromoteConfig(), spec)


def test_a_challenger_trained_on_the_answer_patterns_is_accepted(scored):
    d = _decide(scored, "champion", "better")
    assert d.examples == 381 and d.gain_interval[0] > 0
    assert d.accepted, d.reasons


def test_a_challenger_with_perturbed_weights_is_rejected(scored):
    d = _decide(scored, "better", "worse")
    assert d.gain < 0 and d.gain_interval[1] < 0  # surely worse, not just unlucky
    assert not d.accepted and "less than promote.min_gain" in d.reasons[0]


def test_a_challenger_within_noise_is_rejected_saying_so(scored):
    d = _decide(scored, "champion", "other")
    low, high = d.gain_interval
    assert low <= 0 <= high
    assert not d.accepted and "within noise" in d.reasons[0]


def test_swapping_the_measured_scores_flips_the_verdict(scored):
    forward, swapped = _decide(scored, "champion", "better"), _decide(scored, "better", "champion")
    assert forward.accepted and not swapped.accepted
    assert swapped.gain == pytest.approx(-forward.gain)
