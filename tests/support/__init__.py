"""Fixtures the tests and the benches share: tiny MDS data, tokenizers and jobs (training.py), models whose
answers are known and cut task files (gauntlet.py). Kept out of the product packages: nothing that trains
or evaluates imports them. The benches import them with the repository root on sys.path."""
