"""edgekv.install: profilers and the parameter solver that write the runtime config."""
