"""A parent that has imported the gateway once and forks a ``gateway serve`` per test.

Every gateway process a test starts spends ~7 CPU-s importing torch, transformers and qwen_tts
(librosa, scikit-learn and scipy with them) before it touches the model; the suite starts
about ten. This process pays that once per test worker: it imports everything ``python -m
gateway serve`` imports, then forks on request. The child runs ``gateway/__main__.py`` as
``python -m gateway`` would (``runpy``, ``sys.argv``, its own environment, stdout and stderr
to the test's log file), so it is a real process with its own signal handlers, SIGTERM and
SIGHUP included, and its exit code is the command's. At exit it joins its non-daemon threads
and runs the ``atexit`` handlers, as an interpreter does.

Forking is safe only from a single-threaded parent: nothing here starts a thread (checked
before every fork; torch's OpenMP pool starts at the first operation, which never runs here).

Protocol, one JSON object per line. In (stdin): ``{"argv": [...], "env": {...}, "cwd": ...,
"log": path}``. Out (stdout): ``{"pid": n}`` for each request, in order, and ``{"exit": n,
"code": c}`` when child ``n`` ends (``c`` as ``subprocess.Popen.returncode``: minus the
signal's number when a signal ended it). When stdin closes (the test worker exited), the
children left are killed and this process exits.
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
import selectors
import signal
import sys
import threading
from typing import Any, NoReturn


def _preload() -> None:
    # What `gateway serve` imports on its way to ready, the model's libraries included.
    import qwen_tts  # noqa: F401
    import uvicorn  # noqa: F401

    import gateway.app
    import gateway.asr.sphinx
    import gateway.audio.vad
    import gateway.cli
    import gateway.server
    import gateway.sip.endpoint
    import gateway.tts.batched
    import gateway.tts.qwen  # noqa: F401


def _child(request: dict[str, Any]) -> NoReturn:
    code: int = 1
    try:
        fd = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        # As `python -m gateway` sets them: the working directory first on the path.
        sys.path[0] = request["cwd"]
        sys.argv = ["-m", *request["argv"]]
        try:
            runpy.run_module("gateway", run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            if not isinstance(exc.code, (int, type(None))):
                print(exc.code, file=sys.stderr)
        except BaseException:
            import traceback

            traceback.print_exc()
            code = 1
        # What the interpreter does at exit: wait for the non-daemon threads, then atexit.
        for thread in threading.enumerate():
            if thread is not threading.main_thread() and not thread.daemon:
                thread.join()
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def main() -> None:
    sys.path[0] = os.getcwd()
    # The replies keep the stdout pipe to themselves: what libraries print on import (qwen_tts
    # prints a flash-attn notice, which a gateway started by exec logs) is dropped.
    out = os.fdopen(os.dup(1), "w")
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.close(null)
    _preload()
    selector = selectors.DefaultSelector()
    selector.register(sys.stdin, selectors.EVENT_READ, None)
    children: dict[int, int] = {}  # pidfd -> pid

    def say(message: dict[str, Any]) -> None:
        out.write(json.dumps(message) + "\n")
        out.flush()

    while True:
        for key, _ in selector.select():
            if key.data is None:
                line = sys.stdin.readline()
                if not line:
                    for pid in children.values():
                        try:
                            os.kill(pid, signal.SIGKILL)
                        except ProcessLookupError:
                            pass
                    return
                if threading.active_count() != 1:
                    raise RuntimeError(f"not forking with threads: {threading.enumerate()}")
                request = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    _child(request)
                pidfd = os.pidfd_open(pid)
                children[pidfd] = pid
                selector.register(pidfd, selectors.EVENT_READ, pid)
                say({"pid": pid})
            else:
                pidfd = key.fd
                pid = children.pop(pidfd)
                selector.unregister(pidfd)
                os.close(pidfd)
                _, status = os.waitpid(pid, 0)
                say({"exit": pid, "code": os.waitstatus_to_exitcode(status)})


if __name__ == "__main__":
    main()
