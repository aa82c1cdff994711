"""A server whose instance spans processes: `--num-processes N --process-id I --coordinator-address HOST:PORT`.

Every process starts `jax.distributed` (the coordinator runs in process 0), checks that all were launched
with the same model and engine settings, and loads the model onto the global mesh (each process places its
own devices' shards). With --prefill-devices the instance is disaggregated over two submeshes (each may be
one process's devices: every process builds both, JAX runs each program where its devices are, and the
hand-over's pages cross with JAX's cross-host transfers); with --pd-role it is a prefill or decode server
whose KV connector runs on process 0 (engine/spanning_pool.py). Process 0 is the leader: it serves the API
and steps the engine, and each device call goes to the followers first (engine/multihost.py). A follower builds the same engine, answers only
`/health`, and replays the leader's calls until the leader stops it (exit 0) or is lost (exit 1).
A lost follower fails the leader's requests in flight with an error, /health turns 503, and the leader
exits 1 so a supervisor restarts the whole job.

Every wait is bounded by `--distributed-timeout`: the other processes joining, the settings check, the
followers connecting, and the silence after which a process counts as lost.
"""

from __future__ import annotations

import hashlib
import http.server
import json
import logging
import os
import socket
import threading
import time
from typing import Any, Callable

log = logging.getLogger("ernie_jax.serve")

# Settings each process may set on its own: they change nothing its devices compute.
_LOCAL_SETTINGS = {"compilation_cache_dir", "background_compile", "enable_prefix_caching"}


def distributed_args(args) -> tuple[int, int, str | None]:
    """(processes, process id, coordinator address) from the flags, else jax.distributed's environment
    variables; raises SystemExit naming the setting when they do not fit together."""
    env = os.environ
    n = args.num_processes if args.num_processes is not None else int(env.get("JAX_NUM_PROCESSES", 1))
    pid = args.process_id if args.process_id is not None else int(env.get("JAX_PROCESS_ID", 0))
    coordinator = args.coordinator_address or env.get("JAX_COORDINATOR_ADDRESS")
    if n < 1:
        raise SystemExit(f"--num-processes must be >= 1, got {n}")
    if n == 1:
        return 1, 0, None
    if not 0 <= pid < n:
        raise SystemExit(f"--process-id {pid} is out of range for --num-processes {n} (0 .. {n - 1})")
    if not coordinator or ":" not in coordinator:
        raise SystemExit(f"--num-processes {n} needs --coordinator-address HOST:PORT (process 0's host and a free "
                         f"port; got {coordinator!r})")
    if args.prefill_devices is not None and not args.disaggregate:
        raise SystemExit("--prefill-devices with --no-disaggregate: the instance serves colocated on its whole mesh")
    return n, pid, coordinator


def disaggregated(args, processes: int) -> bool:
    """Whether the instance runs prefill and decode on disjoint submeshes: by default on one process's mesh;
    across processes when --prefill-devices says how to split it (e.g. each process's devices a submesh)."""
    return args.disaggregate and args.pd_role == "mixed" and (processes == 1 or args.prefill_devices is not None)


def transfer_address(coordinator: str, given: str | None) -> str:
    """HOST:PORT where this process takes part in JAX's cross-host transfers (a PD hand-over between
    submeshes of different processes): --kv-transfer-address (a port of 0 or none: a free one), else the
    address this host reaches the coordinator from."""
    host, _, port = (given or "").partition(":")
    try:
        if not host:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:  # no packet is sent: it picks the route
                s.connect((coordinator.rsplit(":", 1)[0], 9))
                host = s.getsockname()[0]
        if not port or port == "0":  # the transfer library publishes the address as given: it needs the port
            with socket.create_server((host, 0)) as s:
                port = str(s.getsockname()[1])
    except OSError as e:
        raise SystemExit(f"--kv-transfer-address {given or '(default)'}: no address for the cross-host transfers "
                         f"of a PD hand-over between processes ({e})") from None
    return f"{host}:{port}"


def initialize(processes: int, process_id: int, coordinator: str, timeout: float,
               transfers: str | None = None) -> Any:
    """Start jax.distributed (before any JAX computation); returns its key-value store client. transfers:
    this process's address for JAX's cross-host transfers (transfer_address), or None: none made."""
    import jax
    from jax._src import distributed
    _reachable(coordinator, process_id, timeout)
    if transfers is not None:
        log.info("cross-host transfers (PD hand-over between processes) at %s", transfers)
        jax.config.update("jax_cross_host_transfer_socket_address", transfers)
        jax.config.update("jax_cross_host_transfer_timeout_seconds", int(timeout))
    log.info("jax.distributed: process %d of %d joining at %s (waiting up to %.0f s for the others)", process_id,
             processes, coordinator, timeout)
    try:
        jax.distributed.initialize(coordinator_address=coordinator, num_processes=processes, process_id=process_id,
                                   initialization_timeout=int(timeout), heartbeat_timeout_seconds=int(timeout),
                                   shutdown_timeout_seconds=int(timeout))
    except Exception as e:  # noqa: BLE001 -- the runtime's errors name no flag
        raise SystemExit(f"--coordinator-address {coordinator}: process {process_id} of {processes} could not join "
                         f"the distributed runtime within {timeout:.0f} s (--distributed-timeout): {e}") from None
    log.info("jax.distributed: process %d of %d, %d local of %d devices, coordinator %s", jax.process_index(),
             jax.process_count(), jax.local_device_count(), jax.device_count(), coordinator)
    return distributed.global_state.client


def _reachable(coordinator: str, process_id: int, timeout: float) -> None:
    """The runtime aborts the process (no Python error) when the coordinator cannot be reached or bound, so
    probe first: process 0 must be able to listen on its port, the others must reach it within the timeout."""
    host, port = coordinator.rsplit(":", 1)
    if process_id == 0:
        try:
            socket.create_server(("", int(port))).close()
        except OSError as e:
            raise SystemExit(f"--coordinator-address {coordinator}: process 0 cannot listen on port {port} ({e}); "
                             "is another process 0 running?") from None
        return
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection((host, int(port)), timeout=1).close()
            return
        except OSError as e:
            if time.monotonic() > deadline:
                raise SystemExit(f"--coordinator-address {coordinator}: nothing answered there within {timeout:.0f} s "
                                 f"(--distributed-timeout; is process 0 running?): {e}") from None
            time.sleep(0.2)


def model_identity(model_dir: str) -> str:
    """A digest of the checkpoint's config and its weight files' names and sizes (paths may differ per host)."""
    h = hashlib.sha256()
    for name in sorted(os.listdir(model_dir)):
        path = os.path.join(model_dir, name)
        if name.endswith(".json"):
            with open(path, "rb") as f:
                h.update(name.encode() + f.read())
        elif name.endswith((".safetensors", ".model")):
            h.update(f"{name} {os.path.getsize(path)}".encode())
    return h.hexdigest()[:16]


def check_same_setup(kv_client, processes: int, process_id: int, setup: dict, timeout: float) -> None:
    """Every process publishes its settings; process 0 compares them and publishes the verdict, which all read.
    Raises SystemExit naming the first setting that differs (on every process)."""
    ms = int(timeout * 1000)
    kv_client.key_value_set(f"ernie_jax/setup/{process_id}", json.dumps(setup, sort_keys=True, default=str))
    if process_id == 0:
        verdict = "ok"
        for pid in range(1, processes):
            try:
                theirs = json.loads(kv_client.blocking_key_value_get(f"ernie_jax/setup/{pid}", ms))
            except Exception:  # noqa: BLE001 -- the runtime's timeout error
                verdict = f"process {pid} did not publish its settings within {timeout:.0f} s"
                break
            first = ("num_processes", "local_devices", "model", "mesh")  # the likeliest causes of the rest
            diff = sorted((k for k in set(setup) | set(theirs) if setup.get(k) != theirs.get(k)),
                          key=lambda k: (first.index(k) if k in first else len(first), k))
            if diff:
                k = diff[0]
                verdict = (f"{_flag(k)} differs between processes: process 0 has {setup.get(k)!r}, process {pid} "
                           f"has {theirs.get(k)!r}" + (f" (and {len(diff) - 1} more settings)" if len(diff) > 1 else ""))
                break
        kv_client.key_value_set("ernie_jax/setup_verdict", verdict)
    else:
        try:
            verdict = kv_client.blocking_key_value_get("ernie_jax/setup_verdict", ms)
        except Exception:  # noqa: BLE001
            verdict = f"process 0 did not check the settings within {timeout:.0f} s"
    if verdict != "ok":
        raise SystemExit(f"error: {verdict}")


def _flag(key: str) -> str:
    names = {"model": "the model (--model's config and weight files)", "jax": "the jax version",
             "local_devices": "the devices each process brings (--mesh / the machine's accelerators)"}
    return names.get(key) or f"--{key.replace('_', '-')}"


def setup_of(config, model_dir: str, processes: int, pd_role: str = "mixed") -> dict:
    """What must match across processes: the model, every engine setting that shapes a program or the pool,
    the server's PD role (a prefill or decode server's pool moves are calls of every process), the process
    count and the devices each process brings."""
    import jax
    out = {k: v for k, v in config.summary().items() if k not in _LOCAL_SETTINGS}
    out.update(model=model_identity(model_dir), num_processes=processes, jax=jax.__version__, pd_role=pd_role,
               local_devices=f"{jax.local_device_count()} {jax.default_backend()}")
    return out


def lead(engine, kv_client, processes: int, coordinator: str, timeout: float, on_fatal: Callable[[str], None]):
    """Process 0: wait for the followers' channels and send every instance's device calls through them."""
    from ernie_jax.engine.multihost import Leader, PeerLost
    try:
        leader = Leader(kv_client, processes - 1, host=coordinator.rsplit(":", 1)[0], timeout=timeout,
                        on_fatal=on_fatal)
    except PeerLost as e:
        raise SystemExit(f"error: {e}") from None
    for obj in _replayed(engine).values():
        obj.leader = leader
    return leader


def _replayed(engine) -> dict[str, Any]:
    """What the leader's calls name, by name: each instance's programs, a PD engine's page transfer, and the KV
    connector's pool moves of an instance whose mesh spans processes (a prefill or decode server's; built
    here, on every process, as `programs.kv_across`)."""
    from ernie_jax.engine.spanning_pool import SpanningPool, spans_processes
    out = {inst.name: inst.programs for inst in engine.instances}
    out.update({inst.transfer.name: inst.transfer for inst in engine.instances if inst.transfer is not None})
    for inst in engine.instances:
        if spans_processes(inst.programs):
            if inst.programs.kv_across is None:
                inst.programs.kv_across = SpanningPool(inst.programs)
            out[inst.programs.kv_across.name] = inst.programs.kv_across
    return out


def follow(engine, kv_client, process_id: int, timeout: float, health: dict) -> int:
    """Process I > 0: replay the leader's calls; returns the exit status (0: the leader stopped this process
    after a drained shutdown). health: what its /health reports (health_server)."""
    from ernie_jax.engine.multihost import Follower, PeerLost
    follower = Follower(kv_client, process_id, timeout=timeout)
    health.update(status="ok", calls=lambda: follower.calls)
    log.info("follower %d: replaying the leader's device calls", process_id)
    try:
        follower.serve(_replayed(engine))
    except PeerLost as e:
        log.error("follower %d: the leader is lost (%s); exiting", process_id, e)
        return 1
    except Exception:  # noqa: BLE001 -- reported to the leader already
        log.exception("follower %d: a replayed call failed; exiting", process_id)
        return 1
    finally:
        health["status"] = "stopped"
    log.info("follower %d: stopped by the leader after %d calls", process_id, follower.calls)
    import jax
    jax.distributed.shutdown()
    return 0


def health_server(host: str, port: int, health: dict) -> None:
    """A follower's /health on host:port, from a daemon thread: 200 with `health` (callables evaluated) while its
    status is "ok", 503 while loading or once stopped; every other path 404."""
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 -- the stdlib's name
            found = self.path.split("?")[0] == "/health"
            state = {k: v() if callable(v) else v for k, v in health.items()}
            body = json.dumps(state if found else {"error": "a follower process serves /health only"}).encode()
            self.send_response((200 if state["status"] == "ok" else 503) if found else 404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass
    try:
        server = http.server.ThreadingHTTPServer((host, port), Handler)
    except OSError as e:
        raise SystemExit(f"--host/--port {host}:{port}: the follower's /health cannot listen there ({e}); give each "
                         "process on one host its own --port") from None
    threading.Thread(target=server.serve_forever, daemon=True, name="ernie-follower-health").start()
