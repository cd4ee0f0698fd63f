"""What both ends of an evaluation share: the typed messages and the channel that carries them, the timed-region and
doorbell wire formats, reads of a worker's memory from outside, and the rules both ends measure by (the policy, the
timing method, the output comparison). Imports the base layers only, neither the worker nor the evaluator's side."""
