"""A fork server for commands run as a user types them (tests/test_readme.py).

A fresh interpreter that imports torch, transformers and W&B costs 5-10 s of CPU before a
command starts. :func:`python_on_path` starts a server that imports them once and puts a
``python`` first on PATH that hands ``python -m specdec...`` to it: each command runs in a
fresh fork, with its own argv, directory, environment and standard streams, as ``python -m``
would run it. Anything else goes to the real interpreter; ``SPECDEC_README_FORK=0`` sends
everything there.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

#: Run as ``python -c SERVER SOCKET MODULE...``: imports the modules, then serves each request
#: (argv, directory, environment and the caller's fds 0-2) in a fresh fork, as ``python -m``
#: would run it, and sends back its exit status; a command whose caller is gone is killed.
SERVER = r"""
import atexit, json, os, runpy, select, signal, socket, struct, sys, threading, traceback
for name in sys.argv[2:]:
    __import__(name)
listener = socket.socket(socket.AF_UNIX)
listener.bind(sys.argv[1] + ".new")
listener.listen(64)
os.rename(sys.argv[1] + ".new", sys.argv[1])  # there once it listens


def command(request):
    os.setpgid(0, 0)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.path[0] = request["cwd"]
    sys.argv = ["-m", *request["argv"][1:]]
    code = 0
    try:
        runpy.run_module(request["argv"][0], run_name="__main__", alter_sys=True)
    except SystemExit as exit:
        code = exit.code
        if not isinstance(code, int):
            code = 0 if code is None else (print(code, file=sys.stderr) or 1)
    except BaseException:
        traceback.print_exc()
        code = 1
    threading._shutdown()  # what the interpreter does at exit: non-daemon threads, atexit hooks
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


def serve(connection):
    data, fds, _, _ = socket.recv_fds(connection, 1 << 20, 3)
    size = struct.unpack("!I", data[:4])[0]
    data = data[4:]
    while len(data) < size:
        data += connection.recv(1 << 20)
    pid = os.fork()
    if pid == 0:
        connection.close()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        command(json.loads(data))
    for fd in fds:
        os.close(fd)
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if select.select([connection], [], [], 0.1)[0] and not connection.recv(1):
            os.killpg(pid, signal.SIGKILL)  # the caller is gone (a timeout): so is its command
            os._exit(0)
    connection.sendall(struct.pack("!i", os.waitstatus_to_exitcode(status)))
    os._exit(0)

parent = os.getppid()
listener.settimeout(5)
while True:
    try:
        connection, _ = listener.accept()
    except TimeoutError:
        if os.getppid() != parent:  # the test process is gone: so is its server
            sys.exit()
        continue
    connection.settimeout(None)
    while True:
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                break
        except ChildProcessError:
            break
    if os.fork() == 0:
        listener.close()
        serve(connection)
    connection.close()
"""

#: What ``python`` is on the commands' PATH: ``python -m specdec...`` goes to the fork server,
#: anything else to the real interpreter.
SHIM = """#!{python} -SE
import json, os, socket, struct, sys
args = sys.argv[1:]
if len(args) < 2 or args[0] != "-m" or not args[1].startswith("specdec."):
    os.execv({python!r}, [{python!r}, *args])
client = socket.socket(socket.AF_UNIX)
client.connect({socket!r})
request = json.dumps({{"argv": args[1:], "cwd": os.getcwd(), "env": dict(os.environ)}}).encode()
socket.send_fds(client, [struct.pack("!I", len(request)) + request], [0, 1, 2])
status = b""
while len(status) < 4:
    chunk = client.recv(4 - len(status))
    if not chunk:
        sys.exit("the fork server of tests/test_readme.py is gone")
    status += chunk
code = struct.unpack("!i", status)[0]
sys.exit(code if code >= 0 else 128 - code)
"""

#: imported once by the fork server: what every command imports (not the commands' own
#: modules, which each command runs afresh as __main__)
PRELOAD = [
    "torch",
    "transformers",
    "hydra",
    "wandb",
    "matplotlib.pyplot",
    "specdec.decoders",
    "specdec.decoders.evaluation.benchmark",
    "specdec.decoders.evaluation.bench_results",
    "specdec.decoders.evaluation.tracking",
    "specdec.decoders.evaluation.audit",
    "specdec.decoders.evaluation.replay",
    "specdec.decoders.evaluation.report",
    "specdec.train.job",
]


@contextmanager
def python_on_path() -> Iterator[dict[str, str]]:
    """The environment the commands run in: this process's, with the fork server's ``python``
    first on PATH (unless SPECDEC_README_FORK=0)."""
    env = dict(os.environ)
    if os.environ.get("SPECDEC_README_FORK", "1") == "0":
        yield env
        return
    # AF_UNIX paths are short (108 bytes): a fresh folder under /tmp, not pytest's
    directory = Path(tempfile.mkdtemp(prefix="readme-"))
    socket_path = directory / "server"
    log = open(directory / "server.log", "w")
    server = subprocess.Popen(
        [sys.executable, "-c", SERVER, str(socket_path), *PRELOAD],
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 300
    while not socket_path.exists():
        assert server.poll() is None, (directory / "server.log").read_text()
        assert time.monotonic() < deadline, "the fork server did not start"
        time.sleep(0.1)
    (directory / "bin").mkdir()
    shim = directory / "bin" / "python"
    shim.write_text(SHIM.format(python=sys.executable, socket=str(socket_path)))
    shim.chmod(0o755)
    env["PATH"] = f"{directory / 'bin'}{os.pathsep}{env['PATH']}"
    yield env
    server.kill()
    server.wait()
    log.close()
    shutil.rmtree(directory, ignore_errors=True)
