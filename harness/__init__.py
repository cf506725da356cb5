"""Real processes, runtimes, fakes and the simulation that tests and tools share; never imported by infx."""
