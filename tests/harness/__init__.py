"""What the tests share, and nothing else imports: the runner as users run it (runner), rank
programs on threads and gloo processes (parallel, spmd_programs), megatron-core oracles
(megatron_*), the checkpoints, bad inputs, data files and layouts several test modules use. No test
module imports another test module; they import from here."""
