"""How a command stops on SIGINT, SIGTERM or SIGHUP, and the pieces the file layer needs to keep
the rule (README, "Errors and exit codes"):

* The first stop signal ends the command: the main thread's handler raises KeyboardInterrupt
  (SIGINT) or Terminated, so that every ``with`` and ``finally`` on the way out runs (the
  temporary output removed); later signals are ignored.
* The rename of a finished output over its destination is the one commit point.  A signal
  that arrives before it leaves the destination as it was and the exit is 128 + n; one that
  arrives after it is not an interruption of anything: the output is complete, the command
  says so and exits 0.  The rename runs with the handler deferring (it records the signal and
  returns), so that no exception lands between the rename and the record of it.
* A watchdog thread learns of the signal from the C-level wakeup file descriptor (at once, even
  while the main thread runs a long C call) and, if the process has not ended GRACE seconds
  later (a worker thread the clean-up waits for that waits on a lock the interrupted main
  thread left held, a long fsync), removes the temporary outputs, prints the line the command
  would have printed and ends the process with the code it would have returned.
* Worker pools here (``Workers``) run daemon threads that nothing joins on the way out of an
  error or a stop, so that no clean-up waits for a worker that may wait for ever.
"""
import collections
import concurrent.futures
import os
import queue
import signal
import threading
import time

#: Seconds from a stop signal to the watchdog's end of the process.
GRACE = 0.75
STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP")
                     if hasattr(signal, name))


class Terminated(BaseException):
    """SIGTERM or SIGHUP, raised in the main thread as Ctrl-C raises KeyboardInterrupt, so that
    the same clean-up runs (the temporary output removed) on the way out."""

    def __init__(self, signum):
        super().__init__(signum)
        self.signum = signum


class _State:
    def __init__(self):
        self.signum = None       # the first stop signal the handler saw
        self.defer = 0           # > 0 while a commit renames: the handler only records
        self.final = False       # the running command's commit is its result (fuse, extract)
        self.complete = None     # that result's path, once renamed into place
        self.exit_code = None    # decided: the command has returned, or is on its way out
        self.reported = False    # the command's last line (stop or completion) is printed
        self.armed = False       # the watchdog may end the process


state = _State()
#: Held across a commit's rename, and by the watchdog while it decides: no rename after it.
commit_lock = threading.Lock()
#: One last line, by the command or by the watchdog.
report_lock = threading.Lock()
#: Temporary outputs of writers neither committed nor aborted.
temps = set()


def reset(final=False):
    global state
    state = _State()
    state.final = final


def stop_exception(signum):
    return KeyboardInterrupt() if signum == signal.SIGINT else Terminated(signum)


def signal_name(signum):
    return signal.Signals(signum).name


def stop_line(signum):
    return ("ltx2blas: interrupted" if signum == signal.SIGINT
            else f"ltx2blas: terminated by {signal_name(signum)}")


def complete_line(signum, path):
    return (f"ltx2blas: {signal_name(signum)} came after the output was complete: {path} is "
            "written in full and in place")


def on_signal(signum, frame):
    """The handler of the stop signals (main thread)."""
    st = state
    if st.signum is not None:
        return  # a second signal: the first one's stop is under way
    st.signum = signum
    if st.defer or st.complete is not None or st.exit_code is not None:
        return  # mid-rename (checked after it), or nothing left to interrupt
    raise stop_exception(signum)


def check():
    """Raise the stop for a signal recorded but not raised (its exception swallowed where
    Python cannot raise, as in a __del__)."""
    if state.signum is not None and not state.defer and state.complete is None:
        raise stop_exception(state.signum)


def commit_rename(temp, path):
    """os.replace(temp, path) as the commit point: refused (nothing changed) when a stop signal
    came first; a signal during it is deferred, and after it, for the command's own output,
    reported as arriving after completion."""
    st = state
    st.defer += 1
    try:
        with commit_lock:
            if st.signum is not None:
                raise stop_exception(st.signum)
            os.replace(temp, path)
            temps.discard(temp)
            if st.final:
                st.complete = path
    finally:
        st.defer -= 1
    check()  # a signal during an intermediate file's rename (demo) stops the command now


def report(code, line, stream):
    """Print the command's last line once (the watchdog may be printing it) and fix the exit
    code; returns the code."""
    with report_lock:
        state.exit_code = code
        if line and not state.reported:
            state.reported = True
            print(line, file=stream, flush=True)
    return code


# ---- the watchdog ---------------------------------------------------------------------------

_wakeup = None  # (read end, write end) of the wakeup pipe, made once per process


def arm():
    """Start the watchdog (once per process) and point the wakeup fd at it; main thread only.
    Returns the previous wakeup fd."""
    global _wakeup
    if _wakeup is None:
        r, w = os.pipe()
        os.set_blocking(w, False)
        _wakeup = (r, w)
        threading.Thread(target=_watch, args=(r,), name="ltx2blas-watchdog",
                         daemon=True).start()
    state.armed = True
    return signal.set_wakeup_fd(_wakeup[1], warn_on_full_buffer=False)


def disarm(previous):
    state.armed = False
    try:
        signal.set_wakeup_fd(previous)
    except ValueError:  # off the main thread
        pass


def _watch(fd):
    while True:
        try:
            data = os.read(fd, 64)
        except OSError:
            return
        first = next((b for b in data if b in STOP_SIGNALS), None)
        if first is None:
            continue
        time.sleep(GRACE)
        if state.armed:
            _last_resort(first)


def _last_resort(first):
    """The process has not ended GRACE seconds after a stop signal: end it as the command
    would have."""
    commit_lock.acquire(timeout=0.2)  # no rename after this; the lock may be left held
    signum = state.signum or first
    for temp in list(temps):
        try:
            os.unlink(temp)
        except OSError:
            pass
    if state.exit_code is not None:
        code, line = state.exit_code, None
    elif state.complete is not None:
        code, line = 0, complete_line(signum, state.complete)
    else:
        code, line = 128 + signum, stop_line(signum)
    if report_lock.acquire(timeout=0.2) and line and not state.reported:
        state.reported = True
        try:
            os.write(2, (line + "\n").encode())
        except OSError:
            pass
    _flush_stdout()
    os._exit(code)


def _flush_stdout():
    """What the command printed is not lost; a flush stuck on a full pipe is left behind."""
    import sys

    def flush():
        try:
            sys.stdout.flush()
        except BaseException:
            pass

    t = threading.Thread(target=flush, daemon=True)
    t.start()
    t.join(0.1)


# ---- worker threads a stop does not wait for ------------------------------------------------

class Workers:
    """Daemon threads running submitted calls in the order given, each result a
    concurrent.futures.Future.  Unlike ThreadPoolExecutor, nothing joins them on the way out of
    an error or a stop (``close(cancel=True)``, or the ``with`` block left by an exception):
    the calls not started are dropped, and a worker that waits for ever (on a lock an
    interrupted main thread left held) holds up neither the command nor the interpreter's
    exit.  After success ``close()`` waits for them, all work done."""

    def __init__(self, workers, name="ltx2blas-worker"):
        self._queue = queue.SimpleQueue()
        self._cancelled = False
        self._threads = [threading.Thread(target=self._run, name=name, daemon=True)
                         for _ in range(max(1, workers))]
        for t in self._threads:
            t.start()

    def submit(self, fn, *args):
        future = concurrent.futures.Future()
        self._queue.put((future, fn, args))
        return future

    def _run(self):
        while True:
            item = self._queue.get()
            if item is None:
                return
            future, fn, args = item
            if self._cancelled or not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn(*args)
            except BaseException as exc:
                future.set_exception(exc)
            else:
                future.set_result(result)

    def map(self, fn, items, ahead=None):
        """fn(item) for each item, in order; at most ``ahead`` (two per thread) submitted
        before their results are taken, so that a stop leaves little work queued."""
        ahead = ahead or 2 * len(self._threads)
        pending = collections.deque()
        for item in items:
            pending.append(self.submit(fn, item))
            if len(pending) >= ahead:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()

    def close(self, cancel=False):
        if cancel:
            self._cancelled = True
        for _ in self._threads:
            self._queue.put(None)
        if not cancel:
            for t in self._threads:
                t.join()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self.close(cancel=exc_type is not None)
