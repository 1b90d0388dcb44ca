"""math-verify in a pool of killable worker processes: the reward's hang-proofing (docs/data_and_reward.md).

Who may import it: :mod:`recipe.reward.score` (the only caller of :meth:`WorkerPool.verify`), the reward
benchmark and tests. A worker process imports only this module (and math-verify).
"""

from __future__ import annotations

import atexit
import functools
import os
import queue
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

#: Workers start fresh enough to import math-verify; more than this means something is broken.
WORKER_START_TIMEOUT_S = 60.0
#: Consecutive start failures after which the pool gives up and calls raise (misconfiguration).
MAX_START_FAILURES = 3
#: Address-space cap per worker: a runaway bignum raises MemoryError instead of swapping the node.
WORKER_MEMORY_BYTES = 4 * 1024**3

#: The repository root, put on the workers' ``PYTHONPATH`` so they import this module even when the
#: project is not installed (verl may load recipe/reward/score.py by path).
_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@functools.lru_cache(maxsize=4096)
def _parse_gold(gold: str) -> list[Any]:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    boxed = gold if "\\boxed" in gold else "\\boxed{" + gold + "}"
    return parse(boxed, (LatexExtractionConfig(), ExprExtractionConfig()), parsing_timeout=None)


def _verify_in_worker(gold: str, answer: str) -> bool:
    """math-verify equivalence of an extracted answer with the gold answer (worker side)."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    gold_parsed = _parse_gold(gold)
    answer_parsed = parse(
        "\\boxed{" + answer + "}", (LatexExtractionConfig(), ExprExtractionConfig()), parsing_timeout=None
    )
    if not gold_parsed or not answer_parsed:
        return False
    return bool(verify(gold_parsed, answer_parsed, timeout_seconds=None))


def _worker_loop(requests: Connection, replies: Connection, memory_bytes: int) -> None:
    """Worker loop: answer ``(gold, answer)`` jobs with ``(ok, error)`` until the pipe closes.

    math-verify's own SIGALRM timeouts are disabled (``None``): the parent enforces a hard
    timeout by killing this process, which also covers C-level hangs SIGALRM cannot stop.
    """
    import logging

    try:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    except (ImportError, ValueError, OSError):
        pass  # no address-space cap on this platform; the hard timeout still applies
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    import math_verify  # noqa: F401  (import before signalling ready)

    replies.send(("ready", None))
    while True:
        try:
            gold, answer = requests.recv()
        except (EOFError, OSError):
            return
        try:
            result: tuple[bool, str | None] = (_verify_in_worker(gold, answer), None)
        except BaseException as exc:  # noqa: BLE001 - any failure is a wrong answer, not a crash
            result = (False, f"{type(exc).__name__}: {str(exc)[:200]}")
        try:
            replies.send(result)
        except (EOFError, OSError):
            return


def worker_entry_point(requests_fd: int, replies_fd: int, memory_bytes: int) -> None:
    """``python -c`` entry of a worker process (see :class:`_Worker`)."""
    _worker_loop(Connection(requests_fd, writable=False), Connection(replies_fd, readable=False), memory_bytes)


class _Worker:
    """One worker process and the parent's ends of its two pipes (a plain ``subprocess`` child, not
    ``multiprocessing``: docs/data_and_reward.md, "Hang-proofing", says why)."""

    def __init__(self) -> None:
        req_read, req_write = os.pipe()
        rep_read, rep_write = os.pipe()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_REPO_ROOT, env.get("PYTHONPATH")) if p)
        code = (
            "import sys; from recipe.reward.workers import worker_entry_point; "
            "worker_entry_point(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))"
        )
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-c", code, str(req_read), str(rep_write), str(WORKER_MEMORY_BYTES)],
                pass_fds=(req_read, rep_write),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                env=env,
            )
        finally:
            os.close(req_read)
            os.close(rep_write)
        self.requests = Connection(req_write, readable=False)
        self.replies = Connection(rep_read, writable=False)
        self.ready = False

    @property
    def pid(self) -> int:
        return self.process.pid

    def is_alive(self) -> bool:
        return self.process.poll() is None

    def wait_ready(self) -> bool:
        """Wait (outside any item's timeout) for the worker to finish importing math-verify."""
        if self.ready:
            return True
        try:
            if self.replies.poll(WORKER_START_TIMEOUT_S):
                self.ready = self.replies.recv() == ("ready", None)
        except (EOFError, OSError):
            self.ready = False
        return self.ready

    def kill(self) -> None:
        try:
            self.process.kill()
            self.process.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            pass
        self.requests.close()
        self.replies.close()


class RewardStats:
    """Counters kept per process, for logging and the benchmark (one instance: :data:`STATS`)."""

    NAMES = (
        "calls",
        "fast_path",
        "worker_jobs",
        "timeouts",
        "worker_crashes",
        "worker_errors",
        "workers_replaced",
        "no_worker",
        "invalid_inputs",
        "too_complex",
    )

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(self.NAMES, 0)

    def bump(self, name: str, by: int = 1) -> None:
        with self._lock:
            self._counts[name] += by

    def as_dict(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


STATS = RewardStats()


class WorkerPool:
    """A fixed number of verification workers shared by all threads of this process.

    A hung job blocks only its own worker; on the hard timeout it is killed and replaced in the background,
    and only ready workers are handed out, so worker start-up never counts against an item's timeout.
    """

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"reward worker pool size must be >= 1, got {size}")
        self.size = size
        self.owner_pid = os.getpid()
        self._idle: queue.Queue[_Worker] = queue.Queue()
        self._all: list[_Worker] = []
        self._lock = threading.Lock()
        self._closed = False
        self._broken = False
        self._start_failures = 0
        for _ in range(size):
            self._bring_up()

    def _bring_up(self) -> None:
        """Start a worker; a helper thread hands it out once it has imported math-verify."""
        worker = _Worker()
        with self._lock:
            self._all.append(worker)

        def wait_then_offer() -> None:
            if worker.wait_ready():
                self._start_failures = 0
                if not self._closed:
                    self._idle.put(worker)
                return
            self._start_failures += 1
            if self._start_failures >= MAX_START_FAILURES:
                self._broken = True  # e.g. recipe.reward.workers not importable; see the workers' stderr
                worker.kill()
            elif not self._closed:
                self._replace(worker)

        threading.Thread(target=wait_then_offer, name="reward-worker-startup", daemon=True).start()

    def _replace(self, worker: _Worker) -> None:
        worker.kill()
        with self._lock:
            if worker in self._all:
                self._all.remove(worker)
        STATS.bump("workers_replaced")
        if not self._closed:
            self._bring_up()

    def _acquire(self) -> _Worker | None:
        deadline = time.monotonic() + WORKER_START_TIMEOUT_S
        while (remaining := deadline - time.monotonic()) > 0:
            if self._broken and self._idle.empty():
                raise RuntimeError(
                    f"reward workers failed to start {MAX_START_FAILURES} times in a row "
                    f"({sys.executable} -c 'import recipe.reward.workers'); their stderr has the cause"
                )
            try:
                worker = self._idle.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                continue
            if worker.is_alive():
                return worker
            STATS.bump("worker_crashes")  # died while idle (killed from outside, OOM killer)
            self._replace(worker)
        return None

    def verify(self, gold: str, answer: str, timeout_s: float) -> tuple[bool | None, str | None]:
        """``(is_equivalent, problem)``; ``is_equivalent`` is None on timeout or repeated worker death.

        A worker that dies under a job (killed from outside, OOM killer; ``is_alive`` can still
        say yes for a moment after a SIGKILL) says nothing about the item, so the job is retried
        on another worker, up to ``size + 1`` attempts. A timeout is the item's own verdict and
        is final.
        """
        for _ in range(self.size + 1):
            worker = self._acquire()
            if worker is None:
                STATS.bump("no_worker")
                return None, "no reward worker became ready"
            STATS.bump("worker_jobs")
            try:
                worker.requests.send((gold, answer))
                if worker.replies.poll(timeout_s):
                    ok, error = worker.replies.recv()
                    if error is not None:
                        STATS.bump("worker_errors")
                    self._idle.put(worker)
                    return ok, error
            except (EOFError, OSError):
                STATS.bump("worker_crashes")
                self._replace(worker)
                continue
            STATS.bump("timeouts")
            self._replace(worker)
            return None, f"timeout after {timeout_s:g}s"
        return None, "worker died"

    def close(self) -> None:
        self._closed = True
        with self._lock:
            workers, self._all = list(self._all), []
        for worker in workers:
            worker.kill()


_POOL: WorkerPool | None = None
_POOL_LOCK = threading.Lock()


def default_pool_size() -> int:
    """``VERL_DIVCLIP_REWARD_WORKERS`` if set, else one worker per core (2 to 8)."""
    configured = os.environ.get("VERL_DIVCLIP_REWARD_WORKERS")
    if configured is not None:
        try:
            return int(configured)
        except ValueError as exc:
            raise ValueError(f"VERL_DIVCLIP_REWARD_WORKERS must be an integer, got {configured!r}") from exc
    return max(2, min(os.cpu_count() or 2, 8))


def get_pool() -> WorkerPool:
    """The process-wide pool, created on first use (and re-created in a forked child)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None or _POOL.owner_pid != os.getpid():
            _POOL = WorkerPool(default_pool_size())
        return _POOL


def shutdown_pool() -> None:
    """Kill all workers (tests, benchmark); the next call starts a fresh pool."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is not None and _POOL.owner_pid == os.getpid():
            _POOL.close()
        _POOL = None


atexit.register(shutdown_pool)


def reward_stats() -> dict[str, int]:
    """Counters of this process: calls, fast-path hits, worker jobs, timeouts, replacements."""
    return STATS.as_dict()


__all__ = [
    "MAX_START_FAILURES",
    "STATS",
    "WORKER_MEMORY_BYTES",
    "WORKER_START_TIMEOUT_S",
    "RewardStats",
    "WorkerPool",
    "default_pool_size",
    "get_pool",
    "reward_stats",
    "shutdown_pool",
    "worker_entry_point",
]
