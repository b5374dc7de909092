"""The clock of a layer call's phases (issue 34): floats from perf_counter on CPU; on CUDA, events recorded on
the hot path and read only when the call is recorded. CUDA is driven here by a fake ``torch.cuda`` that
keeps a device timeline and counts every host synchronisation."""

import pytest
import torch

from ultraep.runtime.clock import DeviceClock, HostClock, Seconds, clamp0, clock_for
from ultraep.runtime.transport import SideStream


class FakeCuda:
    """Events stamped with a device time; the device runs behind the host until ``advance``."""

    def __init__(self) -> None:
        self.device_time = 0.0  # ms: where the device will be when it gets to the next event
        self.reached = 0.0  # ms the device has completed
        self.syncs = 0
        self.log: list = []
        outer = self

        class Event:
            def __init__(self, enable_timing=False):
                assert enable_timing
                self.t = None

            def record(self, stream=None):
                self.t = outer.device_time

            def query(self):
                return self.t <= outer.reached

            def synchronize(self):
                outer.syncs += 1
                outer.reached = max(outer.reached, self.t)

            def elapsed_time(self, end):
                assert self.query() and end.query(), "elapsed_time on an event the device has not reached"
                return end.t - self.t

        class Stream:
            def __init__(self, device=None):
                self.name = "side"

            def wait_stream(self, other):
                outer.log.append(("wait_stream", self.name, other.name))

        self.Event, self.Stream = Event, Stream
        self._current = Stream()
        self._current.name = "current"

    def work(self, ms: float) -> None:  # enqueue device work
        self.device_time += ms

    def current_stream(self):
        return self._current

    def stream(self, s):
        outer = self

        class Ctx:
            def __enter__(self):
                outer.log.append(("enter", s.name))

            def __exit__(self, *exc):
                outer.log.append(("exit", s.name))

        return Ctx()


def test_host_clock_is_plain_float_arithmetic():
    clk = clock_for(torch.zeros(1))
    assert isinstance(clk, HostClock) and clk.ready()
    t0 = clk.now()
    t1 = clk.now()
    assert isinstance(t1 - t0, float) and clk.read(clamp0(t0 - t1)) == 0.0


def test_device_clock_records_on_the_hot_path_and_reads_at_flush():
    cuda = FakeCuda()
    clk = DeviceClock(cuda)
    t0 = clk.now()
    cuda.work(3.0)
    t1 = clk.now()
    cuda.work(5.0)
    t2 = clk.now()
    # the phase arithmetic of a layer call: nothing is read, nothing synchronises
    phases = {"load_s": t1 - t0, "rest_s": t2 - t1, "sum_s": (t1 - t0) + (t2 - t1) + 0.5,
              "hidden_s": clamp0(0.001 - (t2 - t1)), "neg_s": 1.0 - (t1 - t0)}
    assert cuda.syncs == 0 and not clk.ready()
    with pytest.raises(TypeError, match="flush_record"):
        float(phases["load_s"])
    cuda.reached = cuda.device_time  # the next call's load all-gather synchronised the stream
    assert clk.ready()
    got = {k: clk.read(v) for k, v in phases.items()}
    assert got == pytest.approx({"load_s": 0.003, "rest_s": 0.005, "sum_s": 0.508, "hidden_s": 0.0,
                                 "neg_s": 0.997})
    assert cuda.syncs == 0  # the events had completed: reading them called no synchronize (issue 55)
    assert isinstance(phases["load_s"], Seconds)


def test_device_clock_read_before_the_device_got_there_waits_for_it():
    cuda = FakeCuda()
    clk = DeviceClock(cuda)
    t0 = clk.now()
    cuda.work(2.0)
    dt = clk.now() - t0
    assert clk.read(dt) == pytest.approx(0.002) and cuda.syncs >= 1  # flush at a step's end: allowed to wait


def test_side_stream_orders_transfers_after_their_producer_and_before_their_reader():
    cuda = FakeCuda()
    recorded = []

    class T:
        def record_stream(self, s):
            recorded.append(s.name)

    side = SideStream(torch.device("cuda", 0), cuda=cuda)
    with side.before_issue([T(), T()]):
        cuda.log.append(("issue",))
    side.after_wait()
    assert cuda.log == [("wait_stream", "side", "current"), ("enter", "side"), ("issue",), ("exit", "side"),
                        ("wait_stream", "current", "side")]
    assert recorded == ["side", "side"]


def test_side_stream_is_nothing_on_cpu():
    side = SideStream(torch.device("cpu"))
    with side.before_issue([torch.zeros(1)]):
        pass
    side.after_wait()
    assert side.stream is None


def test_transfer_handle_maps_messages_to_requests_as_the_backend_returns_them():
    """gloo: one request per message; NCCL: one for the whole group (waiting on it waits on all); none: the
    backend ordered the batch on the stream itself."""
    from ultraep.runtime.transport import TransferHandle

    class Work:
        def __init__(self):
            self.waits = 0

        def wait(self):
            self.waits += 1

        def is_completed(self):
            return False

    keys_r, keys_s = [(1, (0, 3, 0)), (1, (0, 3, 1))], [(1, (0, 5, 0))]
    per = [Work(), Work(), Work()]
    h = TransferHandle(per, keys_r, keys_s, [], 0.0, None)
    h.wait_recvs()
    assert [w.waits for w in per] == [1, 1, 0] and h.num_recvs == 2
    one = Work()
    h = TransferHandle([one], keys_r, keys_s, [], 0.0, None)
    h.wait()
    assert one.waits == 1 and all(t == t for t in h.done_at)
    h = TransferHandle([], keys_r, keys_s, [], 0.0, None)
    h.poll()
    assert all(t == t for t in h.done_at) and set(h.recv_seconds()) == set(keys_r)
