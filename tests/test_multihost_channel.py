"""The leader-follower channel of engine/multihost.py in one process (no jax.distributed): calls replayed in
order, device arrays named by handle, pinned outputs kept past the window until the leader drops its own."""

import gc
import threading

import jax.numpy as jnp
import numpy as np
import pytest

from ernie_jax.engine.multihost import WINDOW, Follower, Leader, collective


class _Store:
    """jax.distributed's key-value store, as the channel uses it."""

    def __init__(self):
        self.values, self.changed = {}, threading.Condition()

    def key_value_set(self, key, value):
        with self.changed:
            self.values[key] = value
            self.changed.notify_all()

    def blocking_key_value_get(self, key, ms):
        with self.changed:
            assert self.changed.wait_for(lambda: key in self.values, ms / 1000)
            return self.values[key]


class _Programs:
    """Stands in for ModelPrograms: each side's calls land in `log`."""

    def __init__(self):
        self.name, self.leader, self.log = "p", None, []

    @collective
    def make(self, value):
        self.log.append(("make", value))
        return jnp.full((2,), value)

    @collective(pinned=True)
    def batch(self, value):
        self.log.append(("batch", value))
        return [jnp.full((3,), value), jnp.zeros((1,))]

    @collective
    def use(self, arrays):
        self.log.append(("use", [np.asarray(a).tolist() for a in arrays]))


def test_calls_replay_in_order_and_pinned_outputs_outlive_the_window_until_the_leader_drops_them():
    store, fatal = _Store(), []
    here, there = _Programs(), _Programs()
    follower: list = []
    joined = threading.Thread(target=lambda: follower.append(Follower(store, 1, timeout=10)))
    joined.start()
    leader = Leader(store, 1, host="127.0.0.1", timeout=10, on_fatal=fatal.append)
    joined.join()
    replay = threading.Thread(target=follower[0].serve, args=({"p": there},))
    replay.start()
    here.leader = leader

    kept = here.batch(7.0)  # waits in an "inbox" while many calls pass
    for i in range(WINDOW + 5):
        here.make(float(i))
    here.use(kept)  # named past the window: pinned
    old = here.make(-1.0)
    for i in range(WINDOW + 1):
        here.make(0.0)
    with pytest.raises(RuntimeError, match="not returned by one of the last"):
        here.use([old])  # an unpinned output past the window cannot be named
    del kept
    gc.collect()
    here.make(1.0)  # carries the release
    leader.stop()
    replay.join(10)
    assert not replay.is_alive() and not fatal
    assert there.log == here.log[:len(there.log)] and ("use", [[7.0, 7.0, 7.0], [0.0]]) in there.log
    assert follower[0].pinned == {}  # released once the leader's copy was garbage
