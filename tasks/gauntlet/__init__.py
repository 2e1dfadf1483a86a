"""Scoring checkpoints on the gauntlet: while a run trains, and outside one.

gauntlet_queue.py    every new checkpoint pinned, evaluated, then registered, while training goes on; its backlog
evaluate.py          one checkpoint scored, logged to the training run, a markdown artifact left
score.py             a model scored outside training: `tessera eval`, `compare`, promotion
"""
