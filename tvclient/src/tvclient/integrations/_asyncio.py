"""A rollout's ToolCallExecutor under an asyncio framework (veRL, Tinker, Harbor).

The executor blocks on HTTP and on its environment, so it runs in worker threads, while the
framework's sandboxes and tools are coroutines that must run on the framework's loop: the
executor's environment (`LoopEnvironment`) hands each operation back to that loop and waits.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import os
import threading
from abc import abstractmethod
from collections.abc import Callable, Coroutine
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from ..environment import ToolExecutionEnvironment
from ..executor import ToolCallExecutor
from ..results import Call, ToolResult

T = TypeVar("T")

logger = logging.getLogger(__name__)

THREADS_VARIABLE = "TVCACHE_ROLLOUT_THREADS"

_pool_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None


def _threads() -> ThreadPoolExecutor:
    # Our own pool, not the loop's default one: a framework coroutine that the executor waits
    # for may itself need a default-pool thread (asyncio.to_thread), which waiting rollouts
    # would otherwise hold.
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(
                max_workers=int(os.environ.get(THREADS_VARIABLE, "64")),
                thread_name_prefix="tvcache-rollout",
            )
        return _pool


class RolloutEnded(RuntimeError):
    """A call came after its rollout ended (episode done, cleanup, stop)."""


class AsyncRollout:
    """One rollout's executor, awaited from the framework's loop.

    Calls run one at a time and in the order they were made, even when the framework issues
    several at once (veRL runs a turn's tool calls concurrently) or gives up waiting on one
    that is running (a cancelled call still finishes before the next one starts): each call
    takes a ticket when it is made, and its thread waits for the tickets before it.
    `open_executor` runs in the first call's thread, so it may talk to the service.
    """

    def __init__(self, open_executor: Callable[[AsyncRollout], ToolCallExecutor]) -> None:
        self._open_executor = open_executor
        self.executor: ToolCallExecutor | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.ended = False
        self._closed = False  # in turn: set by the close, seen by the calls after it
        self._turn = threading.Condition()
        self._issued = 0
        self._serving = 0

    async def execute(self, call: Call) -> ToolResult:
        if self.ended:
            raise RolloutEnded(f"the rollout has ended; {call['tool']} was not run")
        return await self._in_turn(self._execute, call)

    async def end(self) -> None:
        """End the rollout once the calls made before have run; later calls raise RolloutEnded."""
        if self.ended:
            return
        self.ended = True
        await self._in_turn(self._close, None)

    def end_soon(self) -> None:
        """`end()` from any thread (a finalizer, a timer), without waiting for it."""
        loop = self.loop
        if loop is not None and loop.is_running():
            asyncio.run_coroutine_threadsafe(self.end(), loop).add_done_callback(_log_failure)
        elif not self.ended:
            self.ended = True
            threading.Thread(target=self._close, args=(None,), name="tvcache-end").start()

    def _in_turn(self, work: Callable[[Any], T], argument: Any) -> asyncio.Future[T]:
        # No await before the ticket: the order of tickets is the order of the calls.
        self.loop = asyncio.get_running_loop()
        ticket, self._issued = self._issued, self._issued + 1
        return self.loop.run_in_executor(_threads(), self._run_in_turn, ticket, work, argument)

    def _run_in_turn(self, ticket: int, work: Callable[[Any], T], argument: Any) -> T:
        with self._turn:
            self._turn.wait_for(lambda: self._serving == ticket)
        try:
            return work(argument)
        finally:
            with self._turn:
                self._serving += 1
                self._turn.notify_all()

    def _execute(self, call: Call) -> ToolResult:
        if self._closed:
            raise RolloutEnded(f"the rollout has ended; {call['tool']} was not run")
        if self.executor is None:
            self.executor = self._open_executor(self)
        return self.executor.execute(call)

    def _close(self, _: None) -> None:
        self._closed = True
        if self.executor is not None:
            self.executor.close()


def _log_failure(ended: Future[None]) -> None:
    if not ended.cancelled() and ended.exception() is not None:
        logger.warning("a rollout did not end cleanly", exc_info=ended.exception())


class LoopEnvironment(ToolExecutionEnvironment):
    """An environment whose sandbox is driven by coroutines on the framework's loop.

    The executor calls it from a worker thread; each operation runs on `loop` and the thread
    waits for it. Operations run in an empty context (contextvars): a call replayed later runs
    as it first ran, whatever the context of the call that triggered the replay holds.

    Such sandboxes cannot be forked: their tasks are registered with a sandbox budget of 0, so
    the service never asks for a snapshot, and a miss replays from the sandbox it has.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def start(self) -> None:
        self._wait(self.astart())

    def execute(self, call: Call) -> ToolResult:
        return self._wait(self.aexecute(call))

    def stop(self) -> None:
        if self._loop.is_closed() or not self._loop.is_running():
            return  # the framework has shut down: nothing left to stop on it
        try:
            self._wait(self.astop())
        except Exception:
            # Freeing a sandbox that failed (the usual reason to stop one early) may fail too;
            # that must not hide why the call failed, nor fail the rollout's end.
            logger.warning("could not stop a sandbox", exc_info=True)

    def fork(self) -> ToolExecutionEnvironment:
        raise NotImplementedError("this framework's sandboxes cannot be forked")

    async def astart(self) -> None:
        """Bring the sandbox to the task's initial state."""

    @abstractmethod
    async def aexecute(self, call: Call) -> ToolResult:
        """Run one call in the sandbox."""

    async def astop(self) -> None:
        """The executor is done with the sandbox (the rollout ended, or a call failed)."""

    def _wait(self, coroutine: Coroutine[Any, Any, T]) -> T:
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self._loop:
            coroutine.close()
            raise RuntimeError("a LoopEnvironment must not be driven from its own loop's thread")
        submitted = contextvars.Context().run(asyncio.run_coroutine_threadsafe, coroutine, self._loop)
        return submitted.result()
