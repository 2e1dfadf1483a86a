"""A stand-in training module for infra tests: reports its rank, then exits or sleeps as told.

exit N     rank 0 exits N, the others 0
sleep S    every rank sleeps S seconds
peer N     rank 1 exits N; rank 0 waits, answering the launcher's SIGTERM with 76 (interrupted) as the trainer does
freeze S   every rank starts its heartbeat (phase startup); rank 1 stops itself (SIGSTOP), rank 0 sleeps S seconds
gc N       every rank says whether its cyclic collector is on and how many objects it holds frozen, then exits N
"""

import gc
import os
import signal
import sys
import time

if __name__ == "__main__":
    print(f"rank={os.environ['RANK']} world={os.environ['WORLD_SIZE']} master={os.environ['MASTER_ADDR']}", flush=True)
    mode, value = sys.argv[1], int(sys.argv[2])
    rank = os.environ["RANK"]
    if mode == "freeze":
        from trainers import heartbeat

        heartbeat.start()
        if rank == "1":
            os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(value)
    if mode == "gc":
        print(f"rank={rank} gc={gc.isenabled()} frozen={gc.get_freeze_count()}", flush=True)
    if mode == "sleep":
        time.sleep(value)
    if mode == "peer":
        if rank == "1":
            time.sleep(1)
            sys.exit(value)
        signal.signal(signal.SIGTERM, lambda *_: os._exit(76))
        time.sleep(120)
    sys.exit(value if (mode in ("exit", "gc") and rank == "0") else 0)
