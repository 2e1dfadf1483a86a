"""Prefect flows only: each module defines flows that sequence tasks, and their forms (tests/test_structure.py).

pipeline.py   `pretrain_pipeline`: prepare, train the curriculum, a gauntlet and a registration per checkpoint
continued.py  `continued_pretraining`: train on new data from the champion, promote only if better
prepare.py    `prepare_data` and `prepare-sources`: a recipe's sources tokenized into MDS shards
evaluate.py   `tessera-eval`: score any model on a gauntlet, optionally against a second one
"""
