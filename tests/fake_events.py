"""A stand-in for a recorded torch.cuda.Event in CPU tests of the timing tools: a fixed time stamp,
and elapsed_time to another one in ms, as tools/bench_kernel.py reads events."""


class StampedEvent:
    def __init__(self, t):
        self.t = t

    def elapsed_time(self, other):
        return other.t - self.t
