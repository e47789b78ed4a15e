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
