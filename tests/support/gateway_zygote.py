"""A parent that has imported the gateway once and forks a ``gateway serve`` per test.

Every gateway process a test starts spends ~7 CPU-s importing torch, transformers and qwen_tts
(librosa, scikit-learn and scipy with them) before it touches the model; the suite starts
about ten. This process pays that once per test run: it imports everything ``python -m
gateway serve`` imports, then forks on request, for every test worker of the run (each
connects to its Unix socket). The child runs ``gateway/__main__.py`` as ``python -m gateway``
would (``runpy``, ``sys.argv``, its own environment, stdout and stderr to the test's log
file), so it is a real process with its own signal handlers, SIGTERM and SIGHUP included, and
its exit code is the command's. At exit it joins its non-daemon threads and runs the
``atexit`` handlers, as an interpreter does.

Forking is safe only from a single-threaded parent: nothing here starts a thread (checked
before every fork; torch's OpenMP pool starts at the first operation, which never runs here).

Usage: ``gateway_zygote.py SOCKET ROOT_PID``. It says ``ready`` on stdout once it listens, and
exits (killing the children left) when process ``ROOT_PID`` (the test run) ends. Protocol, one
JSON object per line on a connection. In: ``{"argv": [...], "env": {...}, "cwd": ...,
"log": path}``. Out: ``{"pid": n}`` for each request, in order, and ``{"exit": n, "code":
c}`` when child ``n`` ends (``c`` as ``subprocess.Popen.returncode``: minus the signal's
number when a signal ended it). When a connection closes (its test worker exited), the
children it asked for that are left are killed.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import runpy
import selectors
import signal
import socket
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


def _child(request: dict[str, Any], inherited: list[int]) -> NoReturn:
    code: int = 1
    try:
        for fd in inherited:  # the zygote's socket, connections, selector and pidfds
            os.close(fd)
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
    path, root = sys.argv[1], int(sys.argv[2])
    sys.path[0] = os.getcwd()
    # The replies go over the connections: what libraries print on import (qwen_tts prints a
    # flash-attn notice, which a gateway started by exec logs) is dropped.
    out = os.fdopen(os.dup(1), "w")
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.close(null)
    _preload()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen()
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, "accept")
    run = os.pidfd_open(root)
    selector.register(run, selectors.EVENT_READ, "run")
    out.write("ready\n")
    out.close()
    pending: dict[socket.socket, bytes] = {}  # connection -> bytes short of a line
    children: dict[int, tuple[int, socket.socket]] = {}  # pidfd -> (pid, who asked)

    def say(conn: socket.socket, message: dict[str, Any]) -> None:
        if conn in pending:
            try:
                conn.sendall((json.dumps(message) + "\n").encode())
            except OSError:
                pass  # the worker went away; its connection's EOF cleans up

    def kill(pid: int) -> None:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def fork(conn: socket.socket, request: dict[str, Any]) -> None:
        if threading.active_count() != 1:
            raise RuntimeError(f"not forking with threads: {threading.enumerate()}")
        inherited = [listener.fileno(), run, selector.fileno(), *children,
                     *(c.fileno() for c in pending)]
        pid = os.fork()
        if pid == 0:
            _child(request, inherited)
        pidfd = os.pidfd_open(pid)
        children[pidfd] = (pid, conn)
        selector.register(pidfd, selectors.EVENT_READ, "child")
        say(conn, {"pid": pid})

    def hang_up(conn: socket.socket) -> None:
        """A worker went away (or sent what is not a request): kill what it left running."""
        selector.unregister(conn)
        del pending[conn]
        conn.close()
        for pid, owner in children.values():
            if owner is conn:
                kill(pid)

    bound = os.stat(path).st_ino
    try:
        while True:
            for key, _ in selector.select():
                if key.data == "accept":
                    try:
                        conn, _ = listener.accept()
                    except OSError:
                        continue  # the worker gave up connecting
                    pending[conn] = b""
                    selector.register(conn, selectors.EVENT_READ, "conn")
                elif key.data == "run":
                    return  # the test run is over
                elif key.data == "conn":
                    conn = key.fileobj  # type: ignore[assignment]
                    try:
                        data = conn.recv(65536)
                    except OSError:  # reset: it exited with replies unread
                        data = b""
                    if not data:
                        hang_up(conn)
                        continue
                    *lines, pending[conn] = (pending[conn] + data).split(b"\n")
                    try:
                        requests = [json.loads(line) for line in lines]
                    except ValueError:
                        hang_up(conn)  # one worker's garbage ends its connection, not the run
                        continue
                    for request in requests:
                        fork(conn, request)
                else:
                    pidfd = key.fd
                    pid, owner = children.pop(pidfd)
                    selector.unregister(pidfd)
                    os.close(pidfd)
                    _, status = os.waitpid(pid, 0)
                    say(owner, {"exit": pid, "code": os.waitstatus_to_exitcode(status)})
    finally:
        for pid, _ in children.values():
            kill(pid)
        # The socket's name first, so no worker connects to a closing listener; only if it is
        # still ours.
        with contextlib.suppress(FileNotFoundError):
            if os.stat(path).st_ino == bound:
                os.unlink(path)
        listener.close()


if __name__ == "__main__":
    main()
