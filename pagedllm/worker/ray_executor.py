"""Ray executor (``--distributed-executor-backend ray``, extra ``pip install 'pagedllm[ray]'``):
the tensor/pipeline-parallel ranks 1..W-1 are Ray actors placed by a placement group, as in
vLLM's Ray backend; rank 0 stays in the driver. Everything else -- the process groups
(``torch.distributed``, gloo/NCCL), the broadcast of each call, failure handling -- is the
multiprocessing executor's: only how workers start, and how their death is seen, differ.

Cluster: ``ray.init(address="auto")`` joins a running cluster (``ray start --head`` on this
node, or ``RAY_ADDRESS``); with none, a local Ray instance is started. The placement group asks
one bundle per worker rank ({"GPU": 1} on CUDA, else {"CPU": 1}) with the PACK strategy and must
be placed within PAGEDLLM_RAY_PLACEMENT_TIMEOUT_S (default 120 s), else start-up fails with the
cluster's free resources in the message. Actors are owned by the driver: when it dies, Ray
kills them (and their gloo/NCCL sockets close, failing any pending collective).
"""
from __future__ import annotations

import logging
import os
import socket
from typing import Any

from pagedllm import envs
from pagedllm.worker.multiproc_executor import MultiprocExecutor, worker_main

logger = logging.getLogger("pagedllm")

PLACEMENT_TIMEOUT_S = envs.PAGEDLLM_RAY_PLACEMENT_TIMEOUT_S  # read once, at import


def _import_ray():
    try:
        import ray  # lazily: ray is an optional extra (pagedllm[ray])
    except ImportError:
        raise ValueError("--distributed-executor-backend ray needs Ray: pip install 'pagedllm[ray]'") from None
    return ray


class _RankActor:
    """One rank in a Ray worker process (wrapped with ``ray.remote`` at first use)."""

    def pid(self) -> int:
        return os.getpid()

    def run(self, config: Any, rank: int, world: int, init_method: str, threads: int) -> None:
        os.environ["OMP_NUM_THREADS"] = str(threads)
        worker_main(config, rank, world, init_method, _NullConn(), None, threads)  # exits the process


class _NullConn:
    """The pipe a spawned worker reports on; a Ray actor reports through its task result."""

    def send(self, msg: Any) -> None:
        pass


class _ActorProc:
    """The ``multiprocessing.Process`` surface the executor uses, over a Ray actor."""

    def __init__(self, ray: Any, actor: Any, pid: int, run_ref: Any) -> None:
        self.ray, self.actor, self.pid, self.run_ref = ray, actor, pid, run_ref
        self.exitcode = None

    def is_alive(self) -> bool:
        if self.exitcode is not None:
            return False
        done, _ = self.ray.wait([self.run_ref], timeout=0)
        if done:
            self.exitcode = 1  # run() never returns while the rank serves: it died or was stopped
        return not done

    def terminate(self) -> None:
        try:
            self.ray.kill(self.actor)
        except Exception:  # noqa: BLE001 - already gone
            pass

    kill = terminate

    def join(self, timeout: float | None = None) -> None:
        self.ray.wait([self.run_ref], timeout=timeout)


class _ReadyConn:
    """Answers the executor's start-up poll once: the actor is up (it answered ``pid()``)."""

    def __init__(self) -> None:
        self.sent = False

    def poll(self, timeout: float = 0.0) -> bool:
        return not self.sent

    def recv(self) -> tuple:
        self.sent = True
        return ("ready", None)

    def close(self) -> None:
        pass


class RayExecutor(MultiprocExecutor):
    """Same contract as MultiprocExecutor; raises ValueError when Ray is missing or the cluster
    cannot place the workers."""

    def _launch_workers(self, ranks: list[int], init_method: str, threads: int) -> str:
        ray = _import_ray()
        # lazily: ray is an optional extra (pagedllm[ray])
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if not ray.is_initialized():
            env = {k: os.environ[k] for k in ("PYTHONPATH",) if k in os.environ}
            try:
                ray.init(address="auto", runtime_env={"env_vars": env}, log_to_driver=True)
                logger.info("ray: joined the running cluster")
            except ConnectionError:
                ray.init(runtime_env={"env_vars": env}, num_cpus=max(len(ranks), os.cpu_count() or 1))
                logger.info("ray: no running cluster; started a local one")
        on_cuda = self.config.device.startswith("cuda")
        bundle = {"GPU": 1, "CPU": 1} if on_cuda else {"CPU": 1}
        self._pg = placement_group([dict(bundle) for _ in ranks], strategy="PACK")
        self._remove_pg = lambda: remove_placement_group(self._pg)
        ready, _ = ray.wait([self._pg.ready()], timeout=PLACEMENT_TIMEOUT_S)
        if not ready:
            raise ValueError(f"the Ray cluster cannot place {len(ranks)} workers of {bundle} within "
                             f"{PLACEMENT_TIMEOUT_S:.0f} s (available: {ray.available_resources()})")
        # The rendezvous runs in this process (rank 0): an address the actors' nodes can reach.
        ip = ray.util.get_node_ip_address()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((ip, 0))
            init_method = f"tcp://{ip}:{s.getsockname()[1]}"
        actor_cls = ray.remote(_RankActor)
        for i, rank in enumerate(ranks):
            actor = actor_cls.options(
                name=None, num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0),
                scheduling_strategy=PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=i),
            ).remote()
            pid = ray.get(actor.pid.remote(), timeout=PLACEMENT_TIMEOUT_S)
            run_ref = actor.run.remote(self.config, rank, self.world_size, init_method, threads)
            self.procs.append(_ActorProc(ray, actor, pid, run_ref))
            self.conns.append(_ReadyConn())
        logger.info("ray: %d worker actors (pids %s) in placement group %s", len(ranks),
                    [p.pid for p in self.procs], self._pg.id.hex())
        return init_method

    def _kill_workers(self) -> None:
        super()._kill_workers()
        remove = getattr(self, "_remove_pg", None)
        if remove is not None:
            self._remove_pg = None
            try:
                remove()
            except Exception:  # noqa: BLE001 - the cluster may be gone
                pass
