"""The last module a launch's warm process imports (infra/launcher.py's preload list): takes its verdict on the rules
of infra/warm.py once every other module is in, and writes it where the launcher waits for it (TESSERA_WARM_VERDICT;
empty: the rules were kept), before the first rank is forked. It also freezes what the imports built, the collector
having been off since infra/warm_open.py: a rank's collections then never walk (nor write to) the server's modules."""

import gc
import os

from infra import warm

warm.seal()
gc.freeze()
if os.environ.get("TESSERA_WARM_VERDICT"):
    path = os.environ["TESSERA_WARM_VERDICT"]
    with open(f"{path}.tmp", "w") as f:
        f.write(warm.sealed() or "")
    os.replace(f"{path}.tmp", path)
