"""A stand-in training module for infra tests: reports its rank, then exits or sleeps as told."""

import os
import sys
import time

if __name__ == "__main__":
    print(f"rank={os.environ['RANK']} world={os.environ['WORLD_SIZE']} master={os.environ['MASTER_ADDR']}", flush=True)
    mode, value = sys.argv[1], int(sys.argv[2])
    if mode == "sleep":
        time.sleep(value)
    sys.exit(value if (mode == "exit" and os.environ["RANK"] == "0") else 0)
