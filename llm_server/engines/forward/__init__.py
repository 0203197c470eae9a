"""The forward: the fused layer loop, its compiled decode graphs and the kernel sets."""
