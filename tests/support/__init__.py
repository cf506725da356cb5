"""What the tests share and nothing else imports: builders, fakes in process and scripted peers.

Real processes, runtimes and the simulation that tools use too are in ``harness/``; a test
module imports helpers from here or there, never from another test module.
"""
