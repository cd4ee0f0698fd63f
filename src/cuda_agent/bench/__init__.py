"""KernelBench runs: baselines on the current hardware, the paper's metrics, reports and plots."""
