"""The decode step's helper thread (runtime/aside.py, runtime/native/ekv_aside.c) where it spins out of work: every
job still runs once, and closing it while it spins ends it (a stop set during its spin was once slept through, and
``close`` waited for it forever)."""
import subprocess
import sys
import textwrap

STRESS = textwrap.dedent("""
    import ctypes, time
    import numpy as np
    from edgekv.runtime import aside
    aside.cores = lambda: 2
    ran = []
    unit = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int)(lambda ctx, u, worker: ran.append(u))
    fn = ctypes.cast(unit, ctypes.c_void_p).value
    job = np.zeros(8, dtype=np.uint8)
    for i in range(200):
        helper = aside.AsideThread.open(spin_us=300)
        helper.share(fn, job, 3)
        if i % 2:
            helper.wait(helper.post(fn, job, 2))
        if i % 3 == 0:
            time.sleep(0.0001)  # close while it spins, or after
        helper.close()
    print(len(ran))
""")


def test_a_spinning_helper_runs_every_unit_once_and_closes_while_it_spins():
    done = subprocess.run([sys.executable, "-c", STRESS], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) == 200 * 3 + 100 * 2


def test_a_chain_of_posted_jobs_runs_in_order_once_each_and_after_close_on_the_caller(monkeypatch):
    """``post_chain`` posts several jobs in one call (a select's scores, votes and top-M): each job's units run once,
    a job's all before the next one's (the helper runs posted jobs in order), and once the thread is closed the
    caller runs them, in the same order."""
    import ctypes

    import numpy as np

    from edgekv.runtime import aside

    monkeypatch.setattr(aside, "cores", lambda: 2)
    ran = []
    units = [ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int)(
        lambda ctx, u, worker, tag=tag: ran.append((tag, u))) for tag in "abc"]
    jobs = [(ctypes.cast(unit, ctypes.c_void_p).value, np.zeros(8, dtype=np.uint8), n) for unit, n in
            zip(units, (3, 1, 2))]
    expected = [("a", 0), ("a", 1), ("a", 2), ("b", 0), ("c", 0), ("c", 1)]
    helper = aside.AsideThread.open()
    assert helper is not None
    for _ in range(20):
        helper.wait(helper.post_chain(jobs, keep=("kept",)))
        assert ran == expected
        ran.clear()
    helper.close()
    assert helper.post_chain(jobs) == 0 and ran == expected
