"""Chaos: training through cut links, a restarted relay, packet loss, a frozen worker, a path change, and
many clients at once; each run's losses must equal an undisturbed one."""
