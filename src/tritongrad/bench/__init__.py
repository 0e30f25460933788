"""``tritongrad bench``: tritongrad against eager PyTorch, torch.compile and other kernel libraries.

- ``ops.py``        the op table: input makers, the bytes each pass must move, default shape sweeps
- ``providers.py``  the provider table: who runs an op, and why a provider is skipped
- ``harness.py``    modes (fwd / bwd / fwdbwd), timing, peak memory, host overhead, the sweep
- ``roofline.py``   the device's copy bandwidth, the ceiling every result is compared with
- ``report.py``     terminal table, JSON and CSV, the closing summary
- ``plots.py``      one PNG per op: GB/s against bytes moved, with the copy-bandwidth line
- ``cli.py``        the ``tritongrad bench`` subcommand

Nothing heavy is imported here: ``tritongrad`` builds its parser before it decides whether Triton must run
in its interpreter, which has to be chosen before triton is imported.
"""
