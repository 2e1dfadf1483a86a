"""Stands in for the trainer in a pod's command line: joins the process group the launcher (infra/launcher.py) set up.

allreduce      every rank joins over gloo (MASTER_ADDR/PORT from the launcher) and sums the ranks
peer N         rank 1 exits N; rank 0 answers the launcher's SIGTERM with 76, as the trainer does
crash-once F   rank 1 SIGKILLs itself the first time (F, a file, says it did); then every rank joins over gloo and
               sums the ranks, as allreduce: the launchers restart both nodes' ranks in place together
freeze         every rank beats its heartbeat through three steps, then rank 1 stops itself (SIGSTOP) and
               rank 0 waits for it without a beat, as a rank blocked in a collective would
"""

import os
import signal
import sys
import time

if __name__ == "__main__":
    rank, world = os.environ["RANK"], os.environ["WORLD_SIZE"]
    where = f"rank={rank} world={world} node_rank={os.environ.get('NODE_RANK')} master={os.environ['MASTER_ADDR']}"
    mode = sys.argv[1]
    if mode == "allreduce":
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo")
        total = torch.tensor([float(rank)])
        dist.all_reduce(total)
        print(
            f"allreduce sum={int(total.item())} {where} supervisor={os.environ.get('TESSERA_SUPERVISOR_PID')}",
            flush=True,
        )
        dist.destroy_process_group()
        sys.exit(0)
    if mode == "crash-once":
        import torch
        import torch.distributed as dist

        if rank == "1" and not os.path.exists(sys.argv[2]):
            open(sys.argv[2], "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        dist.init_process_group("gloo")
        total = torch.tensor([float(rank)])
        dist.all_reduce(total)
        restart = os.environ["TORCHELASTIC_RESTART_COUNT"]
        print(f"allreduce sum={int(total.item())} {where} restart={restart}", flush=True)
        dist.destroy_process_group()
        sys.exit(0)
    if mode == "peer":
        print(where, flush=True)
        if rank == "1":
            time.sleep(1)
            sys.exit(int(sys.argv[2]))
        signal.signal(signal.SIGTERM, lambda *_: os._exit(76))
        time.sleep(120)
    if mode == "freeze":
        from trainers import heartbeat

        beat = heartbeat.start()
        beat.phase("step")
        for step in range(1, 4):
            beat.progress(step, step * 256, compute_s=0.01)
            time.sleep(0.1)
        print(f"beating {where}", flush=True)
        if rank == "1":
            os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(120)
    sys.exit(2)
