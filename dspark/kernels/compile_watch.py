"""Triton compiles that a step meets: counted on the engine that stepped, logged with their time.

Triton compiles a kernel once per specialisation: its constexprs, and each integer argument
that equals 1 or is divisible by 16. The first launch of a new specialisation compiles it (or
loads it from the disk cache) before it runs. Start-up launches the specialisations the
engine expects: runner/model_runner.py `_warm_up_eager`, and graph capture. A step that meets
one anyway stalls for the compile, hundreds of milliseconds on a fresh machine.

On the H200 the speculative arms' first repeat of a
benchmark level ran up to 1.6x slower than the second, and plain decoding's did not. This
module makes such stalls visible instead of averaged away:
- Triton's process-wide JIT hooks call it before and after every new specialisation.
- While an engine steps (engine.py sets `stats`), each compile adds to its runner stats:
  `triton_compiles`, and `triton_compile_ms` for the time it took.
- Each one is logged with the kernel's name and the time.
- Compiles outside a step (start-up, tests) are not counted.

Triton without `triton.knobs.runtime.jit_cache_hook` (older than 3.4) has nothing to hook:
`install()` returns False and nothing is counted.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable

logger = logging.getLogger(__name__)


class CompileWatch:
    def __init__(self) -> None:
        self.stats: Counter | None = None  # the stepping engine's runner stats (None: no step)
        self._started: dict[str, float] = {}  # a specialisation's repr -> when its compile began
        self._chained: tuple[Callable | None, Callable | None] = (None, None)
        self.installed = False

    def install(self) -> bool:
        """Hook Triton's JIT once per process, keeping hooks set before (called first)."""
        if self.installed:
            return True
        try:
            from triton import knobs

            runtime = knobs.runtime
            self._chained = (runtime.jit_cache_hook, runtime.jit_post_compile_hook)
        except (ImportError, AttributeError):
            return False
        runtime.jit_cache_hook = self.before_compile
        runtime.jit_post_compile_hook = self.after_compile
        self.installed = True
        return True

    def before_compile(self, **kwargs) -> bool:
        """Triton's jit_cache_hook: a new specialisation is about to be compiled (or loaded
        from the disk cache). Returns False: compile it."""
        chained = self._chained[0]
        if chained is not None and chained(**kwargs):
            return True
        self._started[kwargs.get("repr", "")] = time.perf_counter()
        return False

    def after_compile(self, **kwargs) -> None:
        """Triton's jit_post_compile_hook: it is ready."""
        chained = self._chained[1]
        if chained is not None:
            chained(**kwargs)
        name = kwargs.get("repr", "")
        started = self._started.pop(name, None)
        if self.stats is None or started is None:
            return
        ms = (time.perf_counter() - started) * 1e3
        self.stats["triton_compiles"] += 1
        self.stats["triton_compile_ms"] += round(ms)
        logger.info("a step compiled a Triton kernel not seen at start-up, %.0f ms: %s", ms,
                    name.split("(", 1)[0])  # fmt: skip


WATCH = CompileWatch()
