"""One engine instance across processes (multi-controller JAX): the leader steps the engine, the followers
replay its device calls.

Under `jax.distributed` every process holds its own devices' shards and must launch the same programs in the
same order. The leader (process 0) runs the scheduler and the runner; each call of a `ModelPrograms` method
that launches device work (marked `@collective`) is sent with its host inputs to every follower before the
leader launches it, and each follower makes the same call on its own `ModelPrograms` (built from the same
settings: the same programs, pool and weight placement). So what the leader sends per step is its plan as the
runner executes it: which program, with which token ids, positions, block tables and sampling arrays, in
order. A device array passed back into a later call (a chained decode step's tokens, logits to sample)
travels as a `Handle`, (call number, leaf index) of the call that returned it; each side keeps the outputs
of the last `WINDOW` calls, and the outputs of a call marked `pinned` (a page batch handed over between PD
instances, which may wait in an inbox for many calls) until the leader's copy is garbage: the leader then
names the call in its next message. Programs return their results replicated, so the leader reads its own
copy; an instance whose devices are all other processes' (PD with a submesh per process) brings what the
leader reads onto the leader's device in a call of its own right behind each step (ModelPrograms.send),
through JAX's cross-host transfers. Nothing comes back over the channel but heartbeats and errors.

Channel: one TCP connection per follower, to a port the leader publishes in jax.distributed's key-value store.
Frames are length-prefixed pickles, read back by an unpickler that accepts numpy arrays and the project's
plan types only.

Faults: each side sends a heartbeat every `HEARTBEAT` seconds from a thread of its own. To the leader, a
follower whose connection closes, that is silent for `timeout` seconds or that reports an error is fatal:
`on_fatal(reason)` runs once (the server fails the requests in flight, reports unhealthy and exits
non-zero), since the other processes' devices can no longer run the next program. A follower stops (and its
process exits non-zero) when the leader's connection closes or is silent for `timeout`.
"""

from __future__ import annotations

import collections
import functools
import io
import logging
import pickle
import socket
import struct
import threading
import time
import weakref
from typing import Any, Callable, NamedTuple

import jax

log = logging.getLogger("ernie_jax.multihost")

WINDOW = 64  # calls whose outputs each side keeps for later calls (a step makes a handful)
HEARTBEAT = 1.0  # seconds between heartbeats, each way


class Handle(NamedTuple):
    """A device array in a call's arguments: leaf `leaf` of what call number `call` returned."""
    call: int
    leaf: int


class PeerLost(RuntimeError):
    """The other side of the channel closed, went silent, or reported an error."""


def collective(method=None, *, pinned: bool = False):
    """Mark a method that launches device work (of ModelPrograms, PageTransfer: an object with `name` and
    `leader`): with a leader attached, the call goes to every follower first. Calls made inside a collective
    call (run's put) are not sent again: each follower makes them inside its own call. pinned: the outputs
    stay on the followers while the leader holds them (not only for WINDOW calls)."""
    if method is None:
        return functools.partial(collective, pinned=pinned)

    @functools.wraps(method)
    def call(self, *args):
        leader = getattr(self, "leader", None)
        if leader is None or leader.inside:
            return method(self, *args)
        return leader.call(self, method, args, pinned)
    return call


# ---- frames -----------------------------------------------------------------------------------------------
_ALLOWED = {("numpy", "ndarray"), ("numpy", "dtype"), ("numpy._core.multiarray", "_reconstruct"),
            ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "scalar"),
            ("numpy.core.multiarray", "scalar"), ("numpy._core.numeric", "_frombuffer"),
            ("numpy.core.numeric", "_frombuffer"), ("builtins", "slice"), ("builtins", "frozenset"),
            ("ernie_jax.engine.multihost", "Handle"), ("ernie_jax.sharding.eplb", "Placement")}


class _Unpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) not in _ALLOWED:
            raise pickle.UnpicklingError(f"multihost channel: {module}.{name} is not a type the channel carries")
        return super().find_class(module, name)


def _frame(msg) -> bytes:
    data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
    return struct.pack("!Q", len(data)) + data


def _send(sock: socket.socket, lock: threading.Lock, msg) -> None:
    frame = _frame(msg)
    with lock:
        sock.sendall(frame)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise PeerLost("connection closed")
        buf += chunk
    return bytes(buf)


def _recv(sock: socket.socket, timeout: float):
    sock.settimeout(timeout)
    try:
        (n,) = struct.unpack("!Q", _recv_exact(sock, 8))
        return _Unpickler(io.BytesIO(_recv_exact(sock, n))).load()
    except socket.timeout:
        raise PeerLost(f"silent for {timeout:.0f} s (no heartbeat)") from None
    except OSError as e:
        raise PeerLost(f"connection lost: {e}") from None


def _heartbeats(sock: socket.socket, lock: threading.Lock, stopped: threading.Event,
                on_error: Callable[[str], None]) -> None:
    while not stopped.wait(HEARTBEAT):
        try:
            _send(sock, lock, ("heartbeat",))
        except OSError as e:
            on_error(f"heartbeat not sent: {e}")
            return


class _Window:
    """The outputs of the last WINDOW calls, by call number."""

    def __init__(self):
        self.calls: collections.OrderedDict[int, list] = collections.OrderedDict()
        self.count = 0

    def add(self, out) -> tuple[int, list]:
        seq, leaves = self.count, jax.tree.leaves(out)
        self.count += 1
        self.calls[seq] = leaves
        while len(self.calls) > WINDOW:
            self.calls.popitem(last=False)
        return seq, leaves


# ---- the leader -------------------------------------------------------------------------------------------
class Leader:
    """Process 0's side: sends each collective call to the followers, watches their heartbeats."""

    def __init__(self, kv_client, num_followers: int, *, host: str, timeout: float,
                 on_fatal: Callable[[str], None]):
        """kv_client: jax.distributed's key-value store client (where followers find the channel's address);
        host: the address followers reach this process at; timeout: seconds to wait for the followers to
        connect, and of silence after which one is lost."""
        self.timeout, self.on_fatal = timeout, on_fatal
        self._order = threading.Lock()  # a call is sent and launched before the next one is
        self._local = threading.local()
        self._window, self._handles = _Window(), {}
        # pinned calls' outputs: id(leaf) -> (Handle, weak reference); calls whose outputs the leader dropped
        self._pinned: dict[int, tuple[Handle, weakref.ref]] = {}
        self._released: list[int] = []
        self._pin_lock = threading.RLock()  # finalizers run on whichever thread drops the last reference
        self._fatal = threading.Event()
        self.calls_sent, self.bytes_sent, self.send_seconds = 0, 0, 0.0  # the channel's cost, for the log
        listener = socket.create_server((host, 0))
        listener.settimeout(timeout)
        address = f"{host}:{listener.getsockname()[1]}"
        kv_client.key_value_set("ernie_jax/leader_channel", address)
        self.followers: list[tuple[int, socket.socket, threading.Lock]] = []
        try:
            for _ in range(num_followers):
                sock, _ = listener.accept()
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                hello = _recv(sock, timeout)
                self.followers.append((hello[1], sock, threading.Lock()))
        except (socket.timeout, PeerLost) as e:
            raise PeerLost(f"{num_followers - len(self.followers)} of {num_followers} followers did not connect to "
                           f"the leader's channel at {address} within {timeout:.0f} s ({e})") from None
        finally:
            listener.close()
        log.info("leader: %d followers connected through %s", len(self.followers), address)
        self._stopped = threading.Event()
        for pid, sock, lock in self.followers:
            threading.Thread(target=self._watch, args=(pid, sock), daemon=True, name=f"ernie-leader-watch-{pid}").start()
            threading.Thread(target=_heartbeats, args=(sock, lock, self._stopped, functools.partial(self._lost, pid)),
                             daemon=True, name=f"ernie-leader-beat-{pid}").start()

    @property
    def inside(self) -> bool:
        """Whether this thread is inside a collective call (its nested calls are the followers' too)."""
        return getattr(self._local, "inside", False)

    def call(self, obj, method, args: tuple, pinned: bool = False):
        """Send the call to every follower, then make it here; a failure here once they were told leaves the
        processes out of step, so it is fatal."""
        with self._order:
            if self._fatal.is_set():
                raise PeerLost("the instance lost a process; it serves nothing more")
            t0 = time.perf_counter()
            with self._pin_lock:
                released, self._released = self._released, []
            msg = ("call", obj.name, method.__name__, self._encode(args), pinned, released)
            frame = _frame(msg)  # once for every follower
            for pid, sock, lock in self.followers:
                try:
                    with lock:
                        sock.sendall(frame)
                except OSError as e:
                    self._lost(pid, f"call not sent: {e}")
                    raise PeerLost(f"follower {pid}: {e}") from None
            self.calls_sent += 1
            self.bytes_sent += len(frame) * len(self.followers)
            self.send_seconds += time.perf_counter() - t0
            self._local.inside = True
            try:
                out = method(obj, *args)
            except BaseException as e:
                self.fail(f"{obj.name}.{method.__name__} failed on the leader after the followers were told "
                          f"to run it: {e!r}")
                raise
            finally:
                self._local.inside = False
            seq, leaves = self._window.add(out)
            self._handles = {k: e for k, e in self._handles.items() if e[0].call in self._window.calls}
            for i, leaf in enumerate(leaves):
                self._handles[id(leaf)] = (Handle(seq, i), leaf)
            if pinned:
                self._pin(seq, leaves)
            return out

    def _pin(self, seq: int, leaves: list) -> None:
        """Keep naming a pinned call's outputs while this process holds them; once all are garbage, the next
        call's message tells the followers to drop theirs."""
        arrays = [(i, x) for i, x in enumerate(leaves) if isinstance(x, jax.Array)]
        left = [len(arrays)]

        def dropped(key: int) -> None:
            with self._pin_lock:
                self._pinned.pop(key, None)
                left[0] -= 1
                if not left[0]:
                    self._released.append(seq)
        with self._pin_lock:
            for i, x in arrays:
                self._pinned[id(x)] = (Handle(seq, i), weakref.ref(x))
                weakref.finalize(x, dropped, id(x))

    def _encode(self, x):
        if isinstance(x, jax.Array):
            entry = self._handles.get(id(x))
            if entry is None or entry[1] is not x:
                with self._pin_lock:
                    pin = self._pinned.get(id(x))
                entry = pin and (pin[0], pin[1]())
            if entry is None or entry[1] is not x:
                raise RuntimeError("a device array in a collective call's arguments was not returned by one of the "
                                   f"last {WINDOW} collective calls nor pinned; the followers cannot name it")
            return entry[0]
        if type(x) in (list, tuple):
            return type(x)(self._encode(v) for v in x)
        if type(x) is dict:
            return {k: self._encode(v) for k, v in x.items()}
        return x

    def _watch(self, pid: int, sock: socket.socket) -> None:
        while not self._stopped.is_set():
            try:
                msg = _recv(sock, self.timeout)
            except PeerLost as e:
                if not self._stopped.is_set():
                    self._lost(pid, str(e))
                return
            if msg[0] == "error":
                self._lost(pid, f"reported an error: {msg[1]}")
                return

    def _lost(self, pid: int, why: str) -> None:
        self.fail(f"follower process {pid}: {why}")

    def fail(self, reason: str) -> None:
        """The instance lost a process (or its link): on_fatal(reason), once."""
        if self._fatal.is_set():
            return
        self._fatal.set()
        self._stopped.set()
        log.error("multi-process instance lost: %s", reason)
        self.on_fatal(reason)

    def stop(self) -> None:
        """Tell the followers to exit (a drained shutdown)."""
        self._stopped.set()
        log.info("leader channel: %d calls sent, %d bytes, %.3f s encoding and sending (%.0f us a call)",
                 self.calls_sent, self.bytes_sent, self.send_seconds, 1e6 * self.send_seconds / max(1, self.calls_sent))
        for _, sock, lock in self.followers:
            try:
                _send(sock, lock, ("stop",))
            except OSError:
                pass


# ---- a follower -------------------------------------------------------------------------------------------
class Follower:
    """Process I > 0's side: replays the leader's collective calls on this process's programs."""

    def __init__(self, kv_client, process_id: int, *, timeout: float):
        self.timeout = timeout
        address = kv_client.blocking_key_value_get("ernie_jax/leader_channel", int(timeout * 1000))
        host, port = address.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._lock, self._stopped = threading.Lock(), threading.Event()
        _send(self.sock, self._lock, ("hello", process_id))
        self.calls = 0
        self.pinned: dict[int, list] = {}  # a pinned call's number -> its outputs, until the leader releases them
        log.info("follower %d: connected to the leader at %s", process_id, address)

    def serve(self, programs: dict[str, Any]) -> None:
        """Replay calls until the leader says stop (returns) or is lost (raises PeerLost). programs: the
        objects the leader's calls name (the instances' ModelPrograms, a PD engine's PageTransfer), by name."""
        threading.Thread(target=_heartbeats, args=(self.sock, self._lock, self._stopped, lambda why: None),
                         daemon=True, name="ernie-follower-beat").start()
        window, pinned = _Window(), self.pinned

        def decode(x):
            if isinstance(x, Handle):
                return (window.calls[x.call] if x.call in window.calls else pinned[x.call])[x.leaf]
            if type(x) in (list, tuple):
                return type(x)(decode(v) for v in x)
            return {k: decode(v) for k, v in x.items()} if type(x) is dict else x
        try:
            while True:
                msg = _recv(self.sock, self.timeout)
                if msg[0] == "heartbeat":
                    continue
                if msg[0] == "stop":
                    return
                _, target, name, args, pin, released = msg
                for seq in released:
                    pinned.pop(seq, None)
                t0 = time.perf_counter()
                try:
                    seq, leaves = window.add(getattr(programs[target], name)(*decode(args)))
                    log.debug("replayed call %d: %s.%s in %.2f ms", seq, target, name, 1e3 * (time.perf_counter() - t0))
                    if pin:
                        pinned[seq] = leaves
                except Exception as e:
                    _send(self.sock, self._lock, ("error", f"{target}.{name}: {e!r}"))
                    raise
                self.calls += 1
        finally:
            self._stopped.set()
