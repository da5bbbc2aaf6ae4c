"""Suite-wide setup.

The interrupt tests send themselves a real SIGINT and expect Python's KeyboardInterrupt.
A shell without job control starts background commands (`cmd &`, `nohup cmd &`, some CI
runners) with SIGINT ignored, and Python then keeps it ignored: those tests would test
how pytest was launched instead of the library. Give the suite Python's own handler.
"""

import signal

if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
