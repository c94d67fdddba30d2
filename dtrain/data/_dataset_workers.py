"""Where :class:`~dtrain.data.dataset.DatasetDeserializer` reads its chunks in parallel: a thread pool, or
persistent worker processes that each hold the dataset and a :class:`~dtrain.data._dataset_plan.Plan`.

Both take a read's chunks as one job (:meth:`submit`), may hold the jobs of reads announced ahead, drop a
job that will not be read, and hand the results on in chunk order (:meth:`collect`). A worker process
writes its large results into shared-memory arenas of its own, made once and reused task after task,
stops when the process that started it is gone, and its death is a DataError naming the samples it read.
"""
from __future__ import annotations

import builtins
import multiprocessing
import multiprocessing.connection
import os
import select
import signal
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait

import numpy as np
import torch

from dtrain.data._dataset_plan import Borrowed, Plan, one_line
from dtrain.data.errors import DataError

__all__ = ["ProcessWorkers", "ThreadWorkers"]

#: a worker sends a tensor smaller than this inline (pickled bytes) instead of through shared memory
_INLINE_BYTES = 64 * 1024
#: how often an idle worker process checks that the reading process is still alive (seconds)
_WATCHDOG_SECONDS = 2.0
#: tasks a worker process holds at once (with several, it starts the next while the reading process
#: takes in the last; each has its own arena). Two: the chunk of the read being taken in and that of the
#: next, prefetched one, the most a source reading two minibatches ahead has outstanding at a worker
#: (it announces a read only once the one before last was taken in); more tasks wait for a free slot
_QUEUE_DEPTH = 2
#: a task whose indices take more bytes than this goes only to an idle worker (one that is reading its
#: pipe): a busy worker's pipe then never fills up with tasks while it waits to send a reply
_QUEUED_TASK_BYTES = 32 * 1024


class _ThreadJob:
    """The tasks of one read in a thread pool: their futures, and where their results go."""

    __slots__ = ("futures", "on_part")

    def __init__(self, futures: list, on_part: Callable[[int, dict], None]):
        self.futures, self.on_part = futures, on_part


class ThreadWorkers:
    """A thread pool: one task per chunk, run as soon as a thread is free (a prefetched read's tasks
    queue behind those before them); the results are handed on in chunk order."""

    broken = False

    def __init__(self, count: int, dataset, plan: Plan):
        self._dataset, self._plan = dataset, plan
        self._executor = ThreadPoolExecutor(count, thread_name_prefix="dtrain-dataset")

    def submit(self, method: str, tasks: list[tuple], on_part: Callable[[int, dict], None]) -> _ThreadJob:
        """Queues the tasks ``plan.method(dataset, *task)``; their results go to ``on_part`` in :meth:`collect`."""
        function = getattr(self._plan, method)
        return _ThreadJob([self._executor.submit(function, self._dataset, *task) for task in tasks], on_part)

    def collect(self, job: _ThreadJob) -> bool:
        """Waits for the job's tasks and hands their results on in order (the first error in index order is
        raised); True: a thread pool loses no task."""
        wait(job.futures)
        for number, future in enumerate(job.futures):
            job.on_part(number, future.result())
        return True

    def drop(self, job: _ThreadJob) -> None:
        """Forgets a job: its tasks that have not started never run."""
        for future in job.futures:
            future.cancel()

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)


class _Arenas:
    """In a worker process: ``depth`` shared-memory byte buffers that its results are written into, one
    per task in turn; the reading process maps each once and copies the results out before it sends the
    task that reuses the buffer. A buffer grows (a new one, sent once) when a task needed more."""

    def __init__(self, depth: int):
        self.depth = depth
        self.buffers: list[torch.Tensor | None] = [None] * depth
        self.generations = [0] * depth
        self.needed = [0] * depth
        self.slot = -1
        self.offset = 0

    def start_task(self) -> tuple[int, int, torch.Tensor | None]:
        """Moves to the next buffer, replacing it when the last task in it needed more room; returns
        ``(slot, generation, new buffer or None)`` for the reply."""
        self.slot = (self.slot + 1) % self.depth
        slot, fresh = self.slot, None
        buffer = self.buffers[slot]
        if self.needed[slot] > (0 if buffer is None else buffer.numel()):
            size = -(-self.needed[slot] * 5 // 4 // 4096) * 4096  # a quarter to spare, whole pages
            fresh = self.buffers[slot] = torch.empty(size, dtype=torch.uint8).share_memory_()
            self.generations[slot] += 1
        self.needed[slot] = self.offset = 0
        return slot, self.generations[slot], fresh

    def allocate(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """A tensor in this task's buffer (64-byte aligned), or None when it does not fit (it will next time)."""
        start = -(-self.offset // 64) * 64
        nbytes = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
        self.needed[self.slot] = max(self.needed[self.slot], start + nbytes)
        buffer = self.buffers[self.slot]
        if buffer is None or start + nbytes > buffer.numel():
            return None
        self.offset = start + nbytes
        return buffer[start:start + nbytes].view(dtype).view(shape)

    def output(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """Where the plan collates a result (``Plan.arena``): in this task's buffer when it is too large to
        send inline and fits, else None (a new tensor)."""
        if int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size() < _INLINE_BYTES:
            return None
        return self.allocate(shape, dtype)

    def place(self, tensor: torch.Tensor):
        """``tensor`` as a reference into this task's buffer (copied there if it is elsewhere and fits), or
        the tensor itself."""
        buffer = self.buffers[self.slot]
        if buffer is not None and tensor.is_contiguous():
            base, size = buffer.data_ptr(), buffer.numel()
            start = tensor.data_ptr() - base
            if 0 <= start < size and tensor.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr():
                return _InArena(start, tuple(tensor.shape), tensor.dtype)
        out = self.allocate(tuple(tensor.shape), tensor.dtype)
        if out is None:
            return tensor
        out.copy_(tensor)
        return _InArena(out.data_ptr() - buffer.data_ptr(), tuple(tensor.shape), tensor.dtype)


class _InArena:
    """Where a result tensor lies in its task's arena: byte offset, shape and dtype."""

    __slots__ = ("offset", "shape", "dtype")

    def __init__(self, offset: int, shape: tuple[int, ...], dtype: torch.dtype):
        self.offset, self.shape, self.dtype = offset, shape, dtype

    def __getstate__(self):
        return self.offset, self.shape, self.dtype

    def __setstate__(self, state):
        self.offset, self.shape, self.dtype = state


class _ProcessJob:
    """The tasks of one read at the worker processes: sent in order as arena slots free up, their replies
    handed to ``on_part`` (None once the read was dropped: replies are taken in and thrown away)."""

    __slots__ = ("number", "method", "tasks", "on_part", "sent", "open", "failures", "lost")

    def __init__(self, number: int, method: str, tasks: list[tuple], on_part: Callable[[int, dict], None]):
        self.number, self.method, self.tasks, self.on_part = number, method, tasks, on_part
        self.sent = 0  # tasks sent so far, in order
        self.open = len(tasks)  # tasks neither answered nor given up
        self.failures: dict[int, Exception] = {}  # task number -> its error
        self.lost = False  # tasks went down with a worker that died on another job's task


class ProcessWorkers:
    """Persistent worker processes, each with a pipe. A task is ``(method, args)``; the reply is
    ``(status, payload, arena)``: ``("ok", result)`` with large tensors in the worker's arena and small
    ones inline, or ``("error", (type, module, message))``; ``arena`` is ``(slot, generation, buffer or
    None)``. A worker answers its tasks in the order they were sent.

    :meth:`submit` (any thread, under ``_lock`` with the rest of the bookkeeping) queues a read's tasks
    and sends what the arena slots allow: at most ``_QUEUE_DEPTH`` tasks held by one worker at a time
    (one, for a task of many indices), each to the worker holding fewest, jobs in the order they were
    submitted. :meth:`collect` (one
    thread at a time: the reader) takes in the replies up to the last of its job's, each copied out of
    its arena before the slot is freed and the next task sent."""

    def __init__(self, count: int, dataset, plan: Plan):
        import torch.multiprocessing  # noqa: F401 - registers the shared-memory reductions of tensors

        context = _start_context()
        self.type_name = plan.type_name
        self.broken = False
        self._depth = _QUEUE_DEPTH
        self._lock = threading.Lock()
        self._jobs = 0  # jobs submitted so far: each one's number
        self._unsent: deque[_ProcessJob] = deque()  # jobs with tasks still to send, oldest first
        self._held: list[deque] = []  # per worker: (job, task number) sent and not yet taken in, oldest first
        self._cause: _ProcessJob | None = None  # the job whose task a worker died on
        self._workers: list[tuple[multiprocessing.Process, multiprocessing.connection.Connection]] = []
        self._arenas: list[list] = []  # per worker, per slot: [generation, buffer]
        self._finalizer = weakref.finalize(self, _stop_processes, self._workers)
        reader = (os.getpid(), context.get_start_method() != "forkserver")  # (pid, whether the workers' parent)
        for number in range(count):
            ours, theirs = context.Pipe()
            process = context.Process(target=_worker_main, args=(dataset, plan, theirs, ours, reader, self._depth),
                                      name=f"dtrain-dataset-{number}", daemon=True)
            process.start()
            theirs.close()
            self._workers.append((process, ours))
            self._held.append(deque())
            self._arenas.append([[0, None] for _ in range(self._depth)])

    def submit(self, method: str, tasks: list[tuple], on_part: Callable[[int, dict], None]) -> _ProcessJob:
        """Queues the tasks ``plan.method(dataset, *task)`` behind those submitted before, sending what the
        slots allow now; the replies go to ``on_part(number, result)`` in :meth:`collect`."""
        with self._lock:
            job = _ProcessJob(self._jobs, method, tasks, on_part)
            self._jobs += 1
            self._unsent.append(job)
            self._send()
        return job

    def drop(self, job: _ProcessJob) -> None:
        """Forgets a job: its tasks not yet sent never are; the replies of the others are thrown away."""
        with self._lock:
            job.on_part = None
            self._send()

    def collect(self, job: _ProcessJob) -> bool:
        """Takes in the replies up to the last of ``job``'s (those of earlier jobs first), handing them to
        their jobs; raises the job's lowest task's error, if any. False: some of its tasks were lost
        with a worker that died on another job's task (run it again on fresh workers)."""
        try:
            while job.open:
                waiting = {}
                with self._lock:
                    for worker, held in enumerate(self._held):
                        if held and held[0][0].number <= job.number:
                            process, connection = self._workers[worker]
                            waiting[connection] = waiting[process.sentinel] = worker
                if not waiting:  # none of its tasks can come any more (a worker died, the others were not sent)
                    self.broken = True
                    job.lost = job.lost or job is not self._cause
                    break
                for worker in sorted({waiting[ready] for ready in multiprocessing.connection.wait(list(waiting))}):
                    self._take(worker)
        except BaseException:
            self.broken = True  # an interrupted reply leaves a pipe in an unknown state: the next read starts afresh
            raise
        if job.lost:
            return False
        if job.failures:
            raise job.failures[min(job.failures)]  # the lowest chunk's, as without workers
        return True

    def _take(self, worker: int) -> None:
        """Takes in the reply to ``worker``'s oldest task."""
        with self._lock:
            job, number = self._held[worker][0]
        status, payload = self._receive(worker, job.tasks[number][0])
        if status == "ok" and job.on_part is not None:
            job.on_part(number, payload)  # copies out of the arena before the slot is freed below
        with self._lock:
            self._held[worker].popleft()
            job.open -= 1
            if status != "ok":
                job.failures[number] = payload
                if status == "dead":  # on this task; the tasks it held after it are lost with it
                    self.broken, self._cause = True, job
                    for other, other_number in self._held[worker]:
                        other.open -= 1
                        if other is job:
                            job.failures[other_number] = payload
                        else:
                            other.lost = True
                    self._held[worker].clear()
            self._send()

    def _send(self) -> None:
        """Sends queued tasks while a worker has a free slot (under ``_lock``); gives up the unsent tasks of a
        job that failed or was dropped, and all of them once a worker died."""
        while self._unsent:
            job = self._unsent[0]
            if self.broken or job.failures or job.on_part is None:
                job.open -= len(job.tasks) - job.sent
                job.sent = len(job.tasks)
                if self.broken and job is not self._cause and job.on_part is not None:
                    job.lost = True
                self._unsent.popleft()
                continue
            worker = min(range(len(self._held)), key=lambda each: len(self._held[each]))
            room = 1 if job.tasks[job.sent][0].nbytes > _QUEUED_TASK_BYTES else self._depth
            if len(self._held[worker]) >= room:
                return
            try:
                self._workers[worker][1].send((job.method, job.tasks[job.sent]))
            except (OSError, ValueError):
                pass  # a dead worker: waiting for its reply says so
            self._held[worker].append((job, job.sent))
            job.sent += 1
            if job.sent == len(job.tasks):
                self._unsent.popleft()

    def _receive(self, worker: int, chunk: np.ndarray) -> tuple[str, object]:
        """``("ok", result)``, ``("error", exception)`` or, when the worker died on the task or its reply was
        lost, ``("dead", DataError)``."""
        process, connection = self._workers[worker]
        span = f"{self.type_name}[{int(chunk[0])}..{int(chunk[-1])}]"
        if connection.poll():
            try:
                status, payload, arena = connection.recv()
            except (EOFError, OSError):
                pass
            except Exception as error:  # noqa: BLE001 - e.g. no file descriptors left for shared memory
                return "dead", DataError(
                    f"the reply of {self.type_name} worker {process.name} for {span} could not be received: "
                    f"{type(error).__name__}: {one_line(error)} (too many open files? try "
                    f"torch.multiprocessing.set_sharing_strategy('file_system'))")
            else:
                slot, generation, fresh = arena
                if fresh is not None:
                    self._arenas[worker][slot] = [generation, fresh]
                if status == "ok":
                    return "ok", _unpack(payload, self._arenas[worker][slot])
                return "error", _rebuilt_error(*payload)
        process.join(1.0)
        code = process.exitcode
        how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
        return "dead", DataError(f"{self.type_name} worker process {process.name} (pid {process.pid}) {how} while "
                                  f"reading {span} (out of memory, or a crash in native code of __getitem__?)")

    def close(self) -> None:
        self._finalizer()


def _start_context() -> multiprocessing.context.BaseContext:
    """How worker processes start: forked where the platform can (the dataset and the plan reach each worker
    without pickling), else by the platform's default (spawn: each worker unpickles them and imports
    :func:`_worker_main` by its module path)."""
    return multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else None)


def _stop_processes(workers: list) -> None:
    """Asks each worker to stop, then ends those that do not within a few seconds (never hangs)."""
    for _, connection in workers:
        try:
            connection.send(None)
        except (OSError, ValueError):
            pass
    deadline = time.monotonic() + 3.0
    for process, connection in workers:
        process.join(max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            process.terminate()
            process.join(1.0)
        connection.close()


def _reader_ended(pid: int, is_parent: bool) -> Callable[[], bool]:
    """Whether the reading process ``pid`` has ended: its pidfd (Linux) is readable; without pidfds, whether this
    process's parent changed when the reader is that parent (forked or spawned, not started by a forkserver).
    The pipe's end does not tell: the reader's later forks (this worker's siblings among them) hold it open."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return lambda: True
    except (AttributeError, OSError):
        return (lambda: os.getppid() != pid) if is_parent else (lambda: False)
    return lambda: bool(select.select([pidfd], [], [], 0)[0])


def _worker_main(dataset, plan: Plan, connection, parent_end, reader: tuple[int, bool], depth: int) -> None:
    """A worker process: reads tasks until told to stop, the pipe closes, or the reading process
    ``reader = (pid, whether this process's parent)`` has ended; its results go into ``depth`` arenas in turn
    (it never holds more tasks than that)."""
    reader_ended = _reader_ended(*reader)
    arenas = _Arenas(depth)
    plan.arena = arenas.output  # this process's copy of the plan collates large results into the arenas
    parent_end.close()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the main process's to handle
    torch.set_num_threads(1)
    while True:
        while not connection.poll(_WATCHDOG_SECONDS):
            if reader_ended():
                return
        try:
            message = connection.recv()
        except (EOFError, OSError):
            return
        if message is None:
            return
        method, args = message
        arena = arenas.start_task()
        try:
            reply = ("ok", _pack(getattr(plan, method)(dataset, *args), arenas), arena)
        except Exception as error:  # noqa: BLE001 - sent to the reading process, raised there
            reply = ("error", (type(error).__name__, type(error).__module__, one_line(error)), arena)
        try:
            connection.send(reply)
        except (OSError, ValueError):
            return


def _rebuilt_error(type_name: str, module: str, message: str) -> Exception:
    """A worker's exception in the reading process: a DataError as it was, a builtin one (TypeError, ...)
    by its type, any other as a DataError that names its type."""
    if type_name == DataError.__name__ and module == DataError.__module__:
        return DataError(message)
    kind = getattr(builtins, type_name, None) if module == "builtins" else None
    if isinstance(kind, type) and issubclass(kind, Exception):
        try:
            return kind(message)
        except Exception:  # noqa: BLE001 - an exception type that needs other arguments
            pass
    return DataError(f"a worker raised {module}.{type_name}: {message}")


class _Inline:
    """A small tensor sent as pickled bytes (a numpy array) instead of through shared memory."""

    __slots__ = ("array",)

    def __init__(self, array: np.ndarray):
        self.array = array

    def __getstate__(self):
        return self.array

    def __setstate__(self, state):
        self.array = state


def _pack(value, arenas: _Arenas):
    """A worker's result for sending: small tensors inline, large ones as places in the task's arena (or,
    when they do not fit it yet, through torch's shared-memory reductions)."""
    if isinstance(value, torch.Tensor):
        if value.element_size() * value.numel() < _INLINE_BYTES and value.dtype != torch.bfloat16:
            try:
                return _Inline(value.numpy())
            except (TypeError, RuntimeError):
                return value
        return arenas.place(value)
    if isinstance(value, dict):
        return {key: _pack(item, arenas) for key, item in value.items()}
    if isinstance(value, tuple):
        return tuple(_pack(item, arenas) for item in value)
    return value


def _unpack(value, arena: list):
    """The inverse of :func:`_pack` in the reading process; tensors in the arena ``[generation, buffer]``
    come as :class:`Borrowed` views."""
    if isinstance(value, _Inline):
        return torch.from_numpy(value.array)
    if isinstance(value, _InArena):
        nbytes = int(np.prod(value.shape)) * torch.empty((), dtype=value.dtype).element_size()
        return Borrowed(arena[1][value.offset:value.offset + nbytes].view(value.dtype).view(value.shape))
    if isinstance(value, dict):
        return {key: _unpack(item, arena) for key, item in value.items()}
    if isinstance(value, tuple):
        return tuple(_unpack(item, arena) for item in value)
    return value
