"""The first module a launch's warm process imports (infra/launcher.py's preload list): it turns CPython's cyclic
collector off for the imports that follow, and infra/warm_seal.py, the last, freezes what they built.

Importing the trainer allocates a few hundred thousand long-lived objects (every module, class and function of
Composer, torch, transformers), and with the collector on, CPython 3.11 keeps walking that growing heap: the imports
took 4.2 s of CPU with it off against 5.7 s with it on (trainers.build and the rest of WARM_MODULES, 2026-11-29, this
2-core machine). Frozen (gc.freeze) before the first fork, those objects are never walked by a rank's collections
either, so their pages stay shared with the server. Each rank turns the collector back on first
(infra/warm.run_rank): the server itself only forks. The imports' own cyclic garbage (about 14,000 of the 920,000
objects they leave, measured) is frozen with them rather than collected first: a full collection there costs 0.5 s
of CPU, a third of what the collector's absence saves, for a few MB.
"""

import gc

gc.disable()
