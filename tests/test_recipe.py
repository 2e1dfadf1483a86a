"""Recipe validation: the tiny recipe loads, and each kind of mistake names its file, line and field."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml

from tasks.recipe import RecipeError, load_recipe, parse_recipe
from tests.conftest import ROOT

TINY = ROOT / "configs" / "tiny.yaml"


def tiny_text() -> str:
    return TINY.read_text()


def test_tiny_recipe_loads_into_typed_sections():
    recipe = load_recipe(TINY)
    assert [s.name for s in recipe.data.sources] == ["literary", "stories"]
    assert [s.mixture for s in recipe.train.stages] == [{"literary": 0.8, "stories": 0.2}, {"stories": 1.0}]
    assert recipe.eval.every == 16384
    assert recipe.model.n_layers == 2
    assert recipe.tracking.tracking_uri.startswith("sqlite:///")
    # the hash is a pure function of the content
    assert recipe.content_hash() == parse_recipe(tiny_text()).content_hash()


def test_hash_changes_with_content():
    edited = tiny_text().replace("tokens: 16384", "tokens: 32768")
    assert parse_recipe(edited).content_hash() != load_recipe(TINY).content_hash()


def _error(text: str) -> str:
    with pytest.raises(RecipeError) as info:
        parse_recipe(text, "r.yaml")
    message = str(info.value)
    assert "\n" not in message
    return message


def _line_of(text: str, needle: str) -> int:
    return next(i for i, line in enumerate(text.splitlines(), 1) if needle in line)


def test_mixture_not_summing_to_one_names_line_and_field():
    text = tiny_text().replace("{literary: 0.8, stories: 0.2}", "{literary: 0.7, stories: 0.2}")
    line = _line_of(text, "{literary: 0.7, stories: 0.2}")
    assert _error(text) == f"r.yaml:{line}: train.stages.0.mixture: mixture proportions sum to 0.9, not 1"


def test_mixture_naming_unknown_source():
    text = tiny_text().replace("mixture: {stories: 1.0}", "mixture: {poems: 1.0}")
    line = _line_of(text, "{poems: 1.0}")
    assert _error(text) == f"r.yaml:{line}: train.stages.1.mixture: names no data source: poems"


def test_unknown_key_is_rejected():
    text = tiny_text().replace("  n_heads: 4\n", "  n_heads: 4\n  n_haeds: 4\n")
    line = _line_of(text, "n_haeds")
    assert _error(text) == f"r.yaml:{line}: model.n_haeds: Extra inputs are not permitted"


def test_missing_required_section():
    raw = yaml.safe_load(tiny_text())
    del raw["tracking"]
    # a missing key points at the mapping that should hold it
    assert _error(yaml.safe_dump(raw)) == "r.yaml:1: tracking: Field required"


def test_bad_key_in_a_source_names_its_own_line_without_union_tags():
    text = tiny_text().replace('      separator: "\\n\\n"\n', '      separator: "\\n\\n"\n      bogus_field: 1\n', 1)
    line = _line_of(text, "bogus_field")
    assert _error(text) == f"r.yaml:{line}: data.sources.0.bogus_field: Extra inputs are not permitted"


def test_work_dir_must_be_local():
    text = tiny_text().replace("work_dir: .tessera", "work_dir: s3://bucket/runs")
    assert _error(text) == "r.yaml:4: work_dir: must be a local directory, not a URI (s3://bucket/runs)"


def test_save_folder_accepts_local_and_s3_only():
    text = tiny_text().replace("  seed: 17\n", "  seed: 17\n  save_folder: gs://bucket/runs\n")
    line = _line_of(text, "save_folder:")
    assert (
        _error(text)
        == f"r.yaml:{line}: train.save_folder: gs://bucket/runs: only local paths and s3:// URIs are supported"
    )
    ok = parse_recipe(text.replace("gs://bucket/runs", "s3://bucket/runs"), "r.yaml")
    assert ok.train.save_folder == "s3://bucket/runs"


def test_wrong_type_names_field():
    text = tiny_text().replace("global_batch_size: 8", "global_batch_size: eight")
    line = _line_of(text, "global_batch_size: eight")
    assert _error(text).startswith(f"r.yaml:{line}: train.global_batch_size: Input should be a valid integer")


def test_eval_every_must_align_with_batches():
    text = tiny_text().replace("every: 16384", "every: 1000")
    line = _line_of(text, "every: 1000")
    assert _error(text) == (f"r.yaml:{line}: eval.every: 1000 is not a multiple of global_batch_size*seq_len (1024)")


def test_heads_must_divide_width():
    text = tiny_text().replace("n_heads: 4", "n_heads: 5")
    assert "model: d_model (64) must be divisible by n_heads (5)" in _error(text)


def test_invalid_yaml_names_line():
    text = tiny_text().replace("  seq_len: 128", "  seq_len: [128")
    message = _error(text)
    assert message.startswith("r.yaml:") and "invalid YAML" in message


def test_missing_file():
    with pytest.raises(RecipeError, match=r"^nope\.yaml: recipe file not found$"):
        load_recipe("nope.yaml")


def test_cli_prints_one_line_and_exits_2(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(tiny_text().replace("{literary: 0.8, stories: 0.2}", "{literary: 0.8}"))
    proc = subprocess.run(
        [sys.executable, "-m", "cli.main", "run", str(bad)], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"tessera: error: {bad}:{_line_of(bad.read_text(), '{literary: 0.8}')}: "
        "train.stages.0.mixture: mixture proportions sum to 0.8, not 1"
    ]


def test_a_batch_the_ranks_cannot_split_is_refused_before_anything_starts():
    """global_batch_size 8 on 3 ranks passed validation and failed 62 s into `tessera run` with exit 78."""
    text = tiny_text().replace("procs_per_node: 1", "procs_per_node: 3")
    assert _error(text) == (
        f"r.yaml:{_line_of(text, 'global_batch_size: 8')}: train.global_batch_size: 8 sequences do not split evenly "
        "over the 3 ranks (compute.procs_per_node 3 x 1 node)"
    )
    text = (
        tiny_text()
        .replace("procs_per_node: 1", "procs_per_node: 2")
        .replace("device_microbatch_size: 8", "device_microbatch_size: 3")
    )
    assert _error(text) == (
        f"r.yaml:{_line_of(text, 'device_microbatch_size: 3')}: train.device_microbatch_size: 3 does not divide the 4 "
        "sequences each of the 2 ranks (compute.procs_per_node 2 x 1 node) takes of train.global_batch_size 8"
    )
    # a stage with its own batch is checked on its own line; a microbatch as large as a rank's share is fine
    text = (
        tiny_text()
        .replace("procs_per_node: 1", "procs_per_node: 2")
        .replace("      mixture: {stories: 1.0}", "      mixture: {stories: 1.0}\n      global_batch_size: 3")
        .replace("tokens: 16384\n", "tokens: 16896\n")
    )
    assert _error(text).startswith(
        f"r.yaml:{_line_of(text, 'global_batch_size: 3')}: train.stages.1.global_batch_size: 3 sequences do not split "
    )
    assert load_recipe(TINY).train.device_microbatch_size == 8
    ok = tiny_text().replace("procs_per_node: 1", "procs_per_node: 4")
    assert parse_recipe(ok, "r.yaml").compute.procs_per_node == 4  # 8 over 4 ranks, microbatch clamped to 2


def test_a_run_name_longer_than_the_file_system_allows_is_one_line(tmp_path, capsys):
    """A 236-character run name used to train three launches, each failing at its first state file: now the
    name is refused before anything runs, saying how long a name may be on this file system."""
    from cli.main import main
    from tasks.recipe import longest_run_name, run_folder
    from tests.conftest import tiny_recipe

    recipe = tiny_recipe(tmp_path)
    most = longest_run_name(tmp_path)
    assert most == os.pathconf(tmp_path, "PC_NAME_MAX") - 64
    run_folder(tmp_path / "work", "r" * most)  # the longest that fits
    for name in ("r" * (most + 1), "r" * 300):
        capsys.readouterr()
        assert main(["run", str(recipe), "--run-name", name]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "Traceback" not in err[0]
        assert f"is {len(name)} characters; at most {most} fit" in err[0] and err[0].startswith("tessera: error: ")


def test_a_stage_shorter_than_eval_every_is_said_not_refused():
    """Its only checkpoint comes at its end: right for a short anneal stage, so a notice, not an error."""
    assert load_recipe(TINY).notices() == []
    short = parse_recipe(tiny_text().replace("tokens: 16384", "tokens: 8192"), "r.yaml")
    assert short.notices() == [
        "train.stages[1] (stories): 8,192 tokens, fewer than eval.every (16,384): its only checkpoint, gauntlet and "
        "model version come at its end, and a failure inside it re-trains it from its start"
    ]
