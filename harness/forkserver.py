"""Run ``harness/run_vllm.py`` jobs in forks of one process that imported
vLLM once (a test-time saving, not part of the package).

A run of ``run_vllm.py`` spends about 10 s of its 35-40 s on 2 cores
importing vLLM in the driver process before vLLM starts anything; the test
suite makes about thirty such runs. This server imports the runner (and
with it vLLM) once and forks a child per job; the child sets the job's
environment, working directory and argv, sends its output to the job's log
and runs the runner's ``main`` as a fresh process would. What vLLM does
from there is unchanged: the engine and its workers start as usual (vLLM
spawns the workers, which import vLLM themselves), plugins are loaded when
the engine is built (``--no-plugin`` sets ``VLLM_PLUGINS`` before that), and
nothing of a job outlives its child. The import leaves one thread and no
engine state behind (checked at start: the server refuses to fork with more
threads, or with vLLM's environment cache on).

Jobs whose environment changes what runs at interpreter start (another
``PYTHONPATH``: the one-GPU harness's ``sitecustomize``) are not for this
server; ``tests/conftest.py run_generate`` starts those as plain processes.

Protocol, one JSON object per line: the client writes ``{"argv": [...],
"env": {...}, "cwd": DIR, "log": PATH}``; the server answers ``{"pid": N}``
once the child runs (its own process group: the client may kill the whole
group on a timeout) and ``{"rc": N}`` when it ended (negative: killed by that
signal).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
RUNNER = os.path.join(HERE, "run_vllm.py")


def _child(job: dict) -> int:
    """In the fork: become the job's process and run the runner."""
    import run_vllm

    os.setpgid(0, 0)
    fd = os.open(job["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.clear()
    os.environ.update(job["env"])
    os.chdir(job["cwd"])
    sys.argv = [RUNNER, *job["argv"]]
    try:
        run_vllm.main()
        return 0
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
        return 1


def _check_forkable() -> None:
    from vllm import envs

    threads = threading.enumerate()
    if len(threads) != 1 or envs._is_envs_cache_enabled():
        raise RuntimeError(f"forkserver: cannot fork safely (threads {threads})")


def serve() -> None:
    sys.path.insert(0, HERE)
    # once: what a run imports before vLLM starts its workers (the runner
    # imports vLLM lazily; the in-process engine core and its executor)
    import run_vllm  # noqa: F401
    import vllm.entrypoints.llm  # noqa: F401
    import vllm.v1.engine.core  # noqa: F401
    import vllm.v1.executor.multiproc_executor  # noqa: F401

    _check_forkable()
    replies = sys.stdout
    for line in sys.stdin:
        job = json.loads(line)
        replies.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            code = _child(job)
            sys.stdout.flush()
            sys.stderr.flush()
            sys.exit(code)  # a normal exit: vLLM's shutdown hooks run
        replies.write(json.dumps({"pid": pid}) + "\n")
        replies.flush()
        _, status = os.waitpid(pid, 0)
        replies.write(json.dumps({"rc": os.waitstatus_to_exitcode(status)}) + "\n")
        replies.flush()


if __name__ == "__main__":
    serve()
