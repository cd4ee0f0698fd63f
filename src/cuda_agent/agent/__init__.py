"""The agent: workspace, tools, loop, model backends, trajectories."""
