"""A stand-in training module for infra tests: reports its rank, then exits or sleeps as told.

exit N     rank 0 exits N, the others 0
sleep S    every rank sleeps S seconds
peer N     rank 1 exits N; rank 0 waits, answering the launcher's SIGTERM with 76 (interrupted) as the trainer does
freeze S   every rank starts its heartbeat (phase startup); rank 1 stops itself (SIGSTOP), rank 0 sleeps S seconds
gc N       every rank says whether its cyclic collector is on and how many objects it holds frozen, then exits N
shm S      in the launch's first attempt, rank 0 makes the shared memory TESSERA_TEST_SHM names (as Streaming's first
           rank of a node does) and kills itself (-9); every other rank, and every rank of a restart, exits 0 once
           the file TESSERA_TEST_GO exists (at most S seconds)
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
    if mode == "shm" and rank == "0" and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
        from multiprocessing.shared_memory import SharedMemory

        SharedMemory(os.environ["TESSERA_TEST_SHM"], create=True, size=64)  # registered with this rank's tracker
        print("rank=0 made its shared memory", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "shm":
        deadline = time.monotonic() + value
        while not os.path.exists(os.environ["TESSERA_TEST_GO"]) and time.monotonic() < deadline:
            time.sleep(0.05)
    if mode == "peer":
        if rank == "1":
            time.sleep(1)
            sys.exit(value)
        signal.signal(signal.SIGTERM, lambda *_: os._exit(76))
        time.sleep(120)
    sys.exit(value if (mode in ("exit", "gc") and rank == "0") else 0)
