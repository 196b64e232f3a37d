"""Lock-step execution: ``P`` workers' code in one process, one worker at a time.

A simulated rank runs the library's own code (``Grace.start``, the communicators, the bundle's
end of step), which waits for a collective exactly where a real rank would, in the middle of a
call: a scatter-gather's owner launches its allgather after its all-to-all arrived, PowerSGD its
second allreduce after the first. So each worker runs in a thread of its own, and only one runs at
a time: a worker that waits for a collective the others have not joined yet hands the turn back,
and the next worker whose wait is over (in rank order, round after round) runs until it waits or
finishes. Nothing runs concurrently, so the workers share no locks and their order is the same in
every run; a round in which no worker can go on is a deadlock (ranks that launched different
collectives), reported with what each worker waits for.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from grace_legacy.runtime.validation import check_positive_int


class Abandoned(BaseException):  # noqa: N818 (not an error of the worker: the run it was part of failed)
    """Raised inside a waiting worker whose run is given up (another worker failed, or a deadlock)."""


class Deadlock(RuntimeError):
    """No simulated worker can go on: each waits for a collective that another never launches."""


class _Crew:
    """The threads and their turn-taking, apart from :class:`LockStep` so that the threads hold no
    reference to it (it stops them when it is collected)."""

    def __init__(self) -> None:
        self.resume: list[threading.Semaphore] = []
        self.threads: list[threading.Thread] = []
        self.yielded = threading.Semaphore(0)
        self.tasks: list[Callable[[], Any] | None] = []
        self.results: list[Any] = []
        self.errors: list[BaseException | None] = []
        self.done: list[bool] = []
        #: what a waiting worker waits for: (ready, describe)
        self.waiting: list[tuple[Callable[[], bool], Callable[[], str]] | None] = []
        self.current = -1
        #: the worker whose task runs in the caller's thread (``-1``: none)
        self.inline = -1
        #: whether each worker had to wait during the current run
        self.waited: list[bool] = []
        self.abandoning = False
        self.closing = False

    def grow(self, size: int) -> None:
        while len(self.threads) < size:
            index = len(self.threads)
            self.resume.append(threading.Semaphore(0))
            self.tasks.append(None)
            self.results.append(None)
            self.errors.append(None)
            self.done.append(True)
            self.waiting.append(None)
            self.waited.append(False)
            thread = threading.Thread(target=self.loop, args=(index,), name=f"simulated-worker-{index}", daemon=True)
            self.threads.append(thread)
            thread.start()

    def loop(self, index: int) -> None:
        while True:
            self.resume[index].acquire()
            if self.closing:
                return
            task, self.tasks[index] = self.tasks[index], None
            try:
                self.results[index] = task()
            except Abandoned:
                pass
            except BaseException as error:  # handed to the caller of run(), with the worker named
                self.errors[index] = error
            self.done[index] = True
            self.waiting[index] = None
            self.yielded.release()

    def switch_to(self, index: int) -> None:
        """Let worker ``index`` run until it waits or finishes."""
        self.current = index
        self.resume[index].release()
        self.yielded.acquire()
        self.current = -1

    def stop(self) -> None:
        self.closing = True
        for semaphore in self.resume:
            semaphore.release()


class LockStep:
    """Runs tasks on up to ``size`` workers, one at a time (see the module docstring). The threads
    are started as needed and kept for the next :meth:`run`; :meth:`close` (or collection) stops
    them."""

    def __init__(self, size: int) -> None:
        self.size = check_positive_int(size, "size", "LockStep")
        self._crew = _Crew()
        self._finalizer = weakref.finalize(self, self._crew.stop)

    def run(self, tasks: Sequence[Callable[[], Any]]) -> list[Any]:
        """Every task on a worker of its own (task ``i`` on worker ``i``); their results, in order.
        A task that raises makes every waiting task give up (:class:`Abandoned`), and its error is
        raised here with a note naming the worker; :class:`Deadlock` when none can go on."""
        crew = self._crew
        if crew.current != -1:
            raise RuntimeError("LockStep.run was called from inside a simulated worker")
        if crew.closing:
            raise RuntimeError("LockStep.run after close()")
        if len(tasks) > self.size:
            raise ValueError(f"LockStep.run: {len(tasks)} tasks for {self.size} workers")
        count = len(tasks)
        crew.grow(count)
        for index, task in enumerate(tasks):
            crew.tasks[index], crew.results[index], crew.errors[index] = task, None, None
            crew.done[index], crew.waiting[index], crew.waited[index] = False, None, False
        if count == 1:  # nobody to wait for
            crew.tasks[0], crew.done[0] = None, True
            return [self._inline(tasks[0], 0, count)]
        self._step(0, count)
        if not crew.waited[0]:
            # The first task never had to wait: the others take the same path (the ranks launch
            # the same collectives), so they run here, one after another, without a switch.
            results = [crew.results[0]]
            for index in range(1, count):
                crew.tasks[index], crew.done[index] = None, True
                results.append(self._inline(tasks[index], index, count))
            return results
        while True:
            progressed = False
            for index in range(count):
                if crew.done[index]:
                    continue
                waiting = crew.waiting[index]
                if waiting is not None and not waiting[0]():
                    continue
                progressed = True
                self._step(index, count)
            if all(crew.done[:count]):
                return list(crew.results[:count])
            if not progressed:
                stuck = [f"worker {i}: {crew.waiting[i][1]()}" for i in range(count) if not crew.done[i]]
                self._abandon(count)
                raise Deadlock("no simulated worker can go on (ranks launched different collectives?):\n"
                               + "\n".join(stuck))

    def _step(self, index: int, count: int) -> None:
        """Let worker ``index`` run until it waits or finishes; raise what it raised."""
        crew = self._crew
        crew.switch_to(index)
        error = crew.errors[index]
        if error is not None:
            crew.errors[index] = None
            self._abandon(count)
            error.add_note(f"(in simulated worker {index} of {count})")
            raise error

    def _inline(self, task: Callable[[], Any], index: int, count: int) -> Any:
        crew = self._crew
        crew.inline = index
        try:
            return task()
        except BaseException as error:
            error.add_note(f"(in simulated worker {index} of {count})")
            raise
        finally:
            crew.inline = -1

    def wait_until(self, ready: Callable[[], bool], describe: Callable[[], str]) -> None:
        """Called by a worker: return once ``ready()``, letting the other workers run meanwhile;
        ``describe()`` says what it waits for (for a deadlock's report)."""
        if ready():
            return
        crew = self._crew
        index = crew.current
        if index < 0:
            where = "outside a simulated worker" if crew.inline < 0 else \
                f"in simulated worker {crew.inline}, run in turn after worker 0 finished without waiting"
            raise RuntimeError(f"waiting {where} for {describe()}: it can never arrive")
        crew.waited[index] = True
        crew.waiting[index] = (ready, describe)
        crew.yielded.release()
        crew.resume[index].acquire()
        crew.waiting[index] = None
        if crew.abandoning or crew.closing:
            raise Abandoned

    def _abandon(self, count: int) -> None:
        """Make every unfinished worker give up, and wait until each has."""
        crew = self._crew
        crew.abandoning = True
        try:
            for index in range(count):
                if crew.done[index]:
                    continue
                if crew.tasks[index] is not None:  # never started: nothing to unwind
                    crew.tasks[index], crew.done[index] = None, True
                    continue
                crew.switch_to(index)
                crew.errors[index] = None
        finally:
            crew.abandoning = False

    def close(self) -> None:
        """Stop the threads (idempotent)."""
        self._finalizer()
